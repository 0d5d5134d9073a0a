"""``lee18:fc=model_parallel|data_parallel|auto``: Lee et al.'s model-parallel FC layers in lee18.

Why a mixin here and not code in :mod:`lowcomm.methods.schedules`: the scheduling engine is
data-parallel by construction (every parameter's gradient is averaged); the model-parallel
layers sit beside it. :class:`ModelParallelFC` runs around :class:`EngineMethod`'s life cycle:

* ``wrap``: picks the ``nn.Linear`` layers (``fc=model_parallel``: every plain Linear whose
  output neurons split evenly over the ranks and whose parameters are its own and trainable;
  ``auto``: those of them that :func:`~lowcomm.parallel.fc.choose_model_parallel` picks for
  ``fc_batch`` rows per worker (default: the run's batch size) at 1 Gbit/s and 50 µs per
  collective, and none under fp16 loss scaling, which needs data-parallel layers;
  ``data_parallel``: none; when that would be every trainable layer, the last one stays
  data-parallel, since the engine needs one), broadcasts their weights from rank 0 (as the engine does for the
  rest) and swaps each for a :class:`~lowcomm.parallel.fc.ModelParallelLinear` holding this
  rank's rows. The engine skips those partitions (they carry
  :data:`~lowcomm.parallel.fc.LOCAL_ATTR`), so they are never averaged or all-gathered.
* ``optimizer_step``: the engine's sharded step, then the user's optimizer on the partitions
  only (:func:`~lowcomm.optim.sharded.step_subset`): their gradient is already the global
  batch's average, computed on the rank that owns them, so the update is DDP's update of those
  rows. Lee et al. then all-gather the updated weights; here no rank ever needs the full
  weight during training, so that all-gather is not sent (its bytes are not counted either).
* ``flush``: the engine's flush, then every layer's :meth:`consolidate` (one all-gather of the
  weights), so ``state_dict()`` has the full weights and evaluation runs locally.

Gradient clipping (:meth:`ModelParallelFC.clip_grad_norm_`) adds the partitions' squares to
the engine's norm. Refused in one line, not approximated: fp16 GradScaler with model-parallel
layers chosen by ``fc=model_parallel`` (the scaler sees the engine's shards only). Under
``--compute emulated`` the layers keep their real exchanges around the profiled waits
(:mod:`lowcomm.parallel.fc_emulated`). The optimizer state of a partition stays
partition-shaped in the user's optimizer (each rank's checkpoint file holds its own), so a
resume needs the same world size, which checkpoints require anyway. Training forwards need
the same number of rows on every rank (the trainer's sampler gives that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.optim.sharded import check_elementwise, hyperparameters, step_subset
from lowcomm.parallel.fc import ModelParallelLinear, choose_model_parallel
from lowcomm.parallel.fc_emulated import emulate_model_parallel
from lowcomm.runtime.emulated import emulation_of
from lowcomm.sched.cost import AlphaBeta
from lowcomm.sched.options import Lee18Fields
from lowcomm.sched.shardview import clip_sharded_

FC_MODES = ("auto", "model_parallel", "data_parallel")
#: the link ``fc=auto`` assumes: 50 µs per collective, 1 Gbit/s, the simulator's ``1gbit`` preset
#: (:data:`lowcomm.sim.network.PRESETS`); only the ratio of α to β matters for the choice
AUTO_COST = AlphaBeta(alpha=50e-6, beta=8.0 / 1e9)


@dataclass
class Lee18FCFields(Lee18Fields):
    """lee18's options plus ``fc`` (how Linear layers are parallelized) and ``fc_batch``
    (rows per worker that ``fc=auto`` assumes: by default the run's batch size, right for
    classifier heads; give batch x sequence length for token models; 64 when the run's batch
    is unknown)."""

    fc: str = "auto"
    fc_batch: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.fc = str(self.fc).strip().lower()
        if self.fc not in FC_MODES:
            raise UsageError(f"lee18: fc={self.fc!r} is not valid; valid: {', '.join(FC_MODES)}")
        if self.fc_batch is not None:
            if int(self.fc_batch) < 1:
                raise UsageError(f"lee18: fc_batch must be >= 1, got {self.fc_batch}")
            self.fc_batch = int(self.fc_batch)


def _own_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Plain ``nn.Linear`` layers whose trainable parameters no other module shares (tied
    weights and subclasses such as attention's out-projection, read without ``forward``, stay
    data-parallel)."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear and all(
            p.requires_grad and owners[id(p)] == 1 for p in m.parameters()
        ):
            out.append((name, m))
    return out


class ModelParallelFC:
    """Mixin for the ``lee18`` method (see module docstring); put before ``EngineMethod``."""

    options: Any
    name: ClassVar[str]

    def model_parallel_layers(self) -> list[tuple[str, ModelParallelLinear]]:
        """The model-parallel layers of the wrapped model (empty before ``wrap``)."""
        model = getattr(self, "_fc_model", None)
        if model is None:
            return []
        return [(n, m) for n, m in model.named_modules() if isinstance(m, ModelParallelLinear)]

    def _choose(self, model: nn.Module, world: int, ctx: MethodContext) -> list[tuple[str, nn.Linear]]:
        o = self.options
        if o.fc == "data_parallel" or world < 2:
            return []
        if o.fc == "auto" and ctx.loss_scaling:
            return []  # auto picks what works: fp16 loss scaling needs every layer data-parallel
        rows = o.fc_batch or ctx.batch_size or 64
        picked = []
        for name, m in _own_linears(model):
            if m.out_features % world:
                continue
            if o.fc == "auto" and not choose_model_parallel(
                m.in_features, m.out_features, rows, world, AUTO_COST, bias=m.bias is not None
            ):
                continue
            picked.append((name, m))
        chosen = {id(p) for _, m in picked for p in m.parameters()}
        if picked and all(id(p) in chosen for p in model.parameters() if p.requires_grad):
            picked.pop()  # the engine needs one data-parallel layer: the last stays data-parallel
        return picked

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """Swap the chosen Linear layers for model-parallel ones, then the engine's wrap."""
        pg = ctx.process_group
        world = dist.get_world_size(pg) if dist.is_initialized() else 1
        rank = dist.get_rank(pg) if dist.is_initialized() else 0
        existing = [m for m in model.modules() if isinstance(m, ModelParallelLinear)]
        if not existing:
            for name, lin in self._choose(model, world, ctx):
                with torch.no_grad():  # rank 0's weights, as the engine does for the others
                    src = dist.get_global_rank(pg, 0) if pg is not None else 0
                    for p in lin.parameters():
                        accounting.broadcast(p.data, src, group=pg, tag=f"{self.name}.init")
                mp = ModelParallelLinear(
                    lin, group=pg, world=world, rank=rank, tag=f"{self.name}.fc"
                )
                model.set_submodule(name, mp.to(lin.weight.device))
                if (
                    emu := emulation_of(model)
                ) is not None:  # --compute emulated: exchanges stay real
                    emulate_model_parallel(emu, lin, mp)
            existing = [m for m in model.modules() if isinstance(m, ModelParallelLinear)]
        # the engine's initial broadcast sends every parameter from rank 0, partitions
        # included: keep each rank's own rows across it
        kept = [[p.detach().clone() for p in m.parameters()] for m in existing]
        wrapped = super().wrap(model, ctx)  # type: ignore[misc]
        with torch.no_grad():
            for m, values in zip(existing, kept):
                for p, v in zip(m.parameters(), values):
                    p.copy_(v)
        self._fc_model = model
        return wrapped

    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Refuse an enabled fp16 GradScaler when layers are model-parallel."""
        if scaler is not None and scaler.is_enabled() and self.model_parallel_layers():
            raise UsageError(self._refusal("fp16 loss scaling (GradScaler)"))
        super().attach_scaler(scaler)  # type: ignore[misc]

    def _refusal(self, what: str) -> str:
        names = ", ".join(n for n, _ in self.model_parallel_layers())
        return (
            f"lee18: {what} is not supported with model-parallel FC layers ({names}; chosen by "
            f"fc={self.options.fc}); pass lee18:fc=data_parallel"
        )

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole gradient: the partitions' squares (each rank's rows are
        its own, so their sum over ranks is exact) join the engine's one all-reduce of the
        shards' squares, and the same coefficient scales both."""
        layers = self.model_parallel_layers()
        if not layers:
            return super().clip_grad_norm_(max_norm, norm_type)  # type: ignore[misc,no-any-return]
        if float(norm_type) != 2.0:
            raise UsageError(
                f"{self.name}: only norm_type=2 clipping is supported, got {norm_type}"
            )
        engine = self.engine  # type: ignore[attr-defined]
        # update=layer must switch to the end-of-step update before the norm is known
        before_clip = getattr(getattr(engine, "layer", None), "before_clip", None)
        if before_clip is not None:
            before_clip()
        grads = [p.grad for _, m in layers for p in m.parameters() if p.grad is not None]
        own = torch.zeros(1, dtype=torch.float64, device=engine.groups[0].shard.device)
        for g in grads:
            own += g.double().pow(2).sum()

        def reduce(sq: torch.Tensor) -> None:
            sq += own
            if engine.distributed and engine.world > 1:
                accounting.all_reduce(sq, group=engine.pg, tag=f"{engine.tag}.clip")

        total: torch.Tensor = clip_sharded_(engine.groups, engine.rank, reduce, max_norm)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The engine's step, then the user's optimizer on this rank's partitions."""
        super().optimizer_step(optimizer)  # type: ignore[misc]
        params = [
            p for _, m in self.model_parallel_layers() for p in m.parameters() if p.grad is not None
        ]
        if params:
            check_elementwise(optimizer, f"{self.name} (model-parallel FC)")
            grads = [p.grad for p in params if p.grad is not None]
            step_subset(optimizer, params, grads, hyperparameters(optimizer))

    def flush(self) -> None:
        """The engine's flush, then consolidate the model-parallel weights (every rank)."""
        super().flush()  # type: ignore[misc]
        for _, m in self.model_parallel_layers():
            m.consolidate()

    def describe(self) -> dict[str, Any]:
        """Adds which Linear layers run model-parallel."""
        d: dict[str, Any] = super().describe()  # type: ignore[misc]
        d["fc_model_parallel"] = [n for n, _ in self.model_parallel_layers()]
        return d

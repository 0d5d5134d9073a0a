"""The :class:`KFAC` preconditioner: hooks that collect factors, ``step()`` that applies them.

Use it as kfac-pytorch users do::

    kfac = KFAC(model)                  # bare or DDP-wrapped
    loss.backward()                     # DDP (or a lowcomm method) leaves the mean grad in p.grad
    kfac.step()                         # preconditions p.grad in place
    optimizer.step()

Why hooks: the factor statistics come from each layer's input (forward) and output gradient
(backward). With ``pipeline=True`` (SPD-KFAC) each statistic's all-reduce starts inside the
hook that computed it, so factor traffic overlaps the rest of forward and backward. With
``pipeline=False`` (the baseline) ``step()`` sends all of them at once. Either way, with
``defer_factor_comm`` (the default) they are waited for only when the factors are next
read (an inverse step, the next factor step), so the traffic also overlaps the
preconditioning and the steps in between. The
hooks never read a device value on the host, so they never stall a CUDA stream.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.optim.kfac.comm import FactorComm
from lowcomm.optim.kfac.factors import LayerFactors, packed_numel
from lowcomm.optim.kfac.inverse import (Decomposition, decompose, from_wire, kl_clip_scale,
                                        precondition, to_wire)
from lowcomm.optim.kfac.layers import KFACLayer, discover, unwrap
from lowcomm.optim.kfac.options import Hyper, Schedule, check_static, grad_workers
from lowcomm.optim.kfac.pipeline import Pipeline
from lowcomm.optim.kfac.placement import FactorKey, Grid, assign_grid
from lowcomm.optim.kfac.rounds import FactorRound, fold_round, launch_round


class KFAC:
    """Kronecker-factored preconditioner of ``p.grad`` (KAISA's API; SPD-KFAC's communication).

    The first six keyword arguments may be callables of the step (int -> value). Every rank
    must construct it (it creates K-FAC's process groups) and call ``step()``.
    ``grad_worker_fraction`` is KAISA's: ``world_size * fraction`` ranks precondition each
    layer (1: every rank, decompositions travel; ``1/world_size``: DP-KFAC, gradients travel;
    in between, both, within smaller groups: :class:`~lowcomm.optim.kfac.placement.Grid`).
    ``step()`` preconditions the gradients of the supported layers (``nn.Linear``,
    ``nn.Conv2d``, ``nn.Conv1d``, ``nn.Embedding``, and so the factors of lowcomm's low-rank layers); other
    layers are left to the base optimizer, with a warning naming them when they own weights.
    See ``docs/kfac.md``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Schedule = 10,
        inv_update_steps: Schedule = 100,
        damping: Schedule = 1e-3,
        factor_decay: Schedule = 0.95,
        kl_clip: Schedule = 1e-3,
        lr: Schedule = 0.1,
        compute: str = "eigen",
        placement: str = "balanced",
        grad_worker_fraction: float = 1.0,
        pipeline: bool = True,
        symmetric_comm: bool = True,
        defer_factor_comm: bool = True,
        local_inverse_below: int = 1024,
        skip_layers: str | tuple[str, ...] | list[str] = (),
        accumulation_steps: int = 1,
        grad_scaler: Any = None,
    ) -> None:
        module = unwrap(model)
        self.hyper = Hyper(factor_update_steps, inv_update_steps, damping, factor_decay, kl_clip, lr)
        self.skip_layers = check_static(
            compute=compute, placement=placement, grad_worker_fraction=grad_worker_fraction,
            pipeline=pipeline, symmetric_comm=symmetric_comm, defer_factor_comm=defer_factor_comm,
            local_inverse_below=local_inverse_below,
            skip_layers=skip_layers, accumulation_steps=accumulation_steps, grad_scaler=grad_scaler)
        self.compute, self.pipeline, self.defer_factor_comm = compute, pipeline, defer_factor_comm
        self.accumulation_steps, self.grad_scaler = accumulation_steps, grad_scaler
        self.layers, reasons = discover(module, self.skip_layers)
        for reason in reasons:
            warnings.warn(reason, UserWarning, stacklevel=2)
        self.steps = 0
        self._factors = {layer.name: LayerFactors() for layer in self.layers}
        self._decs: dict[FactorKey, Decomposition] = {}
        self._rounds: list[FactorRound] = []  # factor steps launched, not yet folded
        self._keys: list[FactorKey] = []
        for i, layer in enumerate(self.layers):
            self._keys.append(FactorKey(i, "A", layer.a_dim, layer.a_diagonal))
            self._keys.append(FactorKey(i, "G", layer.g_dim))
        self._comm = FactorComm.create(symmetric_comm)
        world = self._comm.world_size
        #: KAISA's layout for ``grad_worker_fraction``: each layer's gradient is preconditioned
        #: by the ``grid.grad_workers`` ranks of one column (see :class:`Grid`)
        self.grid = Grid(world, grad_workers(grad_worker_fraction, world))
        #: DP-KFAC (``grad_worker_fraction = 1/world_size``): one rank per layer decomposes its
        #: factors and broadcasts the preconditioned gradient, not the decompositions
        self.dp = self.grid.grad_workers == 1 and world > 1
        #: owner rank of each factor (None: decomposed by each rank that needs it), and the
        #: column of each layer (None: every rank preconditions it itself)
        self.plan, self.columns = assign_grid(self._keys, self.grid, placement, local_inverse_below)
        self._column_groups, self._row_groups = self._comm.grid_groups(self.grid)
        self._ready: set[int] = set()  # layers decomposed at least once (the same on every rank)
        sizes = {(k.kind, k.layer): packed_numel(k.dim, symmetric_comm, diagonal=k.diagonal) for k in self._keys}
        device = self.layers[0].weight.device if self.layers else torch.device("cpu")
        #: how the hooks' statistics travel (pipelined mode): alone, then merged by SPD's rule
        self.pipeline_comm = Pipeline(self._comm, sizes, device)
        self._collecting: tuple[int, bool] = (-1, False)
        self._silent: set[str] = set()  # layers already warned about (hooks that never fired)
        self._handles = []
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.module.register_forward_pre_hook(self._pre_hook(i, layer)))
            self._handles.append(layer.module.register_forward_hook(self._post_hook(i, layer)))

    # --- hooks: statistics, and (pipelined) their all-reduce ---------------------------------
    def _collect(self, module: nn.Module) -> bool:
        """Whether this forward/backward contributes factor statistics (a factor step)."""
        if not (module.training and torch.is_grad_enabled()):
            return False
        step, on = self._collecting
        if step != self.steps:
            every = self.hyper.at("factor_update_steps", self.steps)
            on = self.steps % every == 0
            self._collecting = (self.steps, on)
        return on

    def _send(self, kind: str, index: int, stat: torch.Tensor) -> None:
        """Hand a complete statistic to the pipeline; file the flights it launched."""
        for i, flight in self.pipeline_comm.send(kind, index, stat):
            st = self._factors[self.layers[i].name]
            (st.a_flight if kind == "A" else st.g_flight).append(flight)

    def _pre_hook(self, index: int, layer: KFACLayer) -> Any:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if not self._collect(module):
                return
            st = self._factors[layer.name]
            # the trainer's autocast covers the forward: statistics in fp16/bf16 would
            # overflow and no decomposition takes them; factors are float32
            with torch.autocast(device_type=layer.weight.device.type, enabled=False):
                st.a_acc.add(layer.a_stat(inputs))
            if self.pipeline and st.a_acc.count == self.accumulation_steps:
                mean = st.a_acc.mean()
                assert mean is not None
                self._send("A", index, mean)
                st.a_acc.clear()

        return hook

    def _post_hook(self, index: int, layer: KFACLayer) -> Any:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad and self._collect(module):
                output.register_hook(lambda grad: self._grad_hook(index, layer, grad))

        return hook

    def _unscale(self) -> torch.Tensor | float:
        """The grad scaler's scale as a device tensor (no host read), 1.0 without one."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        scale = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else None
        return scale.to(torch.float32) if isinstance(scale, torch.Tensor) else float(scaler.get_scale())

    def _grad_hook(self, index: int, layer: KFACLayer, grad: torch.Tensor) -> None:
        st = self._factors[layer.name]
        # G is quadratic in the gradient: undo the loss scale, and the 1/accumulation_steps
        # each micro-batch's loss is divided by (so G matches the whole batch's)
        scale = self._unscale() / self.accumulation_steps
        st.g_acc.add(layer.g_stat(grad) / (scale * scale))
        if self.pipeline and st.g_acc.count == self.accumulation_steps:
            mean = st.g_acc.mean()
            assert mean is not None
            self._send("G", index, mean)
            st.g_acc.clear()

    # --- step ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Precondition every supported layer's ``p.grad`` in place.

        Call after backward (after DDP's all-reduce: the averaged gradient is in ``p.grad``)
        and before ``optimizer.step()``; with a grad scaler, after ``scaler.unscale_``. With
        ``accumulation_steps=k``, call it once per ``k`` micro-batches, each micro-batch's loss
        divided by ``k`` (the usual practice, which the ``G`` statistics assume). On a
        factor step the statistics' all-reduce is started (pipelined: already in the hooks)
        and folded into the running factors when they are next needed
        (``defer_factor_comm``; :mod:`~lowcomm.optim.kfac.rounds`) or at once; on an inverse
        step the decompositions are recomputed (each by its owner, then broadcast). Every
        rank must call it (it may run collectives).
        """
        k = self.steps
        launched = self._launch_factors(k)
        if launched is not None:
            self._fold()  # the previous factor step's round: one round in flight at most
            self._rounds.append(launched)
            if self.pipeline:
                if self.pipeline_comm.profiling:
                    self._fold()  # the profile and the α-β probe must not queue behind the flights
                self.pipeline_comm.end_factor_step()
            if not self.defer_factor_comm:
                self._fold()
        if k % self.hyper.at("inv_update_steps", k) == 0:
            self._fold()
            self._update_decompositions(k)
        self._precondition(k)
        self.steps += 1

    def _launch_factors(self, k: int) -> FactorRound | None:
        """Start averaging this step's statistics over ranks (the pipelined ones already
        are); None when this step collected none."""
        decay = self.hyper.at("factor_decay", k)
        return launch_round(self.layers, self._factors, self._comm, self.pipeline_comm.flush(), decay)

    def _fold(self) -> None:
        """Fold the launched rounds into the running factors, oldest first (waits for them)."""
        while self._rounds:
            for layer in fold_round(self._rounds.pop(0), self.layers, self._factors, self._comm):
                self._warn_silent(layer)

    def _warn_silent(self, layer: KFACLayer) -> None:
        if layer.name not in self._silent:
            self._silent.add(layer.name)
            warnings.warn(
                f"K-FAC: the hooks of layer {layer.name!r} did not fire in a factor step (its "
                "forward or backward never ran, or ran outside the module call); it is not "
                "preconditioned until they do", UserWarning, stacklevel=3)

    def _factor(self, key: FactorKey) -> torch.Tensor | None:
        st = self._factors[self.layers[key.layer].name]
        return st.a if key.kind == "A" else st.g

    def _is_worker(self, layer: int) -> bool:
        """Whether this rank preconditions ``layer``'s gradient itself (and so holds its
        decompositions): every rank for a local layer, else the members of its column."""
        column = self.columns[layer]
        return column is None or self.grid.column(self._comm.rank) == column

    def _source(self, layer: int) -> int | None:
        """The rank whose preconditioned gradient of ``layer`` this rank applies (itself when
        it is a worker), or None when every rank is a worker of it (nothing is broadcast)."""
        column = self.columns[layer]
        if column is None or self.grid.columns == 1:
            return None
        return self.grid.source(column, self._comm.rank)

    def _update_decompositions(self, k: int) -> None:
        """Decompose local and owned factors, then broadcast the owned ones within their
        layer's gradient-worker group (all ranks with fraction 1; DP-KFAC: a group of one,
        the owner keeps its own; the preconditioned gradient travels instead)."""
        damping = self.hyper.at("damping", k)
        mine: dict[FactorKey, Decomposition] = {}
        for key in self._keys:
            factor = self._factor(key)
            if factor is None:
                continue
            if self._factor(self._keys[2 * key.layer + (key.kind == "A")]) is not None:
                self._ready.add(key.layer)  # both factors exist: every rank knows it
            owner = self.plan[key]
            if owner is None:
                if self._is_worker(key.layer):
                    self._decs[key] = decompose(factor, self.compute, damping, key.diagonal)
            elif owner == self._comm.rank:
                mine[key] = decompose(factor, self.compute, damping, key.diagonal)
        if self.grid.grad_workers == 1:  # the wire form, so a resumed run (decompositions gathered) is bit-exact
            sym = self._comm.symmetric
            self._decs.update({key: from_wire(to_wire(d, self.compute, sym), key.dim, self.compute, sym,
                                              key.diagonal) for key, d in mine.items()})
            return
        remote = [key for key in self._remote() if self._is_worker(key.layer)]
        if remote:
            group = self._column_groups[self.grid.column(self._comm.rank)]
            self._decs.update(self._comm.share(mine, remote, self.plan, self.compute, self._devices(remote), group))

    def _remote(self) -> list[FactorKey]:
        """Factors with an owner whose layer has been decomposed, in one order on all ranks."""
        return [key for key in self._keys if self.plan[key] is not None and key.layer in self._ready]

    def _devices(self, keys: list[FactorKey]) -> dict[FactorKey, torch.device]:
        return {key: self.layers[key.layer].weight.device for key in keys}

    def _precondition(self, k: int) -> None:
        damping = self.hyper.at("damping", k)
        kl_clip = self.hyper.at("kl_clip", k)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        targets: list[KFACLayer] = []
        works = []
        row = self.grid.row(self._comm.rank)
        for i, layer in enumerate(self.layers):
            grad = layer.grad_matrix() if i in self._ready else None
            if grad is None:
                continue
            source = self._source(i)
            if source is None or source == self._comm.rank:
                v = precondition(grad, self._decs[self._keys[2 * i]], self._decs[self._keys[2 * i + 1]], damping)
            else:
                v = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
            if source is not None:  # a worker's preconditioned gradient, to its receiver group
                works.append(accounting.broadcast(v, source, group=self._row_groups[row], async_op=True,
                                                  tag="kfac.grad"))
            pairs.append((v, grad))
            targets.append(layer)
        for work in works:
            work.wait()
        scale = kl_clip_scale(pairs, kl_clip, self.hyper.at("lr", k)) if kl_clip is not None else None
        for layer, (v, grad) in zip(targets, pairs):
            layer.set_grad((v * scale if scale is not None else v).to(grad.dtype))

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step count, running factors and current decompositions: what an exact resume needs
        (the decompositions too, since they come from the factors of the last inverse step).

        With ``grad_worker_fraction < 1`` on several ranks each rank holds only the
        decompositions of its column's layers, so this call gathers the others (from their
        owner, or from the column's first rank for one each worker decomposed itself): it is
        then collective (every rank must call it).
        """
        self._fold()
        held = dict(self._decs)
        if self.grid.grad_workers < self.grid.world_size:
            keys = [key for key in self._keys if self.columns[key.layer] is not None and key.layer in self._ready]
            sources = {key: self._holder(key) for key in keys}
            whole = [key for key in keys if self.plan[key] is None]
            mine = {key: held[key] for key in keys if sources[key] == self._comm.rank}
            held.update(self._comm.share(mine, keys, sources, self.compute, self._devices(keys), whole=whole))
        decs = {f"{self.layers[key.layer].name}.{key.kind}": vars(dec).copy() for key, dec in held.items()}
        return {
            "steps": self.steps,
            "layers": [layer.name for layer in self.layers],
            "factors": {layer.name: {"A": self._factors[layer.name].a, "G": self._factors[layer.name].g}
                        for layer in self.layers},
            "decompositions": decs,
            "pipeline": self.pipeline_comm.state_dict(),
        }

    def _holder(self, key: FactorKey) -> int:
        """A rank that holds ``key``'s decomposition (of a layer with a column)."""
        owner = self.plan[key]
        if owner is not None:
            return owner
        column = self.columns[key.layer]
        assert column is not None
        return self.grid.workers(column)[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (tensors moved to each layer's device)."""
        names = [layer.name for layer in self.layers]
        self._fold()  # the launched collectives end on every rank; their result is replaced
        if list(state.get("layers", [])) != names:
            raise UsageError(f"K-FAC state is for layers {state.get('layers')}, this model has {names}")

        def to(t: Any, layer: KFACLayer) -> Any:
            return t.to(layer.weight.device) if isinstance(t, torch.Tensor) else t

        self.steps = int(state["steps"])
        for layer in self.layers:
            saved = state["factors"][layer.name]
            st = self._factors[layer.name] = LayerFactors()
            # copies: the running averages are updated in place, the caller's state must not be
            st.a, st.g = (None if t is None else to(t, layer).clone() for t in (saved["A"], saved["G"]))
        self._decs = {}
        for key in self._keys:
            layer = self.layers[key.layer]
            saved = state["decompositions"].get(f"{layer.name}.{key.kind}")
            if saved is not None and self._is_worker(key.layer):
                self._decs[key] = Decomposition(**{k: to(v, layer) for k, v in saved.items()})
        self._ready = {i for i, layer in enumerate(self.layers)
                       if all(f"{layer.name}.{kind}" in state["decompositions"] for kind in "AG")}
        self._collecting = (-1, False)
        if "pipeline" in state:  # older checkpoints have none: the run profiles again
            self.pipeline_comm.load_state_dict(state["pipeline"])

    def remove(self) -> None:
        """Detach the hooks (the model then trains without K-FAC's statistics); fold the
        factor steps still in flight (their collectives end on every rank)."""
        self._fold()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

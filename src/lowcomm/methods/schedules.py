"""``--method`` entries for the scheduling engine: ``wfbp``, ``mgwfbp``, ``dear``, ``lee18``.

Each wraps the model in :class:`~lowcomm.sched.module.ScheduledModule` instead of DDP and
forwards the trainer's life-cycle calls to its :class:`~lowcomm.sched.engine.Engine`.
``compress=<codec>`` carries any registered compressor where the pair works
(:func:`lowcomm.sched.pairing.pairing_refusal` says why not otherwise); keys that are not the
schedule's own are the codec's options (:mod:`lowcomm.sched.options`). Sharded schedules
(``dear``, ``lee18``) hold the averaged gradient only as shards between ``finish_sync`` and
the step, so gradient clipping must go through :meth:`EngineMethod.clip_grad_norm_` (a global
norm via one all-reduce).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.compress.codec import Codec
from lowcomm.compress.warm import compile_kernels
from lowcomm.errors import UsageError, check_positive
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext, OptimizerOverride
from lowcomm.methods.compression import codec_optimizer_overrides
from lowcomm.sched.cost import AlphaBeta, plan_mgwfbp, probe_alpha_beta
from lowcomm.sched.engine import Engine, Mode
from lowcomm.sched.module import ScheduledModule
from lowcomm.sched.groups import fuse_by_threshold
from lowcomm.parallel.lee18_fc import Lee18FCFields, ModelParallelFC
from lowcomm.sched.options import DeAROptions, EngineFields, chosen_codec, describe_options, with_codec_options
from lowcomm.sched.tune import MB, agree
from lowcomm.methods.fusion_tuning import FusionTuning


class EngineMethod(Method):
    """Shared life cycle of the engine-based schedules."""

    mode: ClassVar[Mode] = Mode.ALLREDUCE

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.codec_class = chosen_codec(self.options)
        self.engine: Engine | None = None
        self.codec: Codec | None = None
        self._pending_state: dict[str, Any] | None = None

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """Build the codec (keeping its state across re-wraps) and the engine; returns the wrapped model."""
        self.ctx = ctx
        if self.engine is not None:
            self.engine.remove_hooks()
        codec = None
        if self.codec_class is not None:
            pg = ctx.process_group
            world = dist.get_world_size(pg) if dist.is_initialized() else 1
            rank = dist.get_rank(pg) if dist.is_initialized() else 0
            codec = self.codec_class(self.options.codec_options, world=world, rank=rank)
            codec.set_momentum(ctx.codec_momentum)  # momentum correction: what the trainer moved
            codec.set_run(steps_per_epoch=ctx.steps_per_epoch, total_steps=ctx.total_steps)
            compile_kernels(codec, model.parameters())  # not in the first compressed steps
            if self.codec is not None:  # re-wrap: keep memory, factors and the step count
                codec.load_state_dict(self.codec.state_dict())
        self.codec = codec
        self.engine = Engine(model, mode=self.mode, process_group=ctx.process_group, tag=self.name,
                             broadcast_buffers=self.options.broadcast_buffers, codec=codec,
                             reducer=self.make_reducer(model, ctx))
        self.engine.attach_scaler(self.scaler)
        self.setup(self.engine)
        if self._pending_state is not None:
            self._apply_common(self._pending_state)
            self._apply_state(self._pending_state)
            self._pending_state = None
        self.ddp = ScheduledModule(model, self.engine)
        return self.ddp

    def setup(self, engine: Engine) -> None:
        """Hook for subclasses: initial grouping, probes, tuners."""

    def make_reducer(self, model: nn.Module, ctx: MethodContext) -> Any:
        """Hook for subclasses: what sums the groups instead of the plain all-reduce (None: that)."""

    def _need(self) -> Engine:
        """The engine (after :meth:`wrap`)."""
        if self.engine is None:
            raise RuntimeError(f"{self.name}: call wrap(model, ctx) first")
        return self.engine

    def finish_sync(self) -> None:
        """Wait for this step's gradient collectives (the exposed communication wait)."""
        self._need().finish_sync()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update: the engine's own for the sharded schedules (see :meth:`Engine.optimizer_step`)."""
        self._need().optimizer_step(optimizer)

    # AMP / non-finite steps: the engine holds the gradient (shards), so it does the work
    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Keep the scaler and hand it to the engine (it holds the gradient, so it runs the scaler's logic)."""
        super().attach_scaler(scaler)
        if self.engine is not None:
            self.engine.attach_scaler(scaler)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the engine's synchronized gradient (shards) and record the scaler's inf check."""
        self._need().unscale_(optimizer)

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The engine's device flag: this step's synchronized gradient is non-finite on every rank."""
        return self._need().nonfinite_this_step()

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop what the engine would apply for this step (DeAR's undecoded messages)."""
        self._need().skip_step()

    def flush(self) -> None:
        """Complete pending all-gathers and updates so the weights are whole."""
        if self.engine is not None:
            self.engine.flush()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient-norm clipping that works on sharded gradients too."""
        return self._need().clip_grad_norm_(max_norm, norm_type)

    def optimizer_overrides(self, cfg: Any) -> list[OptimizerOverride]:
        """The carried codec's needs, by its own method's rule (Signum's momentum leaves SGD)."""
        c = self.codec_class
        return [] if c is None else codec_optimizer_overrides(
            f"{self.name}:compress={c.name}", self.options.codec_options, cfg, inside="codec")

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Grouping, step count and the codec's state (flush first: DeAR may hold undecoded messages)."""
        if self.engine is None:
            return dict(self._pending_state or {})
        d: dict[str, Any] = {"group_sizes": list(self.engine.sizes), "steps": self.engine.steps}
        if self.codec is not None:
            if any(g.msg is not None or g.full for g in self.engine.groups):
                # DeAR keeps summed messages undecoded until the next forward; flush() (on every
                # rank: it all-gathers) decodes them. Not done here: state_dict may run on rank 0 only.
                raise RuntimeError(f"{self.name}: call flush() on every rank before state_dict()")
            d["codec"] = self.codec.state_dict()
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (kept until :meth:`wrap` when no engine exists yet)."""
        if self.engine is None:
            self._pending_state = dict(state)
        else:
            self._apply_common(state)
            self._apply_state(state)

    def _apply_common(self, state: dict[str, Any]) -> None:
        """What every schedule restores: the codec's state and the step count."""
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])
        if "steps" in state:
            self._need().steps = int(state["steps"])

    def _apply_state(self, state: dict[str, Any]) -> None:
        sizes = state.get("group_sizes")
        engine = self._need()
        if sizes and list(sizes) != engine.sizes and sum(sizes) == len(engine.units):
            engine.flush()
            engine.set_grouping(list(sizes))

    def describe(self) -> dict[str, Any]:
        """The method's own and its codec's options, plus the engine's mode, grouping and codec state."""
        d: dict[str, Any] = {"method": self.name, "options": describe_options(self.options)}
        if self.engine is not None:
            d.update(self.engine.describe())
        return d


# --------------------------------------------------------------------------------------------
@register
class WFBP(EngineMethod):
    """Wait-free backprop: each layer's all-reduce starts as soon as its gradient is ready."""

    name = "wfbp"
    mode = Mode.ALLREDUCE
    Options = with_codec_options(name, mode, EngineFields)


# --------------------------------------------------------------------------------------------
@dataclass
class MGWFBPOptions(EngineFields):
    """mgwfbp: layers merged by the α-β cost model (α, β measured at start-up unless given)."""

    alpha: float | None = None  # seconds per all-reduce; None: measured at start-up
    beta: float | None = None  # seconds per byte; None: measured at start-up
    profile_iters: int = 5

    def __post_init__(self) -> None:
        if self.profile_iters < 1:
            raise UsageError(f"mgwfbp: profile_iters must be >= 1, got {self.profile_iters}")
        for k in ("alpha", "beta"):
            v = getattr(self, k)
            if v is not None:
                check_positive(f"mgwfbp: {k}", v, allow_zero=True)
        if (self.alpha is None) != (self.beta is None):
            raise UsageError("mgwfbp: give both alpha and beta, or neither (then they are probed)")


@register
class MGWFBP(EngineMethod):
    """Merged-gradient WFBP: layers fused by the α-β cost model and profiled backward times."""

    name = "mgwfbp"
    mode = Mode.ALLREDUCE
    Options = with_codec_options(name, mode, MGWFBPOptions)

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.cost: AlphaBeta | None = None
        self.planned = False

    def setup(self, engine: Engine) -> None:
        """Fix α and β, or probe them with real traffic; profile gradient-ready times until planning."""
        o = self.options
        if o.alpha is not None:
            self.cost = AlphaBeta(float(o.alpha), float(o.beta))
        elif engine.distributed and engine.world > 1:
            # probe with sizes like the model's own messages (bounded: the probe is real traffic)
            grad_bytes = sum(u.nbytes for u in engine.units)
            large = int(min(4 * MB, max(256 * 1024, grad_bytes)))
            self.cost = probe_alpha_beta(group=engine.pg, small_bytes=4096, large_bytes=large,
                                         device=engine.groups[0].flat.device, tag="mgwfbp.probe")
        else:
            self.cost = AlphaBeta(0.0, 0.0)
        self.planned = False
        engine.profiling = True
        engine.ready_profile.clear()
        engine.on_synced.append(self._maybe_plan)

    def warmup_steps(self) -> int:
        """Profiled steps (the first backward is not profiled); the plan runs from the next."""
        return self.options.profile_iters + 1

    def _maybe_plan(self, engine: Engine) -> None:
        # the first backward sends nothing until the unused-parameter check: not profiled
        if self.planned or len(engine.ready_profile) < self.options.profile_iters + 1:
            return
        assert self.cost is not None
        rows = engine.ready_profile[1:]
        ready = [statistics.median(r[u] for r in rows) for u in range(len(engine.units))]
        sizes = plan_mgwfbp(ready, [u.nbytes for u in engine.units], [u.numel for u in engine.units], self.cost)
        sizes = agree(sizes, len(engine.units), engine, tag="mgwfbp.plan")
        engine.set_grouping(sizes)
        engine.profiling = False
        self.planned = True
        self.ready_times = ready

    def state_dict(self) -> dict[str, Any]:
        """Adds the plan and the α-β model: a resumed run keeps the plan instead of re-profiling."""
        d = super().state_dict()
        if self.engine is not None:
            d["planned"] = self.planned
            if self.cost is not None:
                d["alpha"], d["beta"] = self.cost.alpha, self.cost.beta
        return d

    def _apply_state(self, state: dict[str, Any]) -> None:
        if state.get("planned"):
            super()._apply_state(state)
            self.planned = True
            self._need().profiling = False
            if "alpha" in state:
                self.cost = AlphaBeta(float(state["alpha"]), float(state["beta"]))

    def describe(self) -> dict[str, Any]:
        """Adds the α-β model and whether the plan has been made."""
        d = super().describe()
        if self.cost is not None:
            d.update(alpha_s=self.cost.alpha, beta_s_per_byte=self.cost.beta, planned=self.planned)
        return d


# --------------------------------------------------------------------------------------------
@register
class DeAR(FusionTuning, EngineMethod):
    """Reduce-scatter in backward, all-gathers a window ahead of the next forward;
    ``tune=true``: the fusion threshold chosen online (:mod:`lowcomm.methods.fusion_tuning`)."""

    name = "dear"
    mode = Mode.DEAR
    Options = with_codec_options(name, mode, DeAROptions)

    def setup(self, engine: Engine) -> None:
        """Fuse by the threshold; with ``tune=true`` start at the tuner's first suggestion."""
        self.start_tuning(engine)
        engine.set_grouping(self.grouping(engine, self.threshold_mb))


# --------------------------------------------------------------------------------------------
@register
class Lee18(ModelParallelFC, FusionTuning, EngineMethod):
    """Reduce-scatter per fused group (per layer with ``threshold_mb=0``, the paper), sharded
    update, all-gather of parameters before forward; ``fc=``: Linear layers model-parallel
    (:mod:`lowcomm.parallel.lee18_fc`); ``tune=true``: the fusion threshold chosen online, as
    ``dear:tune=true``."""

    name = "lee18"
    mode = Mode.SHARD
    Options = with_codec_options(name, mode, Lee18FCFields)

    def setup(self, engine: Engine) -> None:
        """``update=layer``: step each group's shard as its reduce-scatter completes;
        ``threshold_mb``: fuse layers into groups of that size; ``merge_below``: layers
        smaller than that ride with their neighbour; ``tune=true``: start at the tuner's first
        suggestion."""
        engine.layer.requested = self.options.update == "layer"
        tuning = self.start_tuning(engine)
        if tuning or self.threshold_mb > 0 or self.options.merge_below > 0:  # else the paper's strict one per layer
            engine.set_grouping(self.grouping(engine, self.threshold_mb))

    def grouping(self, engine: Engine, threshold_mb: float) -> list[int]:
        """Fused up to ``threshold_mb`` (the first group up to ``first_group_mb``), a group
        closing only once it holds ``merge_below`` elements."""
        o = self.options
        return fuse_by_threshold(engine.units, threshold_mb * MB, o.merge_below, o.first_group_mb * MB)

    def describe(self) -> dict[str, Any]:
        """Adds why ``update=layer`` ran the end-of-step update instead, if it did."""
        fallbacks = {"update_fallbacks": list(self.engine.layer.fallbacks)} if self.engine is not None else {}
        return {**super().describe(), **fallbacks}

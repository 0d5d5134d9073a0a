"""``--method`` entries for the scheduling engine: ``wfbp``, ``mgwfbp``, ``dear``, ``lee18``.

Each wraps the model in :class:`~lowcomm.sched.engine.ScheduledModule` instead of DDP and
forwards the trainer's life-cycle calls to its :class:`~lowcomm.sched.engine.Engine`.
Sharded schedules (``dear``, ``lee18``) hold the averaged gradient only as shards between
``finish_sync`` and the step, so gradient clipping must go through
:meth:`EngineMethod.clip_grad_norm_` (a global norm via one all-reduce).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.comm.hooks.options import LowRankOptions
from lowcomm.errors import UsageError, check_positive
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext
from lowcomm.sched.cost import AlphaBeta, plan_mgwfbp, probe_alpha_beta
from lowcomm.sched.engine import Engine, Mode, ScheduledModule
from lowcomm.sched.groups import fuse_by_threshold
from lowcomm.sched.lowrank import KINDS as LOWRANK_KINDS
from lowcomm.sched.lowrank import LowRankCodec
from lowcomm.sched.tune import MB, ThresholdTuner, check_bayes_opt, window_time


_GATHER = ("signsgd", "signum", "topk", "gtopk")
_CASTS = ("fp16", "bf16")


def _check_compress(method: str, compress: str) -> str:
    """Which payload compressors compose with which schedule (see docs/scheduling.md).

    Returns the normalized name (``none``, ``acpsgd`` or ``powersgd``) or raises."""
    c = compress.strip().lower()
    if c in ("", "none"):
        return "none"
    collective = "reduce-scatter" if method in ("dear", "lee18") else "all-reduce"
    if c in _GATHER:
        raise UsageError(
            f"{method} cannot carry compressor {c!r}: its payload is not sum-compatible (it is "
            f"all-gathered and decoded), while this schedule sums gradients with {collective}; "
            f"use '--method {c}' on its own"
        )
    if c not in LOWRANK_KINDS:
        extra = " (fp16/bf16 casts are not offered by the engine: use '--method fp16' with DDP)" if c in _CASTS else ""
        raise UsageError(f"{method}: unknown compress={c!r}{extra}; valid: none, acpsgd, powersgd")
    if method == "lee18":
        raise UsageError(
            f"lee18 cannot carry compress={c}: each rank updates its own 1/P slice of the "
            "parameters from its slice of the summed gradient, but a slice of summed low-rank "
            "factors does not determine any slice of the gradient (each entry needs a full row "
            "of P and of Q); use 'dear:compress=acpsgd' or 'wfbp:compress=acpsgd'"
        )
    if method == "dear" and c == "powersgd":
        raise UsageError(
            "dear cannot carry compress=powersgd: PowerSGD needs the complete summed P before "
            "it can compute Q, so the reduce-scatter would have to be followed by an all-gather "
            "inside backward (an all-reduce in two halves, nothing left to defer); use "
            "'dear:compress=acpsgd' (one sum-compatible factor per step) or 'wfbp:compress=powersgd'"
        )
    return c


@dataclass
class CompressFields:
    """``compress=acpsgd|powersgd`` and its options (same names and defaults as the DDP hooks)."""

    compress: str = "none"
    rank: int = 4
    start_iter: int = 10
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        LowRankOptions(  # validation with the hooks' messages
            rank=self.rank,
            start_iter=self.start_iter,
            error_feedback=self.error_feedback,
            min_compression_rate=self.min_compression_rate,
            seed=self.seed,
        )


class EngineMethod(Method):
    """Shared life cycle of the engine-based schedules."""

    mode: ClassVar[Mode] = Mode.ALLREDUCE

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.compress = _check_compress(self.name, getattr(self.options, "compress", "none"))
        self.engine: Engine | None = None
        self.codec: LowRankCodec | None = None
        self._pending_state: dict[str, Any] | None = None

    def initial_sizes(self, engine_units: int, model: nn.Module) -> list[int] | None:
        return None

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        self.ctx = ctx
        if self.engine is not None:
            self.engine.remove_hooks()
        codec = None
        if self.compress != "none":
            o = self.options
            world = dist.get_world_size(ctx.process_group) if dist.is_initialized() else 1
            codec = LowRankCodec(
                model,
                kind=self.compress,
                rank=o.rank,
                start_iter=o.start_iter,
                error_feedback=o.error_feedback,
                min_compression_rate=o.min_compression_rate,
                seed=o.seed,
                world=world,
            )
            if self.codec is not None:  # re-wrap: keep memory, factors and the step count
                codec.load_state_dict(self.codec.state_dict())
        self.codec = codec
        self.engine = Engine(
            model,
            mode=self.mode,
            process_group=ctx.process_group,
            tag=self.name,
            broadcast_buffers=getattr(self.options, "broadcast_buffers", True),
            codec=codec,
        )
        self.engine.attach_scaler(self.scaler)
        self.setup(self.engine)
        if self._pending_state is not None:
            self._apply_lowrank(self._pending_state)
            self._apply_state(self._pending_state)
            self._pending_state = None
        self.ddp = ScheduledModule(model, self.engine)
        return self.ddp

    def setup(self, engine: Engine) -> None:
        """Hook for subclasses: initial grouping, probes, tuners."""

    def _need(self) -> Engine:
        if self.engine is None:
            raise RuntimeError(f"{self.name}: call wrap(model, ctx) first")
        return self.engine

    def finish_sync(self) -> None:
        self._need().finish_sync()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._need().optimizer_step(optimizer)

    # AMP / non-finite steps: the engine holds the gradient (shards), so it does the work
    def attach_scaler(self, scaler: Any) -> None:
        super().attach_scaler(scaler)
        if self.engine is not None:
            self.engine.attach_scaler(scaler)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._need().unscale_(optimizer)

    def nonfinite_flag(self) -> torch.Tensor | None:
        return self._need().nonfinite_this_step()

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._need().skip_step()

    def flush(self) -> None:
        if self.engine is not None:
            self.engine.flush()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient-norm clipping that works on sharded gradients too."""
        return self._need().clip_grad_norm_(max_norm, norm_type)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return dict(self._pending_state or {})
        d: dict[str, Any] = {"group_sizes": list(self.engine.sizes), "steps": self.engine.steps}
        if self.codec is not None:
            if any(g.msg is not None for g in self.engine.groups):
                # DeAR keeps summed factors undecoded until the next forward; flush() (on every
                # rank: it all-gathers) decodes them. Not done here: state_dict may run on rank 0 only.
                raise RuntimeError(f"{self.name}: call flush() on every rank before state_dict()")
            d["lowrank"] = self.codec.state_dict()
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.engine is None:
            self._pending_state = dict(state)
        else:
            self._apply_lowrank(state)
            self._apply_state(state)

    def _apply_lowrank(self, state: dict[str, Any]) -> None:
        if self.codec is not None and "lowrank" in state:
            self.codec.load_state_dict(state["lowrank"])

    def _apply_state(self, state: dict[str, Any]) -> None:
        sizes = state.get("group_sizes")
        engine = self._need()
        if sizes and self.mode is not Mode.SHARD and sum(sizes) == len(engine.units):
            engine.flush()
            engine.set_grouping(list(sizes))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.engine is not None:
            d.update(self.engine.describe())
        return d


# --------------------------------------------------------------------------------------------
@dataclass
class WFBPOptions(CompressFields):
    broadcast_buffers: bool = True


@register
class WFBP(EngineMethod):
    """Wait-free backprop: each layer's all-reduce starts as soon as its gradient is ready."""

    name = "wfbp"
    Options = WFBPOptions
    mode = Mode.ALLREDUCE


# --------------------------------------------------------------------------------------------
@dataclass
class MGWFBPOptions(CompressFields):
    alpha: float | None = None  # seconds per all-reduce; None: measured at start-up
    beta: float | None = None  # seconds per byte; None: measured at start-up
    profile_iters: int = 5
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
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
    Options = MGWFBPOptions
    mode = Mode.ALLREDUCE

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.cost: AlphaBeta | None = None
        self.planned = False

    def setup(self, engine: Engine) -> None:
        o = self.options
        if o.alpha is not None:
            self.cost = AlphaBeta(float(o.alpha), float(o.beta))
        elif engine.distributed and engine.world > 1:
            # probe with sizes like the model's own messages (bounded: the probe is real traffic)
            grad_bytes = sum(u.nbytes for u in engine.units)
            large = int(min(4 * MB, max(256 * 1024, grad_bytes)))
            self.cost = probe_alpha_beta(
                group=engine.pg,
                small_bytes=4096,
                large_bytes=large,
                device=engine.groups[0].flat.device,
                tag="mgwfbp.probe",
            )
        else:
            self.cost = AlphaBeta(0.0, 0.0)
        self.planned = False
        engine.profiling = True
        engine.ready_profile.clear()
        engine.on_synced.append(self._maybe_plan)

    def _maybe_plan(self, engine: Engine) -> None:
        # the first backward sends nothing until the unused-parameter check: not profiled
        if self.planned or len(engine.ready_profile) < self.options.profile_iters + 1:
            return
        assert self.cost is not None
        rows = engine.ready_profile[1:]
        ready = [statistics.median(r[u] for r in rows) for u in range(len(engine.units))]
        sizes = plan_mgwfbp(
            ready, [u.nbytes for u in engine.units], [u.numel for u in engine.units], self.cost
        )
        sizes = _agree(sizes, len(engine.units), engine, tag="mgwfbp.plan")
        engine.set_grouping(sizes)
        engine.profiling = False
        self.planned = True
        self.ready_times = ready

    def state_dict(self) -> dict[str, Any]:
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
        d = super().describe()
        if self.cost is not None:
            d.update(alpha_s=self.cost.alpha, beta_s_per_byte=self.cost.beta, planned=self.planned)
        return d


def _control_device(engine: Engine) -> torch.device:
    """Where small control tensors (plans, timings) travel: the gradients' device.

    A process group on NCCL alone has no CPU backend, so a CPU control tensor would fail
    there; on the training device every backend the gradients use carries it too.
    """
    if engine.groups:
        return engine.groups[0].flat.device
    return next((p.device for u in engine.units for p in u.params), torch.device("cpu"))


def _agree(sizes: list[int], n_units: int, engine: Engine, *, tag: str) -> list[int]:
    """Rank 0's grouping, broadcast so every rank fuses identically."""
    if not (engine.distributed and engine.world > 1):
        return sizes
    plan = torch.zeros(n_units, dtype=torch.int64)
    plan[: len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
    plan = plan.to(_control_device(engine))
    src = dist.get_global_rank(engine.pg, 0) if engine.pg is not None else 0
    accounting.broadcast(plan, src, group=engine.pg, tag=tag)
    return [int(x) for x in plan.tolist() if x > 0]


def _agree_float(value: float, engine: Engine, *, tag: str) -> float:
    if not (engine.distributed and engine.world > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_control_device(engine))
    src = dist.get_global_rank(engine.pg, 0) if engine.pg is not None else 0
    accounting.broadcast(t, src, group=engine.pg, tag=tag)
    return float(t.item())


# --------------------------------------------------------------------------------------------
@dataclass
class DeAROptions(CompressFields):
    threshold_mb: float = 25.0  # fusion buffer size; 0 = one group per layer
    tune: bool = False  # Bayesian optimization of threshold_mb (DeAR section V)
    tune_trials: int = 10
    tune_iters: int = 5  # measured iterations per trial (one more is discarded)
    tune_min_mb: float = 1.0
    tune_max_mb: float = 256.0
    seed: int = 0  # tuner and low-rank factor init
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("dear: threshold_mb", self.threshold_mb, allow_zero=True)
        if self.tune_trials < 1 or self.tune_iters < 1:
            raise UsageError("dear: tune_trials and tune_iters must be >= 1")
        check_positive("dear: tune_min_mb", self.tune_min_mb)
        check_positive("dear: tune_max_mb", self.tune_max_mb)
        if self.tune_max_mb < self.tune_min_mb:
            raise UsageError(
                f"dear: tune_max_mb ({self.tune_max_mb}) must be >= tune_min_mb ({self.tune_min_mb})"
            )
        if self.tune:
            check_bayes_opt()  # an optional package: refused here, in one line, not at step 1


@register
class DeAR(EngineMethod):
    """Reduce-scatter in backward, all-gather one group ahead of the next forward."""

    name = "dear"
    Options = DeAROptions
    mode = Mode.DEAR

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.threshold_mb = float(self.options.threshold_mb)
        self.tuner: ThresholdTuner | None = None
        self._stamps: list[float] = []
        self.tuned = False

    def setup(self, engine: Engine) -> None:
        o = self.options
        if o.tune and not self.tuned:
            total_mb = sum(u.nbytes for u in engine.units) / MB
            # scale the [1, 256] MB range down for models smaller than it
            hi = min(o.tune_max_mb, max(total_mb, 1e-6))
            lo = min(o.tune_min_mb, hi / 64)
            self.tuner = ThresholdTuner(low_mb=lo, high_mb=hi, trials=o.tune_trials, seed=o.seed)
            self.threshold_mb = _agree_float(self.tuner.suggest(), engine, tag="dear.tune")
        engine.set_grouping(fuse_by_threshold(engine.units, self.threshold_mb * MB))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        engine = self._need()
        engine.optimizer_step(optimizer)
        if self.tuner is None or self.tuned:
            return
        self._stamps.append(time.perf_counter())
        if len(self._stamps) < self.options.tune_iters + 2:  # first interval after regroup dropped
            return
        elapsed = window_time(self._stamps[1:])
        t = torch.tensor([elapsed], dtype=torch.float64, device=_control_device(engine))
        if engine.distributed and engine.world > 1:
            accounting.all_reduce(t, group=engine.pg, tag="dear.tune")
            t /= engine.world
        self.tuner.report(self.threshold_mb, float(t.item()))
        self._stamps = []
        nxt = self.tuner.best().threshold_mb if self.tuner.done else self.tuner.suggest()
        nxt = _agree_float(nxt, engine, tag="dear.tune")
        if self.tuner.done:
            self.tuned = True
        engine.flush()
        engine.set_grouping(fuse_by_threshold(engine.units, nxt * MB))
        self.threshold_mb = nxt

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d.update(threshold_mb=self.threshold_mb, tuned=self.tuned)
        return d

    def _apply_state(self, state: dict[str, Any]) -> None:
        if "threshold_mb" in state:
            self.threshold_mb = float(state["threshold_mb"])
        if state.get("tuned"):
            self.tuned = True
            self.tuner = None
        super()._apply_state(state)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["threshold_mb"] = self.threshold_mb
        if self.tuner is not None:
            d["tuning"] = {
                "done": self.tuned,
                "trials": [vars(t) for t in self.tuner.history],
                "chosen_threshold_mb": self.threshold_mb if self.tuned else None,
            }
        return d


# --------------------------------------------------------------------------------------------
@dataclass
class Lee18Options:
    broadcast_buffers: bool = True
    compress: str = "none"


@register
class Lee18(EngineMethod):
    """Per-layer reduce-scatter, sharded update, all-gather of parameters before forward."""

    name = "lee18"
    Options = Lee18Options
    mode = Mode.SHARD

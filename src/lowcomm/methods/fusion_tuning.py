"""``tune=true`` for the schedules that fuse layers by a threshold (``dear``, ``lee18``).

Why a mixin: DeAR's online Bayesian optimization of its fusion threshold (section V of the
paper) is not DeAR's alone. Lee et al.'s per-layer exchanges pay one collective's start per
layer, which on a slow or loaded network costs more than the overlap gains; the same tuner
finds the threshold where fusing stops paying, on the run's own cluster. The schedule says how
a threshold becomes groups (:meth:`FusionTuning.grouping`); the mixin owns the trials, their
timing windows, the agreement across ranks and the checkpointed choice.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch

from lowcomm.comm import accounting
from lowcomm.sched.engine import Engine
from lowcomm.sched.groups import fuse_by_threshold
from lowcomm.sched.tune import MB, ThresholdTuner, agree_float, control_device, window_time


class FusionTuning:
    """Mixin (before :class:`~lowcomm.methods.schedules.EngineMethod` in the bases) for a
    schedule whose options are :class:`~lowcomm.sched.options.TuneFields` with a
    ``threshold_mb``."""

    name: ClassVar[str]
    options: Any
    engine: Engine | None

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)  # type: ignore[call-arg]
        self.threshold_mb = float(self.options.threshold_mb)
        self.tuner: ThresholdTuner | None = None
        self._stamps: list[float] = []
        self.tuned = False

    def grouping(self, engine: Engine, threshold_mb: float) -> list[int]:
        """Units per group for ``threshold_mb`` (forward order): fused up to that many MB, the
        first group up to ``first_group_mb``."""
        return fuse_by_threshold(engine.units, threshold_mb * MB, first_bytes=self.options.first_group_mb * MB)

    def start_tuning(self, engine: Engine) -> bool:
        """With ``tune=true`` and no choice made yet: a tuner over the search range (scaled down
        to the model's size) and its first suggestion as the threshold, agreed by every rank.
        True if tuning is under way."""
        o = self.options
        if o.tune and not self.tuned:
            total_mb = sum(u.nbytes for u in engine.units) / MB
            # scale the [1, 256] MB range down for models smaller than it
            hi = min(o.tune_max_mb, max(total_mb, 1e-6))
            lo = min(o.tune_min_mb, hi / 64)
            self.tuner = ThresholdTuner(low_mb=lo, high_mb=hi, trials=o.tune_trials, seed=o.seed)
            self.threshold_mb = agree_float(self.tuner.suggest(), engine, tag=f"{self.name}.tune")
        return self.tuner is not None and not self.tuned

    def warmup_steps(self) -> int:
        """With ``tune=true``: every trial's window (its first interval after regrouping dropped)
        and one step more at the chosen threshold; else none."""
        o = self.options
        return o.tune_trials * (o.tune_iters + 2) + 1 if o.tune and not self.tuned else 0

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The schedule's step; while tuning, time windows of steps and move to the next threshold."""
        super().optimizer_step(optimizer)  # type: ignore[misc]
        engine = self.engine
        if self.tuner is None or self.tuned or engine is None:
            return
        self._stamps.append(time.perf_counter())
        if len(self._stamps) < self.options.tune_iters + 2:  # first interval after regroup dropped
            return
        elapsed = window_time(self._stamps[1:])
        t = torch.tensor([elapsed], dtype=torch.float64, device=control_device(engine))
        if engine.distributed and engine.world > 1:
            accounting.all_reduce(t, group=engine.pg, tag=f"{self.name}.tune")
            t /= engine.world
        self.tuner.report(self.threshold_mb, float(t.item()))
        self._stamps = []
        nxt = self.tuner.best().threshold_mb if self.tuner.done else self.tuner.suggest()
        nxt = agree_float(nxt, engine, tag=f"{self.name}.tune")
        if self.tuner.done:
            self.tuned = True
        engine.flush()
        engine.set_grouping(self.grouping(engine, nxt))
        self.threshold_mb = nxt

    def state_dict(self) -> dict[str, Any]:
        """Adds the (tuned) threshold: a resumed run fuses the same way."""
        d: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        d.update(threshold_mb=self.threshold_mb, tuned=self.tuned)
        return d

    def _apply_state(self, state: dict[str, Any]) -> None:
        if "threshold_mb" in state:
            self.threshold_mb = float(state["threshold_mb"])
        if state.get("tuned"):
            self.tuned = True
            self.tuner = None
        super()._apply_state(state)  # type: ignore[misc]

    def describe(self) -> dict[str, Any]:
        """Adds the threshold and, while tuning, the trials measured so far."""
        d: dict[str, Any] = super().describe()  # type: ignore[misc]
        d["threshold_mb"] = self.threshold_mb
        if self.tuner is not None:
            d["tuning"] = {
                "done": self.tuned,
                "trials": [vars(t) for t in self.tuner.history],
                "chosen_threshold_mb": self.threshold_mb if self.tuned else None,
            }
        return d

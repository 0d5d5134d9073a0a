"""Online Bayesian optimization of DeAR's fusion threshold (bayesian-optimization library).

DeAR tunes the fusion buffer size ``x`` in [1, 256] MB with expected improvement (ξ = 0.1)
over about 10 trials of a few iterations each. We search ``log2(x)`` because useful
thresholds span orders of magnitude, and scale the range down to the model's size (a
threshold above the model's gradient bytes is the same as one group). Only rank 0 owns the
optimizer; the engine broadcasts its suggestions so every rank uses the same grouping.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

MB = 1024 * 1024


@dataclass
class Trial:
    threshold_mb: float
    iter_time_s: float


@dataclass
class ThresholdTuner:
    """Suggest thresholds, collect measured iteration times, pick the fastest."""

    low_mb: float
    high_mb: float
    trials: int = 10
    seed: int = 0
    history: list[Trial] = field(default_factory=list)
    _bo: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.low_mb <= self.high_mb:
            raise ValueError(f"bad threshold range [{self.low_mb}, {self.high_mb}] MB")
        # imported here: bayes_opt pulls in scipy/sklearn (seconds), needed only when tuning
        from bayes_opt import BayesianOptimization, acquisition

        lo, hi = math.log2(self.low_mb), math.log2(self.high_mb)
        if hi - lo < 1e-9:
            hi = lo + 1e-6
        self._bo = BayesianOptimization(
            f=None,
            pbounds={"log2_mb": (lo, hi)},
            acquisition_function=acquisition.ExpectedImprovement(xi=0.1, random_state=self.seed),
            random_state=self.seed,
            verbose=0,
            allow_duplicate_points=True,
        )

    @property
    def done(self) -> bool:
        return len(self.history) >= self.trials

    def suggest(self) -> float:
        """Next threshold to try, in MB."""
        if not self.history:
            return self.high_mb ** 0.5 * self.low_mb ** 0.5  # geometric middle as first guess
        x = self._bo.suggest()["log2_mb"]
        return float(2.0 ** float(x))

    def report(self, threshold_mb: float, iter_time_s: float) -> None:
        self.history.append(Trial(threshold_mb, iter_time_s))
        self._bo.register(params={"log2_mb": math.log2(threshold_mb)}, target=-iter_time_s)

    def best(self) -> Trial:
        if not self.history:
            raise RuntimeError("no trials measured yet")
        return min(self.history, key=lambda t: t.iter_time_s)


def window_time(stamps: list[float]) -> float:
    """Median iteration time from consecutive step time stamps."""
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(diffs) if diffs else float("inf")

"""Online Bayesian optimization of DeAR's fusion threshold (bayesian-optimization library).

DeAR tunes the fusion buffer size ``x`` in [1, 256] MB with expected improvement (ξ = 0.1)
over about 10 trials of a few iterations each. We search ``log2(x)`` because useful
thresholds span orders of magnitude, and scale the range down to the model's size (a
threshold above the model's gradient bytes is the same as one group). Only rank 0 owns the
optimizer; the engine broadcasts its suggestions so every rank uses the same grouping.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.errors import UsageError

if TYPE_CHECKING:
    from lowcomm.sched.engine import Engine

MB = 1024 * 1024
#: bayes_opt's ``acquisition`` module and argument-free ``suggest()`` (used below) exist from
#: 2.0 on; the range pinned in pyproject's ``tune`` extra. Tested with 3.4.0.
BAYES_OPT_MIN_MAJOR = 2
INSTALL_HINT = "pip install 'lowcomm[tune]'"


def check_bayes_opt() -> None:
    """Refuse tuning before training starts, in one line, if bayes_opt cannot serve it.

    Called when ``dear:tune=true`` is parsed, so the CLI prints one line and exits 2
    instead of every rank failing with a traceback at its first step. It only looks the
    package up (no import: bayes_opt pulls in scipy and scikit-learn, seconds of start-up).
    """
    try:
        found = importlib.util.find_spec("bayes_opt") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(f"dear:tune=true needs the bayesian-optimization package: {INSTALL_HINT}")
    try:
        version = importlib.metadata.version("bayesian-optimization")
    except importlib.metadata.PackageNotFoundError:
        return  # importable without metadata (e.g. a source checkout): let the import decide
    major = version.split(".", 1)[0]
    if major.isdigit() and int(major) < BAYES_OPT_MIN_MAJOR:
        raise UsageError(
            f"dear:tune=true needs bayesian-optimization >= {BAYES_OPT_MIN_MAJOR} (found {version}): {INSTALL_HINT}"
        )


@dataclass
class Trial:
    """One measured threshold: the fusion size and the iteration time it gave."""

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
        try:
            from bayes_opt import BayesianOptimization, acquisition
        except ImportError:
            check_bayes_opt()  # missing or too old: the one-line reason
            raise

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
        """Whether every trial has been measured."""
        return len(self.history) >= self.trials

    def suggest(self) -> float:
        """Next threshold to try, in MB."""
        if not self.history:
            return self.high_mb ** 0.5 * self.low_mb ** 0.5  # geometric middle as first guess
        x = self._bo.suggest()["log2_mb"]
        return float(2.0 ** float(x))

    def report(self, threshold_mb: float, iter_time_s: float) -> None:
        """Record the measured iteration time of a threshold (the tuner maximizes its negative)."""
        self.history.append(Trial(threshold_mb, iter_time_s))
        self._bo.register(params={"log2_mb": math.log2(threshold_mb)}, target=-iter_time_s)

    def best(self) -> Trial:
        """The fastest trial measured so far."""
        if not self.history:
            raise RuntimeError("no trials measured yet")
        return min(self.history, key=lambda t: t.iter_time_s)


def window_time(stamps: list[float]) -> float:
    """Median iteration time from consecutive step time stamps."""
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(diffs) if diffs else float("inf")


# --- every rank takes rank 0's decision ----------------------------------------------------
def control_device(engine: Engine) -> torch.device:
    """Where small control tensors (plans, timings) travel: the gradients' device.

    A process group on NCCL alone has no CPU backend, so a CPU control tensor would fail
    there; on the training device every backend the gradients use carries it too.
    """
    if engine.groups:
        return engine.groups[0].flat.device
    return next((p.device for u in engine.units for p in u.params), torch.device("cpu"))


def agree(sizes: list[int], n_units: int, engine: Engine, *, tag: str) -> list[int]:
    """Rank 0's grouping, broadcast so every rank fuses identically."""
    if not (engine.distributed and engine.world > 1):
        return sizes
    plan = torch.zeros(n_units, dtype=torch.int64)
    plan[: len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
    plan = plan.to(control_device(engine))
    src = dist.get_global_rank(engine.pg, 0) if engine.pg is not None else 0
    accounting.broadcast(plan, src, group=engine.pg, tag=tag)
    return [int(x) for x in plan.tolist() if x > 0]


def agree_float(value: float, engine: Engine, *, tag: str) -> float:
    """Rank 0's ``value`` on every rank (a tuner's suggestion)."""
    if not (engine.distributed and engine.world > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=control_device(engine))
    src = dist.get_global_rank(engine.pg, 0) if engine.pg is not None else 0
    accounting.broadcast(t, src, group=engine.pg, tag=tag)
    return float(t.item())

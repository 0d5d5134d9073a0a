"""Which worker trains which sampled client: even split first, then a fitted runtime model.

Why: every worker trains its clients one after another and the round waits for the slowest
worker (the makespan). With unequal clients or unequal workers an even split of the *count*
leaves a straggler. Parrot's answer, kept here: model each worker's time per client as
``t = a_w * samples + b_w`` (a least-squares line over the observations of the last
``window`` rounds, recent rounds weighing more, so a worker that slows down is noticed),
split evenly for the first ``warmup_rounds`` rounds while there is nothing to fit, then
assign longest job first: the clients in decreasing size, each to the worker whose predicted
finish time after taking it is smallest. A worker three times slower gets about a quarter of
the work, not half.

Everything is deterministic (stable sorts, ties to the lower worker index), so any rank can
reproduce a plan from the same inputs; the engine still computes it on rank 0 and
broadcasts it, which keeps ranks in step even if their float rounding differed.

``--slowdown`` emulates heterogeneous workers the way Parrot does: after each client a worker
with factor ``s`` sleeps ``(s - 1)`` times the client's measured compute time
(:func:`slow_down`); the scheduler sees the longer times and adapts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from lowcomm.errors import UsageError

POLICIES = ("fitted", "even")


@dataclass
class Plan:
    """One round's assignment of sampled clients to workers.

    ``assignment[i]`` is the worker of the i-th client in the list given to
    :meth:`Scheduler.plan` (same order). ``predicted_s`` is the model's time per worker, None
    while the split is even (nothing fitted yet, or ``policy="even"``).
    """

    assignment: np.ndarray
    kind: str
    predicted_s: list[float] | None = None

    @property
    def predicted_makespan_s(self) -> float | None:
        """The slowest worker's predicted time: the round's predicted training time."""
        if not self.predicted_s:
            return None
        return max(self.predicted_s)

    def clients_of(self, worker: int) -> np.ndarray:
        """Positions (in the planned client list) of the clients ``worker`` trains, in order."""
        return np.flatnonzero(self.assignment == worker)

    def clients_per_worker(self, num_workers: int) -> list[int]:
        """How many clients each worker trains."""
        return [int(c) for c in np.bincount(self.assignment, minlength=num_workers)[:num_workers]]

    def samples_per_worker(self, samples: np.ndarray, num_workers: int) -> list[int]:
        """How many training samples each worker goes through (``samples`` aligned with the plan)."""
        counts = np.bincount(self.assignment, weights=np.asarray(samples, dtype=np.float64),
                             minlength=num_workers)
        return [int(round(c)) for c in counts[:num_workers]]

    def record(self, samples: np.ndarray, actual_s_per_worker: list[float] | None,
               num_workers: int) -> dict[str, Any]:
        """The ``"plan"`` entry of a round record (contract C5), JSON-ready."""
        return {
            "kind": self.kind,
            "clients_per_worker": self.clients_per_worker(num_workers),
            "samples_per_worker": self.samples_per_worker(samples, num_workers),
            "predicted_s_per_worker": None if self.predicted_s is None else [float(p) for p in self.predicted_s],
            "actual_s_per_worker": None if actual_s_per_worker is None else [float(a) for a in actual_s_per_worker],
        }


@dataclass(frozen=True)
class RuntimeModel:
    """``seconds = a * samples + b`` for one worker, with ``a, b >= 0`` (never a negative time)."""

    a: float
    b: float

    def predict(self, samples: np.ndarray) -> np.ndarray:
        """Predicted seconds per client."""
        return self.a * np.asarray(samples, dtype=np.float64) + self.b


def fit_runtime(samples: np.ndarray, seconds: np.ndarray,
                weights: np.ndarray | None = None) -> RuntimeModel | None:
    """Least-squares line through (samples, seconds), ``a, b >= 0``, robust to rare hiccups.

    ``weights`` (optional, > 0, aligned): the weight of each point in the squared error; the
    scheduler gives recent rounds more (see :class:`Scheduler`).

    Measured client times carry one-off spikes (a worker's first client pays lazy
    initialisation, a garbage collection or another process takes the core): one 0.5 s spike
    among 500 clients of 3 ms shifts a plain least-squares intercept by 1 ms per client, i.e.
    mispredicts every later round by 0.5 s. So the line is fitted twice: after the first fit,
    points far *above* it (more than 10 robust standard deviations, 1.4826 x the median
    absolute residual, and more than 5 % of the mean time) are dropped. A real change of
    speed moves many points, raises the median residual with them and is kept.
    None without observations.
    """
    x = np.asarray(samples, dtype=np.float64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if not x.size == y.size == w.size:
        raise ValueError(f"samples, seconds and weights differ in length: {x.size}, {y.size}, {w.size}")
    keep = np.isfinite(x) & np.isfinite(y) & np.isfinite(w) & (x >= 0) & (y >= 0) & (w > 0)
    x, y, w = x[keep], y[keep], w[keep]
    if x.size == 0:
        return None
    first = _least_squares(x, y, w)
    residual = y - first.predict(x)
    scale = 1.4826 * float(np.median(np.abs(residual)))
    spikes = residual > max(10.0 * scale, 0.05 * float(y.mean()))
    if not spikes.any() or spikes.all():
        return first
    return _least_squares(x[~spikes], y[~spikes], w[~spikes])


def _least_squares(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> RuntimeModel:
    """The line minimising the weighted squared error subject to ``a, b >= 0`` (non-empty).

    The unconstrained fit (what ``np.polyfit(x, y, 1)`` gives) is kept when both coefficients
    are non-negative. Otherwise the optimum of the constrained problem lies on a boundary, and
    the better of the two one-parameter fits is taken: a line through the origin (time per
    sample) or a constant (time per client). When every client had the same size the slope
    is undetermined; the line through the origin then predicts that size exactly and scales
    sensibly to other sizes.
    """
    candidates: list[RuntimeModel] = []
    w = w / w.sum()
    xm, ym = float((w * x).sum()), float((w * y).sum())
    sxx = float((w * (x - xm) ** 2).sum())
    if x.max() > x.min() and sxx > 0.0:  # equal sizes: xm carries round-off, sxx is noise
        a = float((w * (x - xm) * (y - ym)).sum()) / sxx
        b = ym - a * xm
        if a >= 0.0 and b >= 0.0:
            return RuntimeModel(a, b)
    x2 = float((w * x * x).sum())
    if x2 > 0.0:
        candidates.append(RuntimeModel(max(float((w * x * y).sum()) / x2, 0.0), 0.0))
    candidates.append(RuntimeModel(0.0, max(ym, 0.0)))

    def sse(m: RuntimeModel) -> float:
        return float((w * (m.predict(x) - y) ** 2).sum())

    # min() keeps the first of equal errors: the per-sample line, which extrapolates better
    return min(candidates, key=sse)


class Scheduler:
    """Plans each round's client-to-worker assignment; see the module docstring.

    ``observe`` is called once per worker and round with that worker's per-client sizes and
    measured seconds; the last ``window`` calls per worker are kept (that is the whole state,
    so :meth:`state_dict` gives an exact resume: the same inputs give the same plans). In the
    fit a round ``k`` rounds old weighs ``decay ** k``: the first rounds of a run (lazy
    initialisation, caches still cold) and a worker's past speed fade out quickly, while
    several rounds still average out the noise of one.
    """

    def __init__(self, num_workers: int, *, policy: str = "fitted", warmup_rounds: int = 2,
                 window: int = 5, decay: float = 0.5) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise UsageError(f"the scheduler needs at least 1 worker, got {num_workers!r}")
        if policy not in POLICIES:
            raise UsageError(f"unknown schedule policy {policy!r}; valid: {', '.join(POLICIES)}")
        if isinstance(warmup_rounds, bool) or not isinstance(warmup_rounds, int) or warmup_rounds < 0:
            raise UsageError(f"warmup_rounds must be an integer >= 0, got {warmup_rounds!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UsageError(f"window must be an integer >= 1 (rounds of observations), got {window!r}")
        if not (isinstance(decay, (int, float)) and 0.0 < decay <= 1.0):
            raise UsageError(f"decay must be in (0, 1] (1: all kept rounds weigh the same), got {decay!r}")
        self.num_workers = num_workers
        self.policy = policy
        self.warmup_rounds = warmup_rounds
        self.window = window
        self.decay = float(decay)
        # per worker: the last `window` rounds, each (samples, seconds) float64 arrays
        self._obs: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_workers)]
        self._rounds_seen = [0] * num_workers

    # --- observations -------------------------------------------------------------------
    def observe(self, worker: int, samples: np.ndarray, seconds: np.ndarray) -> None:
        """Record one round of ``worker``'s per-client timings (sizes and seconds, aligned)."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} out of range 0..{self.num_workers - 1}")
        s = np.asarray(samples, dtype=np.float64).ravel().copy()
        t = np.asarray(seconds, dtype=np.float64).ravel().copy()
        if s.size != t.size:
            raise ValueError(f"samples and seconds differ in length: {s.size} != {t.size}")
        self._rounds_seen[worker] += 1
        self._obs[worker].append((s, t))
        del self._obs[worker][: -self.window]

    @property
    def rounds_observed(self) -> int:
        """Rounds observed so far (the most any worker reported; idle workers report nothing)."""
        return max(self._rounds_seen)

    def models(self) -> list[RuntimeModel | None]:
        """Each worker's fitted runtime model; a worker without observations borrows the fit
        of all workers' observations pooled (None only when nothing was observed at all)."""
        own = [fit_runtime(*self._window_of(w)) for w in range(self.num_workers)]
        if all(m is not None for m in own):
            return own
        pooled = [self._window_of(w) for w in range(self.num_workers)]
        fallback = fit_runtime(*(np.concatenate([p[i] for p in pooled]) for i in range(3)))
        return [m if m is not None else fallback for m in own]

    def _window_of(self, worker: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The worker's kept (samples, seconds) and each point's weight ``decay ** age``
        (age in observed rounds, 0 for the latest)."""
        obs = self._obs[worker]
        if not obs:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        ages = range(len(obs) - 1, -1, -1)
        weights = [np.full(o[0].size, self.decay ** age) for o, age in zip(obs, ages)]
        return (np.concatenate([o[0] for o in obs]), np.concatenate([o[1] for o in obs]),
                np.concatenate(weights))

    # --- planning -----------------------------------------------------------------------
    def plan(self, round: int, clients: np.ndarray, samples: np.ndarray) -> Plan:
        """Assign ``clients`` (ids, with their training-sample counts) to workers.

        Even split (equal counts, contiguous blocks of the clients sorted by id) under
        ``policy="even"`` and until ``warmup_rounds`` rounds were observed; longest job first
        on the fitted models afterwards. ``round`` is the round being planned (kept for the
        caller's records; the warm-up counts observed rounds so that a resumed run, whose
        scheduler state was restored, goes on exactly as before).
        """
        ids = np.asarray(clients, dtype=np.int64).ravel()
        sizes = np.asarray(samples, dtype=np.float64).ravel()
        if ids.size != sizes.size:
            raise ValueError(f"clients and samples differ in length: {ids.size} != {sizes.size}")
        models = self.models() if self.policy == "fitted" and self.rounds_observed >= self.warmup_rounds else None
        if models is None or any(m is None for m in models):
            return Plan(even_split(ids, self.num_workers), "even", None)
        fitted = [m for m in models if m is not None]
        assignment, predicted = longest_job_first(sizes, fitted)
        return Plan(assignment, "fitted", predicted)

    # --- resume -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The observation window and settings, JSON-ready (floats round-trip exactly)."""
        return {
            "num_workers": self.num_workers,
            "policy": self.policy,
            "warmup_rounds": self.warmup_rounds,
            "window": self.window,
            "decay": self.decay,
            "rounds_seen": list(self._rounds_seen),
            "observations": [[{"samples": s.tolist(), "seconds": t.tolist()} for s, t in obs]
                             for obs in self._obs],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a different worker count cannot reuse the timings."""
        if int(state["num_workers"]) != self.num_workers:
            raise UsageError(
                f"the saved scheduler state is for {state['num_workers']} workers, this run has "
                f"{self.num_workers}; resume with the same --nproc")
        self._rounds_seen = [int(r) for r in state["rounds_seen"]]
        self._obs = [[(np.asarray(o["samples"], dtype=np.float64), np.asarray(o["seconds"], dtype=np.float64))
                      for o in obs][-self.window:] for obs in state["observations"]]


def even_split(clients: np.ndarray, num_workers: int) -> np.ndarray:
    """Equal counts (the first ``len % num_workers`` workers one more), contiguous blocks of
    the clients sorted by id; the result is aligned with ``clients`` as given."""
    ids = np.asarray(clients, dtype=np.int64).ravel()
    order = np.argsort(ids, kind="stable")
    n = ids.size
    base, extra = divmod(n, num_workers)
    per_worker = np.array([base + (1 if w < extra else 0) for w in range(num_workers)], dtype=np.int64)
    assignment = np.empty(n, dtype=np.int64)
    assignment[order] = np.repeat(np.arange(num_workers, dtype=np.int64), per_worker)
    return assignment


def longest_job_first(samples: np.ndarray, models: list[RuntimeModel]) -> tuple[np.ndarray, list[float]]:
    """Greedy makespan assignment: clients by decreasing size (stable), each to the worker with
    the smallest predicted finish time after taking it (ties: fewer clients, then lower
    index). Returns the assignment aligned with ``samples`` and the predicted seconds per
    worker."""
    sizes = np.asarray(samples, dtype=np.float64).ravel()
    a = np.array([m.a for m in models], dtype=np.float64)
    b = np.array([m.b for m in models], dtype=np.float64)
    finish = np.zeros(len(models), dtype=np.float64)
    taken = np.zeros(len(models), dtype=np.int64)
    index = np.arange(len(models))
    assignment = np.empty(sizes.size, dtype=np.int64)
    for i in np.argsort(-sizes, kind="stable"):
        after = finish + a * sizes[i] + b
        # equal finish times (e.g. clients predicted to cost nothing): fewer clients first,
        # then the lower index, so a zero-cost model cannot pile every client on worker 0
        w = int(np.lexsort((index, taken, after))[0])
        assignment[i] = w
        finish[w] = after[w]
        taken[w] += 1
    return assignment, [float(f) for f in finish]


def parse_slowdown(text: str, nproc: int) -> list[float]:
    """``"1,1,2,4"`` -> ``[1.0, 1.0, 2.0, 4.0]``: one finite factor >= 1 per worker."""
    valid = (f"--slowdown takes one factor >= 1 per worker, comma separated: {nproc} values for "
             f"--nproc {nproc} (e.g. {','.join(['1'] * max(nproc - 1, 0) + ['3'])})")
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != nproc:
        raise UsageError(f"{valid}; got {len(parts)} in {text!r}")
    factors = []
    for p in parts:
        try:
            f = float(p)
        except ValueError:
            raise UsageError(f"{valid}; {p!r} is not a number") from None
        if not math.isfinite(f) or f < 1.0:
            raise UsageError(f"{valid}; got {p!r}")
        factors.append(f)
    return factors


def slow_down(factor: float, compute_s: float) -> float:
    """Emulate a worker ``factor`` times slower: sleep ``(factor - 1) * compute_s`` after a
    client that took ``compute_s`` seconds. Returns the seconds slept."""
    pause = max(factor - 1.0, 0.0) * max(compute_s, 0.0)
    if pause > 0.0:
        time.sleep(pause)
    return pause

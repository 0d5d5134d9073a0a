"""Rounds of a bench (``--repeat R``): every method run R times, one row per method.

Why: on a shared machine one run of a method varies by more than the differences a bench is
asked to resolve. Eight emulated workers on two cores ran the same ``lee18`` step in 2.44,
2.64 and 2.91 s in three runs a few minutes apart (2026-11-30); a simulator cannot be judged
to 10 % against one such run. The harness therefore runs the methods in rounds (round ``r``
runs every method once before round ``r + 1`` starts), so that slow drift of the machine falls
on every method alike, and keeps for each method the row of its median run with every run's
time beside it. Rows that serve as a compute reference (``nocomm``, a model-axis method's own
model without communication) keep their fastest run instead, as a single round already does
with its two ``nocomm`` runs: a lower bound must not absorb a load spike.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

Pick = Literal["median", "fastest"]


def _time(row: dict[str, Any]) -> float:
    return float(row["iter_time_s_median"])


def combine(runs: Sequence[dict[str, Any]], *, pick: Pick = "median") -> dict[str, Any]:
    """One row from one method's runs, given in round order.

    The row is a copy of the chosen run (the median one, the lower of the two middle ones for an
    even count, so every field of the row comes from one real run; or the fastest), with
    ``repeat_iter_times_s`` (every successful run's time, in round order), ``repeat_spread``
    ((slowest - fastest) / the row's time) and ``repeat_failed`` (runs that failed). When every
    run failed, the first failure is the row.
    """
    if not runs:
        raise ValueError("combine() needs at least one run")
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return dict(runs[0], repeat_failed=len(runs))
    ranked = sorted(ok, key=_time)
    chosen = ranked[0] if pick == "fastest" else ranked[(len(ranked) - 1) // 2]
    times = [_time(r) for r in ok]
    row = dict(chosen)
    row["repeat_iter_times_s"] = times
    row["repeat_spread"] = (max(times) - min(times)) / _time(chosen) if _time(chosen) > 0 else 0.0
    row["repeat_failed"] = len(runs) - len(ok)
    return row


def combine_rounds(rounds: Sequence[Sequence[dict[str, Any]]], references: set[str]) -> list[dict[str, Any]]:
    """One row per method from rounds that ran the same methods in the same order: the median
    run, or the fastest for the methods in ``references`` (compute references)."""
    if not rounds:
        return []
    methods = [r["method"] for r in rounds[0]]
    for other in rounds[1:]:
        if [r["method"] for r in other] != methods:
            raise ValueError("every round must run the same methods in the same order")
    return [combine([rnd[i] for rnd in rounds], pick="fastest" if m in references else "median")
            for i, m in enumerate(methods)]

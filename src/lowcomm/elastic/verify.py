"""Check a search's answer on the device: time the best candidates whole, keep one that fits.

Why: the search ranks sub-networks by a latency *prediction* (:mod:`lowcomm.elastic.latency`),
and an optimizer that maximizes accuracy under a predicted limit drifts to the configs whose
latency the table under-predicts most (the optimizer's curse): every answer sits at the edge
of the budget, where a few percent of prediction error is the difference between meeting it
and not. OFA stops at the prediction. Here the best ``top`` candidates (by the search's own
score, all under the predicted budget) are timed whole, interleaved with each other as the
table's units were, and the best one whose measured latency is within the budget is the
answer; if none of them is, the next ``top``, up to a limit. The top candidates of a
converged search all sit at the predicted edge, so verification pays off when the search ran
under a predicted limit a little below the budget (``lowcomm elastic search --latency-margin``)
and the answer must still run within the full budget when timed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lowcomm.elastic.space import Config
from lowcomm.errors import UsageError

__all__ = ["Verified", "verify_by_timing"]

#: (chosen config, its score, its measured ms or None when nothing fits, rows of every timing).
Verified = tuple[Config, float, float | None, list[dict[str, Any]]]


def verify_by_timing(
    candidates: Sequence[tuple[Config, float]],
    time_whole: Callable[[Sequence[Config]], list[float]],
    budget_ms: float,
    *,
    top: int = 5,
    max_timed: int = 20,
) -> Verified:
    """The highest-score candidate whose whole-network time is ``<= budget_ms``.

    ``candidates``: ``(config, score)`` pairs, any order (sorted here by score, best first);
    ``time_whole``: milliseconds per config, timed together (e.g.
    :meth:`~lowcomm.elastic.latency.LatencyTable.time_whole`). Timing goes ``top`` at a time down
    the ranking and stops at the first chunk with a fitting candidate, or after ``max_timed``
    candidates (an evolution scores thousands). When no timed candidate fits, the fastest one
    is returned with ``None`` as its measured time (the caller says so); the rows show every
    measurement.
    """
    if top < 1:
        raise UsageError(f"verify: top must be >= 1, got {top!r}")
    if max_timed < top:
        raise UsageError(f"verify: max_timed must be >= top ({top}), got {max_timed!r}")
    if not candidates:
        raise UsageError("verify: no candidate to time (the search found none under the budget)")
    ranked = sorted(candidates, key=lambda cs: cs[1], reverse=True)[:max_timed]
    rows: list[dict[str, Any]] = []
    for start in range(0, len(ranked), top):
        chunk = ranked[start:start + top]
        times = time_whole([config for config, _ in chunk])
        for rank, ((config, score), ms) in enumerate(zip(chunk, times), start=start):
            rows.append({"rank": rank, "config": config, "score": score, "measured_ms": float(ms),
                         "fits": bool(ms <= budget_ms)})
        fitting = [row for row in rows[start:] if row["fits"]]
        if fitting:
            best = fitting[0]  # rows keep the ranking's order: the first that fits scores best
            return best["config"], best["score"], best["measured_ms"], rows
    fastest = min(rows, key=lambda row: row["measured_ms"])
    return fastest["config"], fastest["score"], None, rows

"""The K-FAC iteration benchmark's bookkeeping, on fake step times (no training).

Why: the table splits each row's steps by kind and bounds what lowcomm could gain over
kfac-pytorch from the work both do alike; both feed the verdict on issue 13's 1.3x target, so
the step classification and the bound must be right without the hour-long run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import kfac_iteration as ki  # noqa: E402  (a script, not a package: loaded from its folder)


def record(plain: float, factor: float, decomposition: float, warmup: int = 35, steps: int = 50) -> dict[str, Any]:
    """An ok row whose step times depend only on the step's kind (the worker's schedule)."""
    times = []
    for i in range(warmup, warmup + steps):
        times.append(decomposition if i % ki.INV_EVERY == 0 else factor if i % ki.FACTOR_EVERY == 0 else plain)
    return {"status": "ok", "warmup": warmup, "steps": steps, "step_s": times,
            "s_per_iter": sum(times) / len(times)}


def test_steps_are_split_into_plain_factor_and_decomposition_by_the_schedule() -> None:
    kinds = ki.step_kinds(record(1.0, 3.0, 20.0))
    assert kinds == pytest.approx({"plain": 1.0, "factor": 3.0, "decomposition": 20.0})
    # the window 35..84 holds one decomposition step (50) and nine other factor steps
    times = record(1.0, 3.0, 20.0)["step_s"]
    assert times.count(20.0) == 1 and times.count(3.0) == 9 and times.count(1.0) == 40


def test_the_shared_floor_takes_the_cheaper_plain_and_decomposition_steps() -> None:
    ok = {"lowcomm": record(1.8, 3.2, 19.0), "kfac-pytorch": record(2.0, 4.0, 21.0), "sgd": record(0.2, 0.2, 0.2)}
    floor = ki.shared_floor(ok)
    assert floor == pytest.approx((49 * 1.8 + 19.0) / 50)


def test_the_floor_needs_both_libraries() -> None:
    assert ki.shared_floor({"lowcomm": record(1.8, 3.2, 19.0)}) is None
    assert ki.shared_floor({"kfac-pytorch": record(1.8, 3.2, 19.0)}) is None


def test_the_rendered_scenario_shows_step_kinds_and_the_bound() -> None:
    doc = {"runs": {f"loopback2/{row}": {**rec, "s_per_iter_by_rank": [rec["s_per_iter"]] * 2,
                                         "phases_mean_s": {"forward_backward": 0.1, "preconditioner": 0.2,
                                                           "optimizer": 0.01}}
                    for row, rec in (("lowcomm", record(1.8, 3.2, 19.0)), ("kfac-pytorch", record(2.0, 4.0, 21.0)))}}
    text = ki.render_scenario(doc, "loopback2")
    assert "1.800 / 3.200 / 19.000" in text
    best = doc["runs"]["loopback2/kfac-pytorch"]["s_per_iter"] / ((49 * 1.8 + 19.0) / 50)
    assert f"**{best:.2f}×**" in text
    assert "target ≥ 1.3×: FAIL" in text  # 2.34 / 2.12 s is 1.10x

"""Verifying a search's answer by timing candidates whole (a fake clock: logic, not speed)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lowcomm.elastic.verify import verify_by_timing
from lowcomm.errors import UsageError


def _config(i: int) -> dict[str, list[int]]:
    return {"depth": [i]}


class FakeClock:
    """Milliseconds per config from a dict; remembers every batch it was asked to time."""

    def __init__(self, ms: dict[int, float]) -> None:
        self.ms, self.calls = ms, []  # type: ignore[var-annotated]

    def __call__(self, configs: Sequence[dict[str, list[int]]]) -> list[float]:
        self.calls.append([c["depth"][0] for c in configs])
        return [self.ms[c["depth"][0]] for c in configs]


def test_the_best_scoring_candidate_that_fits_when_timed_is_the_answer() -> None:
    clock = FakeClock({0: 12.0, 1: 9.0, 2: 8.0, 3: 5.0})
    candidates = [(_config(i), score) for i, score in ((2, 0.5), (0, 0.9), (3, 0.1), (1, 0.7))]
    config, score, measured, rows = verify_by_timing(candidates, clock, 10.0, top=4)
    assert (config, score, measured) == (_config(1), 0.7, 9.0)
    assert clock.calls == [[0, 1, 2, 3]]  # ranked by score, timed together
    assert [r["fits"] for r in rows] == [False, True, True, True]


def test_a_chunk_without_a_fitting_candidate_moves_on_to_the_next() -> None:
    clock = FakeClock({0: 11.0, 1: 10.5, 2: 9.5, 3: 9.0})
    candidates = [(_config(i), -float(i)) for i in range(4)]
    config, _, measured, rows = verify_by_timing(candidates, clock, 10.0, top=2)
    assert config == _config(2) and measured == 9.5
    assert clock.calls == [[0, 1], [2, 3]] and len(rows) == 4


def test_timing_stops_at_max_timed_and_says_nothing_fits() -> None:
    clock = FakeClock({i: 20.0 - i for i in range(6)})
    candidates = [(_config(i), -float(i)) for i in range(6)]
    config, _, measured, rows = verify_by_timing(candidates, clock, 10.0, top=2, max_timed=4)
    assert measured is None and config == _config(3)  # the fastest of those timed
    assert clock.calls == [[0, 1], [2, 3]] and not any(r["fits"] for r in rows)


@pytest.mark.parametrize("kwargs, message", [
    ({"top": 0}, "top"), ({"top": 5, "max_timed": 4}, "max_timed"),
])
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        verify_by_timing([(_config(0), 1.0)], FakeClock({0: 1.0}), 10.0, **kwargs)


def test_no_candidate_is_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match="no candidate"):
        verify_by_timing([], FakeClock({}), 10.0)

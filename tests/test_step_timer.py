"""The step timer credits hook work to the pass it ran in (a fake clock: no timing)."""

from __future__ import annotations

from typing import Iterator

import pytest

from lowcomm.runtime import timing
from lowcomm.runtime.timing import MAX_SPANS, StepTimer
from lowcomm.runtime.trainer import Trainer


class FakeClock:
    """``time.perf_counter`` for the timing module, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeClock]:
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    yield fake


def report(timer: StepTimer, clock: FakeClock, name: str, start: float, end: float) -> None:
    """Hook work of phase ``name`` that ran from ``start`` to ``end`` (reported at its end)."""
    clock.now = end
    timer.add(name, end - start)


def test_a_report_counts_only_where_it_overlaps_the_window(clock: FakeClock) -> None:
    timer = StepTimer()
    report(timer, clock, "compress", 10.0, 12.0)
    assert timer.within(("compress",), 0.0, 9.0) == 0.0
    assert timer.within(("compress",), 9.0, 13.0) == 2.0
    assert timer.within(("compress",), 11.0, 20.0) == 1.0
    assert timer.within(("optimizer",), 0.0, 20.0) == 0.0


def test_hook_work_after_the_last_gradient_is_compression_not_backward_or_waiting(clock: FakeClock) -> None:
    """Backward ran 0-10 with 2 s of encode inside it; the last bucket's encode and decode
    (3 s) ran in the 5 s tail after the last gradient: backward 8, waiting 2, compression 5."""
    trainer = Trainer.__new__(Trainer)
    trainer.timer = StepTimer()
    report(trainer.timer, clock, "compress", 4.0, 6.0)
    report(trainer.timer, clock, "compress", 11.0, 14.0)
    trainer._phase_wall("backward", 0.0, 10.0)
    trainer._phase_wall("comm_wait", 10.0, 15.0)
    step = trainer.timer.end_step()
    assert (step["backward"], step["comm_wait"], step["compress"]) == (8.0, 2.0, 5.0)
    assert sum(step[p] for p in ("backward", "comm_wait", "compress")) == 15.0  # the wall time


def test_a_closed_step_forgets_its_reports_and_a_step_never_closed_keeps_a_bounded_number(clock: FakeClock) -> None:
    timer = StepTimer()
    report(timer, clock, "compress", 0.0, 1.0)
    timer.end_step()
    assert timer.within(("compress",), 0.0, 1.0) == 0.0
    for i in range(MAX_SPANS + 10):
        report(timer, clock, "compress", float(i), i + 1.0)
    assert timer.within(("compress",), 0.0, 10.0) == 0.0  # the oldest dropped
    assert timer.within(("compress",), 0.0, MAX_SPANS + 10.0) == MAX_SPANS

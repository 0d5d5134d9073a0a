"""The ordered communication thread (lowcomm.comm.ordered): jobs in submission order, results
and failures on their futures."""

from __future__ import annotations

import threading

import pytest

from lowcomm.comm.ordered import OrderedThread


def test_jobs_run_one_at_a_time_in_submission_order_on_one_thread() -> None:
    worker: OrderedThread[int] = OrderedThread("test-ordered")
    release = threading.Event()
    done: list[int] = []
    threads: set[str] = set()

    def job(i: int) -> int:
        if i == 0:
            release.wait(10)  # the later jobs are queued meanwhile, not run beside it
        threads.add(threading.current_thread().name)
        done.append(i)
        return i * 10

    futures = [worker.submit(lambda i=i: job(i)) for i in range(4)]
    assert not any(f.done() for f in futures)
    release.set()
    assert [f.wait() for f in futures] == [0, 10, 20, 30]
    assert done == [0, 1, 2, 3] and threads == {"test-ordered"}
    worker.close()


def test_a_failing_job_hands_its_error_to_its_future_and_the_next_jobs_still_run() -> None:
    worker: OrderedThread[int] = OrderedThread("test-ordered")
    bad = worker.submit(lambda: [][0])
    good = worker.submit(lambda: 7)
    assert good.wait() == 7
    with pytest.raises(IndexError):
        bad.wait()
    worker.close()
    assert worker.submit(lambda: 1).wait() == 1  # a closed worker starts a new thread
    worker.close()

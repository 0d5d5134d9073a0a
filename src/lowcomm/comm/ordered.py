"""One communication thread that runs jobs one at a time, in the order they were submitted.

Why: a job that needs the result of one collective before it can issue the next (a
hierarchical all-reduce's three stages, a codec's rounds) cannot run from a backward hook
without stalling backward. On a thread of its own it runs beside backward; because that one
thread issues the jobs' collectives in submission order, and every rank submits in the same
order (DDP's bucket order, the engine's launch order), every rank issues the same sequence,
which gloo and NCCL both require.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class OrderedThread(Generic[T]):
    """``submit(job)`` returns a ``torch.futures.Future`` of ``job()``, run on this object's one
    daemon thread after every job submitted before it; what a job raises is set on its future
    (and raised again by ``wait()``). The thread starts at the first submit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.Queue[tuple[Callable[[], T], torch.futures.Future[T]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], T]) -> torch.futures.Future[T]:
        """Queue ``job``; the future completes with its result."""
        fut: torch.futures.Future[T] = torch.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put((job, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fut = item
            try:
                result = job()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)  # type: ignore[arg-type]
            else:
                fut.set_result(result)

    def close(self) -> None:
        """Stop the thread after the jobs already submitted."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join()


__all__ = ["OrderedThread"]

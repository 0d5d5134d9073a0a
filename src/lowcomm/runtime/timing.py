"""Per-iteration phase timers with medians, shared by the trainer and by comm hooks.

Phases: ``data``, ``forward``, ``backward`` (compute, including communication that overlaps
it), ``comm_wait`` (exposed waiting for communication), ``compress`` (encode/decode work done
by a compression method) and ``optimizer``. Hooks running inside backward report their work
with :func:`add`; the trainer subtracts from each pass's wall time the part of that work
which ran inside the pass (:meth:`StepTimer.within`), so phases don't double-count: a bucket
encoded or decoded after the last gradient was ready is compression, not exposed waiting,
and takes nothing from backward.

Work a GPU would run on the device (``compress``: a method's encode/decode kernels, queued on
the stream behind backward's; ``optimizer`` reported from hooks: DeAR's per-group update before
a layer's forward, lee18's shard update during backward) is also reported to the listeners registered with
:func:`on_device_work`: the emulated-compute clock (:mod:`lowcomm.runtime.emulated`) delays its
remaining layer deadlines by it, so host-side compression follows the emulated compute instead
of hiding inside its waits.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from typing import Callable, Iterator

PHASES = ("data", "forward", "backward", "comm_wait", "compress", "optimizer")
#: reports a step keeps with their times (a bucket's or a layer's hook reports a few each)
MAX_SPANS = 8192
#: phases whose work a GPU runs on the device, in order with the layers' kernels
DEVICE_PHASES = ("compress", "optimizer")


class StepTimer:
    """Accumulates seconds per phase for the current step; keeps one dict per finished step."""

    def __init__(self) -> None:
        self._current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        #: this step's reports as ``(end, seconds, phase)``: when each ran (:meth:`within`);
        #: bounded, for hooks used in a loop of the user's own that never ends a step
        self._spans: deque[tuple[float, float, str]] = deque(maxlen=MAX_SPANS)
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Credit the wall time of the ``with`` block to phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Credit ``seconds`` to ``name`` (thread-safe: hooks may report from other threads),
        taken to have run until now."""
        end = time.perf_counter()
        with self._lock:
            self._current[name] += seconds
            if seconds > 0:
                self._spans.append((end, seconds, name))

    def within(self, names: tuple[str, ...], start: float, end: float) -> float:
        """Seconds of this step's reports to ``names`` that ran between ``start`` and ``end``
        (``time.perf_counter``): each report's overlap with that window, a report covering
        the seconds before it was made. Why: a pass's wall time holds only the hook work that
        ran inside it; what ran after backward's last gradient was waited for in the tail."""
        with self._lock:
            spans = [s for s in self._spans if s[2] in names]
        return sum(max(0.0, min(stop, end) - max(stop - seconds, start)) for stop, seconds, _ in spans)

    def get(self, name: str) -> float:
        """Seconds credited to ``name`` so far in this step."""
        with self._lock:
            return self._current.get(name, 0.0)

    def set(self, name: str, seconds: float) -> None:
        """Replace this step's total for ``name``."""
        with self._lock:
            self._current[name] = seconds

    def end_step(self) -> dict[str, float]:
        """Close the step: keep and return its seconds per phase, start the next at zero."""
        with self._lock:
            done = {p: self._current.get(p, 0.0) for p in PHASES}
            for k, v in self._current.items():
                done.setdefault(k, v)
            self._current = defaultdict(float)
            self._spans.clear()
        self.steps.append(done)
        return done

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Median seconds per phase over the steps after the first ``skip`` (warm-up)."""
        rows = self.steps[skip:] or self.steps
        if not rows:
            return {p: 0.0 for p in PHASES}
        order = {p: i for i, p in enumerate(PHASES)}
        keys = sorted({k for r in rows for k in r}, key=lambda k: (order.get(k, len(order)), k))
        return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


_TIMER = StepTimer()


def timer() -> StepTimer:
    """The process-wide step timer."""
    return _TIMER


_DEVICE_LISTENERS: list[Callable[[float], None]] = []


def on_device_work(listener: Callable[[float], None]) -> Callable[[], None]:
    """Call ``listener(seconds)`` whenever a hook reports device work (:data:`DEVICE_PHASES`);
    returns the function that unregisters it."""
    _DEVICE_LISTENERS.append(listener)

    def remove() -> None:
        if listener in _DEVICE_LISTENERS:
            _DEVICE_LISTENERS.remove(listener)

    return remove


_WAIT_LISTENERS: list[Callable[[float], None]] = []


def on_stream_wait(listener: Callable[[float], None]) -> Callable[[], None]:
    """Call ``listener(t)`` whenever the host waited for a collective the next layer's compute
    depends on, ``t`` being when that wait ended (``time.perf_counter``); returns the function
    that unregisters it. Why: a GPU's stream would wait too, and run the layer only after
    (the emulated-compute clock, :mod:`lowcomm.runtime.emulated`, pushes its deadlines)."""
    _WAIT_LISTENERS.append(listener)

    def remove() -> None:
        if listener in _WAIT_LISTENERS:
            _WAIT_LISTENERS.remove(listener)

    return remove


def stream_waited() -> None:
    """Report that the wait for a collective the next layer needs has just ended."""
    now = time.perf_counter()
    for listener in list(_WAIT_LISTENERS):
        listener(now)


def add(name: str, seconds: float) -> None:
    """Credit ``seconds`` to phase ``name`` of the current step (thread-safe); device work is
    also passed to the :func:`on_device_work` listeners."""
    _TIMER.add(name, seconds)
    if name in DEVICE_PHASES:
        for listener in list(_DEVICE_LISTENERS):
            listener(seconds)


@contextmanager
def measure(name: str) -> Iterator[None]:
    """``with timing.measure("compress"): ...`` inside a hook."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - start)

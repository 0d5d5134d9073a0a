"""A two-stream event timeline: one compute stream, one communication stream.

Tasks are added in program order (the order the training code issues them). A task starts
when its stream is free and every task it depends on has ended, so a stream runs its tasks
in FIFO order, exactly like a CUDA stream or a gloo/NCCL work queue. That is all the
simulator needs to express overlap: a collective issued after a layer's backward runs on the
comm stream while the compute stream continues with the next layer.

Compression work that DDP runs in a future's callback (e.g. Power-SGD's orthogonalization
between its two all-reduces) is placed on the comm stream: it sits in the dependency chain
between collectives. Its seconds also take the compute stream's time (a GPU's stream runs its
kernels between backward's; emulated compute waits for it as for device work; on shared cores
it takes a core), but *when* the callback runs, not when it was issued: such a task is held
(:meth:`Timeline.add_when_ready`) and placed on its stream before the first task added after
it that would start at or after the time it is ready.

With emulated compute on shared cores (:attr:`Timeline.host_kinds` set) the layers are waits,
but the host work (the codecs, the optimizer) is CPU work of the same process as the
collectives' threads: a host task runs slower while collectives with a CPU cost
(:attr:`Task.cpu_s`) are in flight (:meth:`Timeline.host_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

STREAMS = ("compute", "comm")
#: the least speed host work keeps beside collectives (their measured CPU per byte is an average)
MIN_HOST_SPEED = 0.05


@dataclass
class Task:
    """One piece of work on one stream, with the interval the timeline placed it in."""
    name: str
    stream: str
    kind: str  # forward | backward | optimizer | compress | comm | sync | contention
    iteration: int
    start: float
    end: float
    wire_bytes: int = 0
    #: of ``wire_bytes``, what crosses inter-node links (the accounting layer's link classes)
    inter_bytes: float = 0.0
    #: a collective's CPU seconds, spread over its run, that host work beside it loses
    cpu_s: float = 0.0

    @property
    def duration(self) -> float:
        """Seconds the task runs."""
        return self.end - self.start

    def overlaps(self, other: Task) -> bool:
        """True if the two tasks run at the same time for a positive interval."""
        return min(self.end, other.end) - max(self.start, other.start) > 1e-15


class Timeline:
    """Places tasks on the two FIFO streams as they are added (see the module docstring)."""
    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self._free = {s: 0.0 for s in STREAMS}
        self._last: dict[str, Task | None] = {s: None for s in STREAMS}
        #: per stream, work held until the stream reaches its ready time: (ready, name, seconds, kind, iteration)
        self._held: dict[str, list[tuple[float, str, float, str, int]]] = {s: [] for s in STREAMS}
        #: kinds of compute-stream task that are host CPU work slowed by collectives' ``cpu_s``
        self.host_kinds: frozenset[str] = frozenset()
        #: the placed tasks with a CPU cost (``cpu_s``), so host work need not scan every task
        self._charged: list[Task] = []

    def host_seconds(self, start: float, seconds: float) -> float:
        """How long ``seconds`` of host work from ``start`` take beside the collectives placed
        so far: while collectives whose CPU adds up to ``r`` per second run, it progresses at
        ``1 - r`` (never below :data:`MIN_HOST_SPEED`). Collectives placed later are not seen."""
        flights = [t for t in self._charged if t.end > start and t.duration > 0]
        if not flights or seconds <= 0:
            return seconds
        t, left = start, seconds
        for edge in [*sorted({e for f in flights for e in (f.start, f.end) if e > start}), math.inf]:
            rate = sum(f.cpu_s / f.duration for f in flights if f.start <= t < f.end)
            speed = max(1.0 - rate, MIN_HOST_SPEED)
            if t + left / speed <= edge:
                return t + left / speed - start
            left -= (edge - t) * speed
            t = edge
        return seconds  # not reached: the last edge is infinite

    def add_when_ready(self, name: str, stream: str, duration: float, *, kind: str, iteration: int,
                       ready: float) -> None:
        """Hold a task that runs on ``stream`` from ``ready`` on, between the tasks issued
        around then: it is placed before the first task added later that would start at or
        after ``ready`` (tasks added earlier keep their places; see the module docstring)."""
        if stream not in self._held:
            raise ValueError(f"unknown stream {stream!r}")
        self._held[stream].append((ready, name, duration, kind, iteration))
        self._held[stream].sort(key=lambda h: h[0])

    def _place_held(self, stream: str, before: float) -> None:
        """Place the held tasks of ``stream`` that are ready by the time the next task would
        start (``before``, moved on by each one placed)."""
        held = self._held[stream]
        while held and held[0][0] <= max(before, self._free[stream]):
            ready, name, duration, kind, iteration = held.pop(0)
            start = max(self._free[stream], ready)
            if kind in self.host_kinds and stream == "compute":
                duration = self.host_seconds(start, duration)
            task = Task(name, stream, kind, iteration, start, start + max(duration, 0.0))
            self._free[stream] = task.end
            self._last[stream] = task
            self.tasks.append(task)

    def flush(self) -> None:
        """Place every task still held (the end of a simulation: nothing follows them)."""
        for stream in STREAMS:
            self._place_held(stream, float("inf"))

    def add(
        self,
        name: str,
        stream: str,
        duration: float,
        *,
        kind: str,
        iteration: int,
        after: Iterable[Task | None] = (),
        wire_bytes: int = 0,
        inter_bytes: float = 0.0,
        queued_duration: float | None = None,
        beside: tuple[float, float, float] | None = None,
        cpu_s: float = 0.0,
    ) -> Task:
        """Append a task: it starts when its stream is free and every ``after`` task has ended.
        ``queued_duration``: its duration instead when it had to wait for the stream (its
        dependencies ended before the stream was free), e.g. a collective queued behind
        another, whose latency the library overlaps with the one before.

        ``beside`` = ``(wire_s, latency_s, least_s)``: a collective the library runs beside the
        one before it (gloo's two worker threads). When it waits for the stream, its latency
        runs from when the task before it started (or its dependencies ended, if later) and
        only its transfer waits for the link: it takes ``max(wire_s, least_s, max(previous
        start, ready) + latency_s - free)``, ``least_s`` being what the probe measured such a
        collective to cost beside a transfer (the CPU its steps still need).

        ``cpu_s``: a collective's CPU, which slows the host work placed beside it later
        (:meth:`host_seconds`)."""
        if stream not in self._free:
            raise ValueError(f"unknown stream {stream!r}")
        ready = max([0.0, *(t.end for t in after if t is not None)])
        self._place_held(stream, ready)
        free = self._free[stream]
        start = max(free, ready)
        if free > ready:
            if beside is not None:
                wire_s, latency_s, least_s = beside
                before = self._last[stream]
                began = max(before.start if before is not None else free, ready)
                duration = max(wire_s, least_s, began + latency_s - free)
            elif queued_duration is not None:
                duration = queued_duration
        if kind in self.host_kinds and stream == "compute":
            duration = self.host_seconds(start, duration)
        task = Task(name, stream, kind, iteration, start, start + max(duration, 0.0), wire_bytes, inter_bytes, cpu_s)
        if cpu_s > 0:
            self._charged.append(task)
        self._free[stream] = task.end
        self._last[stream] = task
        self.tasks.append(task)
        return task

    def find(self, name: str, iteration: int | None = None) -> Task:
        """The first task named ``name`` (in ``iteration``), for tests and plots."""
        for t in self.tasks:
            if t.name == name and (iteration is None or t.iteration == iteration):
                return t
        raise KeyError(f"no task {name!r} in iteration {iteration}")

    def of_iteration(self, iteration: int) -> list[Task]:
        """Every task of one iteration."""
        return [t for t in self.tasks if t.iteration == iteration]

    def end_of(self, iteration: int) -> float:
        """When the last task of ``iteration`` ends."""
        return max((t.end for t in self.of_iteration(iteration)), default=0.0)

    def render(self, iteration: int | None = None) -> str:
        """A plain text listing, handy when a test fails."""
        rows = [t for t in self.tasks if iteration is None or t.iteration == iteration]
        return "\n".join(
            f"{t.iteration:>2} {t.stream:<7} {t.kind:<9} {t.name:<28} "
            f"{t.start * 1e3:10.4f} -> {t.end * 1e3:10.4f} ms"
            for t in rows
        )

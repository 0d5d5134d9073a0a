"""Reduce-scatter on gloo as a ring of point-to-point steps, run off the caller's thread.

Why not gloo's own: ``reduce_scatter_tensor`` on gloo runs a whole all-reduce underneath and
sends ``2(P-1)/P·n`` bytes per worker, twice the ``(P-1)/P·n`` a reduce-scatter needs. The
replacement lowcomm used before, an all-to-all plus a local sum, sends the right bytes but
posts every chunk at once: each worker pushes P-1 flows through its link and receives P-1,
and on shaped links that incast costs a fifth to a third of the bandwidth (4 emulated workers
at 1 Gbit/s: 0.65-0.81 Gbit/s, against 0.93 for gloo's ring all-gather; docs/benchmarks.md,
"Reduce-scatter on gloo"). NCCL's reduce-scatter is a ring; this module gives gloo the same
schedule through :func:`torch.distributed.isend` / :func:`~torch.distributed.irecv`: in each
of the P-1 steps a worker sends one partial-sum chunk to the next rank and receives one from
the previous, so every link carries one flow. The bytes are those the ledger counts for a
reduce-scatter.

Step ``s`` (0-based) on rank ``r``: send the running sum of chunk ``(r-s-1) mod P`` to
``r+1``, receive the running sum of chunk ``(r-s-2) mod P`` from ``r-1`` and add this rank's
own part of it. After the last step rank ``r`` holds the full sum of chunk ``r``. Each chunk is
summed in one fixed order (starting at the rank after its owner), the same on every rank.

Asynchrony: each step waits on the one before, so a ring cannot be one queued gloo call.
:func:`start` hands it to short-lived threads of its process group (at most
:data:`IN_FLIGHT`), which take the group's rings in submission order and exit when none is
left; the returned handle's ``wait()`` blocks until the ring is done (and raises what the ring
raised). Every rank submits the same
rings in the same order, as with any collective; the point-to-point tags come from a
reserved range (:data:`TAG_BASE`) counted per group, so they never meet the tags of other
point-to-point traffic (gTop-k's rounds use the default tag).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

#: First point-to-point tag of the rings (gloo accepts non-negative 32-bit tags).
TAG_BASE = 1 << 30
#: Tags cycle through this many values above :data:`TAG_BASE`.
TAG_SPAN = 1 << 29
#: A step's chunk travels in segments of this size, so summing one overlaps receiving the next.
SEGMENT_BYTES = 1 << 20
#: Rings of one group in flight at once, each on its own thread (gloo runs two collectives at
#: once, too): a small ring's latency steps then pass while a large one's transfer holds the link.
IN_FLIGHT = 2


def segments(elements: int, element_size: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` element ranges a chunk travels in (at least one, maybe empty)."""
    seg = max(1, SEGMENT_BYTES // max(element_size, 1))
    return [(a, min(a + seg, elements)) for a in range(0, elements, seg)] or [(0, 0)]


class RingWork:
    """Handle of one ring reduce-scatter: ``wait()`` until it is done; its error, if any."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout: Any = None) -> bool:
        """Block until the ring finished; re-raise its error in the caller."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"ring reduce-scatter failed: {self._error}") from self._error
        return True

    def is_completed(self) -> bool:
        """True once the ring finished (successfully or not)."""
        return self._done.is_set()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()


class _Ring:
    """One reduce-scatter's buffers and steps (module docstring)."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.input = input.reshape(-1)
        self.output = output
        self.chunk = self.input.numel() // self.world
        self.bounds = segments(self.chunk, output.element_size())
        #: the first of :meth:`tags_needed` tags (set by :func:`start`)
        self.tag = TAG_BASE

    def tags_needed(self) -> int:
        """Point-to-point tags this ring uses: one per segment and step."""
        return (self.world - 1) * len(self.bounds)

    def _part(self, k: int) -> torch.Tensor:
        return self.input[k * self.chunk:(k + 1) * self.chunk]

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world)

    def run(self) -> None:
        p, r = self.world, self.rank
        direct = self.output.is_contiguous()
        out = self.output.view(-1) if direct else torch.empty_like(self._part(r))
        if p == 1:
            out.copy_(self._part(0))
        else:
            self._steps(out)
        if not direct:
            self.output.copy_(out.view_as(self.output))

    def _steps(self, out: torch.Tensor) -> None:
        """The P-1 steps, pipelined by segments: a segment received in step ``s`` is summed and
        sent on for step ``s+1`` at once, while the rest of step ``s`` is still arriving."""
        p, r, n, bounds = self.world, self.rank, self.chunk, self.bounds
        nxt, prv = self._peer(1), self._peer(-1)
        received = torch.empty(p - 1, n, dtype=out.dtype, device=out.device)
        ids = len(bounds)
        recvs = [[dist.irecv(received[s, a:b], prv, group=self.group, tag=self.tag + s * ids + j)
                  for j, (a, b) in enumerate(bounds)] for s in range(p - 1)]
        own = self._part((r - 1) % p)
        sends = [dist.isend(own[a:b], nxt, group=self.group, tag=self.tag + j) for j, (a, b) in enumerate(bounds)]
        for s in range(p - 1):
            mine = self._part((r - s - 2) % p)
            last = s == p - 2
            for j, (a, b) in enumerate(bounds):
                work = recvs[s][j]
                assert work is not None  # irecv on a group this rank is in
                work.wait()
                target = out[a:b] if last else received[s, a:b]
                torch.add(mine[a:b], received[s, a:b], out=target)
                if not last:
                    sends.append(dist.isend(target, nxt, group=self.group, tag=self.tag + (s + 1) * ids + j))
        for w in sends:
            assert w is not None
            w.wait()


class _Driver:
    """Runs one process group's rings in submission order, up to :data:`IN_FLIGHT` at once.

    Why no deadlock: every rank starts the same rings in the same order, so the oldest ring not
    yet done is, on every rank, either done or running (a rank runs a younger ring only on a
    thread an older one freed), and it needs nothing else to finish."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[tuple[_Ring, RingWork]] = deque()
        self._running = 0
        self._next_tag = 0

    def tags(self, steps: int) -> int:
        """The first of ``steps`` consecutive tags for the next ring (every rank draws the same)."""
        with self._lock:
            if self._next_tag + steps > TAG_SPAN:
                self._next_tag = 0
            tag = TAG_BASE + self._next_tag
            self._next_tag += max(steps, 1)
            return tag

    def submit(self, ring: _Ring) -> RingWork:
        work = RingWork()
        with self._lock:
            self._jobs.append((ring, work))
            if self._running < IN_FLIGHT:
                self._running += 1
                threading.Thread(target=self._run, name="lowcomm-ring", daemon=True).start()
        return work

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._running -= 1
                    return
                ring, work = self._jobs.popleft()
            try:
                ring.run()
            except BaseException as e:  # handed to the waiting caller
                work._finish(e)
            else:
                work._finish()


_DRIVERS: "weakref.WeakKeyDictionary[dist.ProcessGroup, _Driver]" = weakref.WeakKeyDictionary()
_DRIVERS_LOCK = threading.Lock()


def _driver(group: dist.ProcessGroup) -> _Driver:
    with _DRIVERS_LOCK:
        d = _DRIVERS.get(group)
        if d is None:
            d = _DRIVERS[group] = _Driver()
        return d


def start(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None) -> RingWork:
    """Start a ring reduce-scatter (sum) of flat ``input`` into ``output`` (``input.numel() /
    P`` elements) on ``group``; the returned handle's ``wait()`` completes it."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "the default process group is not initialized"
    world = dist.get_world_size(pg)
    if input.numel() % world or output.numel() * world != input.numel():
        raise ValueError(f"reduce-scatter: input of {input.numel()} elements does not split into "
                         f"{world} outputs of {output.numel()}")
    d = _driver(pg)
    ring = _Ring(output, input, pg)
    ring.tag = d.tags(ring.tags_needed())
    return d.submit(ring)

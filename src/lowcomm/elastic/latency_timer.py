"""Timing one module the way the latency table and its validation both do: batch 1, eval mode.

Why a module of its own: the table (:mod:`lowcomm.elastic.latency`) and every benchmark that
checks it must time pieces and whole networks identically, or the comparison measures the timer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.runtime.host import cpu_name

__all__ = ["STATS", "Timer", "WallTimer", "combine", "device_name", "measure_network", "steady_allocator"]

#: ``timer(module, input_shapes) -> milliseconds``: how one module is timed. Injectable so that
#: tests check the table's bookkeeping without depending on this machine's speed.
Timer = Callable[[nn.Module, Sequence[tuple[int, ...]]], float]


def device_name(device: torch.device | str = "cpu") -> str:
    """A human name for the device the table was measured on (GPU model or CPU model)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


@contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


#: glibc's mallopt parameters (malloc.h): the size above which a block is mmap'ed (and
#: unmapped on free), and the free heap top above which memory is given back to the system.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_steady: str | None = None


def steady_allocator() -> str:
    """Keep freed CPU memory in the process while timing (glibc: blocks up to 32 MiB from the
    heap, the heap never trimmed); returns what was done, for the record.

    Why: with glibc's defaults every activation above the (adaptive) mmap threshold is mapped
    on allocation and unmapped on free, so each forward pays fresh page faults, whose cost
    swings with the host's memory state (tens of percent on a VM, from one half-minute to the
    next, even as the minimum of many runs); a long-running inference server reuses its memory
    instead. Process-wide and once: it only changes where freed memory waits. Not glibc (or
    not Linux): nothing is changed, and the string says so.
    """
    global _steady
    if _steady is None:
        _steady = "system default (not glibc)"
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("c")
            libc = ctypes.CDLL(name) if name else None
            if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):
                if libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30):
                    _steady = "glibc: mmap threshold 32 MiB, no trimming (freed memory reused)"
        except OSError:
            pass
    return _steady


class WallTimer:
    """The real timer: median wall time of ``repeats`` batch-1 forwards after ``warmup`` ones.

    The median, not the mean, because a shared machine's outliers (another process taking the
    core) only ever add time. ``stat="min"`` goes further (timeit's advice): the fastest run
    estimates the uncontended cost, consistently for pieces and whole networks, when other
    processes load the machine. Eval mode and ``no_grad``: latency is an inference property.
    On the CPU, memory is kept steady first (:func:`steady_allocator`).
    """

    def __init__(
        self,
        repeats: int = 20,
        warmup: int = 5,
        threads: int | None = None,
        device: str = "cpu",
        stat: str = "median",
    ) -> None:
        if repeats < 1 or warmup < 0:
            raise UsageError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
        if threads is not None and threads < 1:
            raise UsageError(f"threads must be >= 1 (or None for torch's setting), got {threads}")
        if stat not in STATS:
            raise UsageError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
        self.repeats, self.warmup, self.threads, self.stat = repeats, warmup, threads, stat
        self.device = torch.device(device)
        #: how CPU memory was managed while timing (see :func:`steady_allocator`)
        self.allocator = steady_allocator() if self.device.type == "cpu" else "device allocator"

    def __call__(self, module: nn.Module, input_shapes: Sequence[tuple[int, ...]]) -> float:
        """Time ``module`` on random inputs of ``input_shapes``; milliseconds."""
        was_training = module.training
        module = module.to(self.device).eval()
        inputs = [torch.randn(shape, device=self.device) for shape in input_shapes]
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times = []
        try:
            with _threads(self.threads), torch.no_grad():
                for i in range(self.warmup + self.repeats):
                    sync()
                    start = time.perf_counter()
                    module(*inputs)
                    sync()
                    if i >= self.warmup:
                        times.append(time.perf_counter() - start)
        finally:
            module.train(was_training)
        return 1000.0 * STATS[self.stat](times)


def measure_network(
    module: nn.Module,
    sample_shape: Sequence[int],
    repeats: int = 20,
    *,
    warmup: int = 5,
    threads: int | None = None,
    timer: Timer | None = None,
    stat: str = "median",
) -> float:
    """Time a whole (extracted) network on one batch-1 input of ``sample_shape``; ms."""
    timer = timer or WallTimer(repeats, warmup, threads, stat=stat)
    return timer(module, [(1, *sample_shape)])


def combine(values: Sequence[float], stat: str) -> float:
    """One figure from several rounds' timings: the same statistic the timer takes per round."""
    if stat not in STATS:
        raise UsageError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
    return float(STATS[stat](list(values)))


def time_interleaved(
    timer: Timer,
    items: Sequence[tuple[nn.Module, Sequence[tuple[int, ...]]]],
    rounds: int,
    stat: str,
) -> list[float]:
    """Time every ``(module, input_shapes)`` once per round, round after round; ms per item.

    Why interleave: on a shared (virtual) machine the speed drifts over seconds (another tenant,
    another process). Timing item A for a while, then item B, lets a slow spell land on one
    item only and bias the comparison between them; round-robin spreads every spell over all
    items, and the per-item ``stat`` over rounds (min or median) then rejects it.
    """
    if rounds < 1:
        raise UsageError(f"rounds must be >= 1, got {rounds}")
    times: list[list[float]] = [[] for _ in items]
    for _ in range(rounds):
        for i, (module, shapes) in enumerate(items):
            times[i].append(float(timer(module, shapes)))
    return [combine(t, stat) for t in times]

"""Peak memory of a whole process tree (launcher, workers, and e.g. Ray's daemons), sampled.

Why a tree and not one process: a simulation is several processes (torchrun's workers, or
Flower's driver plus Ray's raylet, GCS and actor workers), and the number users compare is
what the machine as a whole had to hold. :class:`ProcessTreeSampler` polls the root and all
its descendants every ``interval_s`` and keeps the peak over time of the *sum*.

Two sums are kept, because they answer different questions:

* **RSS** (resident set size) counts every page a process has mapped and resident, shared or
  not. Every worker that imports torch maps the same ``libtorch_cpu.so`` (hundreds of MB),
  so summing RSS counts those shared pages once per process: with N workers the sum
  overstates the memory the machine really used by about (N - 1) x the shared libraries.
* **PSS** (proportional set size, Linux ``/proc/<pid>/smaps_rollup``) charges each shared
  page 1/k to each of the k processes mapping it, so the PSS of all processes adds up to the
  pages actually resident: the honest total. Where PSS cannot be read (another OS, or a
  process of another user) that process's RSS stands in, so PSS is then an upper bound.

Limits, said plainly: a spike shorter than ``interval_s`` between two samples is missed (the
value is a lower bound of the true peak); a descendant whose parent exits is re-parented to
init and leaves the tree; processes that vanish between listing and reading are skipped.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from dataclasses import dataclass
from typing import Any

import psutil


@dataclass(frozen=True)
class MemoryPeak:
    """Peak over time of the summed RSS and PSS of a process tree, in bytes, and the most
    processes seen at once."""

    rss_bytes: int
    pss_bytes: int
    processes: int

    def to_dict(self) -> dict[str, int]:
        """The ``peak_memory`` entry of the result JSON."""
        return {"rss_bytes": self.rss_bytes, "pss_bytes": self.pss_bytes, "processes": self.processes}


def _memory_of(proc: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) of one process; PSS falls back to RSS where it cannot be read."""
    try:
        full = proc.memory_full_info()
        rss = int(full.rss)
        return rss, int(getattr(full, "pss", rss))
    except psutil.AccessDenied:
        rss = int(proc.memory_info().rss)
        return rss, rss


def tree_memory(root_pid: int) -> MemoryPeak | None:
    """One sample: summed RSS and PSS of ``root_pid`` and its descendants now (None when the
    root is gone)."""
    try:
        root = psutil.Process(root_pid)
        procs: list[Any] = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    rss = pss = count = 0
    for proc in procs:
        try:
            r, p = _memory_of(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # exited (or became unreadable) between listing and reading
        rss += r
        pss += p
        count += 1
    return MemoryPeak(rss, pss, count) if count else None


class ProcessTreeSampler:
    """A daemon thread sampling :func:`tree_memory` every ``interval_s`` seconds.

    ``start()`` takes a first sample at once and ``stop()`` a last one, so even a run shorter
    than one interval gets a value. The three maxima are taken independently (the peak RSS
    and the peak PSS may come from different instants).
    """

    def __init__(self, root_pid: int, interval_s: float = 0.2) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.root_pid = root_pid
        self.interval_s = float(interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._rss = self._pss = self._procs = 0
        self.samples = 0

    def sample(self) -> None:
        """Take one sample now and fold it into the peaks."""
        now = tree_memory(self.root_pid)
        if now is None:
            return
        with self._lock:
            self._rss = max(self._rss, now.rss_bytes)
            self._pss = max(self._pss, now.pss_bytes)
            self._procs = max(self._procs, now.processes)
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> ProcessTreeSampler:
        """Begin sampling in the background (returns self)."""
        if self._thread is not None:
            raise RuntimeError("the sampler was already started")
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def peak(self) -> MemoryPeak:
        """The peaks so far (the sampler keeps running)."""
        with self._lock:
            return MemoryPeak(self._rss, self._pss, self._procs)

    def stop(self) -> MemoryPeak:
        """Stop the thread, take a last sample and return the peaks."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self.peak()

    def __enter__(self) -> ProcessTreeSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def peak_of_self() -> int:
    """This process's own peak RSS in bytes, as the kernel recorded it (exact, no sampling;
    one process only, shared libraries included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes, Linux: KiB


def this_tree() -> ProcessTreeSampler:
    """A sampler rooted at the current process (what a launcher or benchmark driver wants)."""
    return ProcessTreeSampler(os.getpid())

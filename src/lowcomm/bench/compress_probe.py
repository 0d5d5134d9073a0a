"""Time the codecs' kernels, and the machine's rates, with as many processes at once as the bench has workers.

Why: under emulated compute the layers are waits, but each worker's compression is real CPU
work, and the workers run it at the same moments on the machine's few cores. Scaling one
process's times by ``workers x threads / cores`` (:func:`lowcomm.sim.calibrate.core_share`)
assumed the codecs share the cores by time-slicing alone, and missed both ways: on 2 vCPUs
with 8 workers QSGD's gathered decode cost more than 4x its one-process time (memory bandwidth
is shared too) and gTop-k's compression 2.6x (docs/benchmarks.md, "The same methods with 8
workers"). Measured here, the way the workers meet it: ``workers`` processes, each with the
workers' torch threads, run :func:`lowcomm.sim.profiler.measure_compressors` on the model's
gradient shapes together, kept in step by a barrier before each codec; an entry's times are
the median over the processes. The simulator then prices an emulated row's compression with
this table instead of the scaled one-process times (:func:`lowcomm.bench.prediction.add_predictions`).

The kernels' bound (:mod:`lowcomm.bench.kernel_bound`) meets the same sharing: when the
workers outnumber the cores, no worker can copy at one process's bandwidth while the others
copy too. :func:`measure_shared_rates` measures the copy bandwidth and matmul rate each of
``workers`` processes gets when all of them run at once (:func:`lowcomm.bench.trained.machine_rates`).

Processes are spawned, not forked: a fork of a process whose OpenMP threads ran can hang.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

#: seconds to wait for the processes (a ResNet-50 table takes about a minute per process on
#: one core; they share the cores)
TIMEOUT_S = 1800.0


def measure_shared(shapes: Sequence[Sequence[int]], workers: int, *, threads: int = 1, reps: int = 3,
                   timeout_s: float = TIMEOUT_S) -> dict[str, dict[str, float]]:
    """``Profile.compressors``'s table measured by ``workers`` processes at once (each entry's
    every time the median over the processes)."""
    shape_list = [list(s) for s in shapes]
    return median_table(_together(_compressor_table, (shape_list, reps), workers, threads=threads,
                                  timeout_s=timeout_s))


def measure_shared_rates(workers: int, *, threads: int = 1, window_s: float = 0.5,
                         timeout_s: float = 300.0) -> dict[str, float]:
    """The copy bandwidth and matmul rate one process gets while ``workers`` processes run
    them at once (:func:`lowcomm.bench.kernel_bound.sustained_rates`, windows begun together):
    per rate, the mean over the processes, so that ``workers`` times it is the machine's."""
    rates = _together(_rates, (window_s,), workers, threads=threads, timeout_s=timeout_s)
    return {key: statistics.fmean(r[key] for r in rates) for key in rates[0]}


def median_table(tables: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per entry and field, the median over ``tables`` (entries every table has)."""
    names = set.intersection(*(set(t) for t in tables)) if tables else set()
    return {name: {k: statistics.median(t[name][k] for t in tables) for k in tables[0][name]}
            for name in sorted(names)}


def _together(measure: Callable[..., Any], args: tuple[Any, ...], workers: int, *, threads: int,
              timeout_s: float) -> list[Any]:
    """``measure(*args, before_each=barrier.wait)`` run by ``workers`` spawned processes of
    ``threads`` torch threads each, in step; their results (a process's error is raised here)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers, timeout=timeout_s)
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(measure, args, threads, barrier, results), daemon=True)
             for _ in range(workers)]
    for p in procs:
        p.start()
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < workers:
            try:
                kind, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:  # died before it could report (e.g. killed for memory)
                    raise RuntimeError(f"shared probe: a process exited with code {dead[0]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shared probe: no result within {timeout_s:.0f} s") from None
                continue
            if kind == "error":
                raise RuntimeError(f"shared probe failed in a worker: {value}")
            out.append(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return out


def _compressor_table(shapes: list[list[int]], reps: int, *, before_each: Callable[[], Any]) -> Any:
    from lowcomm.sim.profiler import measure_compressors

    return measure_compressors("cpu", shapes=shapes, reps=reps, before_each=before_each)


def _rates(window_s: float, *, before_each: Callable[[], Any]) -> dict[str, float]:
    from lowcomm.bench.kernel_bound import sustained_rates

    return sustained_rates(window_s, start=before_each)


def _run(measure: Callable[..., Any], args: tuple[Any, ...], threads: int, barrier: Any, results: Any) -> None:
    """One process of a probe: ``measure``, in step with the others; errors reported."""
    try:
        import torch

        torch.set_num_threads(max(1, threads))
        results.put(("ok", measure(*args, before_each=barrier.wait)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        barrier.abort()  # the others must not wait for this one
        results.put(("error", f"{type(e).__name__}: {e}"))

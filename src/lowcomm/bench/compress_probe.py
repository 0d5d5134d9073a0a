"""Time every codec's kernels with as many processes at once as the bench has workers.

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

Processes are spawned, not forked: a fork of a process whose OpenMP threads ran can hang.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Sequence
from typing import Any

#: seconds to wait for the processes (a ResNet-50 table takes about a minute per process on
#: one core; they share the cores)
TIMEOUT_S = 1800.0


def measure_shared(shapes: Sequence[Sequence[int]], workers: int, *, threads: int = 1, reps: int = 3,
                   timeout_s: float = TIMEOUT_S) -> dict[str, dict[str, float]]:
    """``Profile.compressors``'s table measured by ``workers`` processes at once (each entry's
    every time the median over the processes)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers, timeout=timeout_s)
    results: Any = ctx.Queue()
    shape_list = [list(s) for s in shapes]
    procs = [ctx.Process(target=_measure, args=(shape_list, threads, reps, barrier, results), daemon=True)
             for _ in range(workers)]
    for p in procs:
        p.start()
    tables: list[dict[str, dict[str, float]]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(tables) < workers:
            try:
                kind, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:  # died before it could report (e.g. killed for memory)
                    raise RuntimeError(f"compression probe: a process exited with code {dead[0]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"compression probe: no result within {timeout_s:.0f} s") from None
                continue
            if kind == "error":
                raise RuntimeError(f"compression probe failed in a worker: {value}")
            tables.append(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return median_table(tables)


def median_table(tables: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per entry and field, the median over ``tables`` (entries every table has)."""
    names = set.intersection(*(set(t) for t in tables)) if tables else set()
    return {name: {k: statistics.median(t[name][k] for t in tables) for k in tables[0][name]}
            for name in sorted(names)}


def _measure(shapes: list[list[int]], threads: int, reps: int, barrier: Any, results: Any) -> None:
    """One process of the probe: the whole table, in step with the others; errors reported."""
    try:
        import torch

        from lowcomm.sim.profiler import measure_compressors

        torch.set_num_threads(max(1, threads))
        results.put(("ok", measure_compressors("cpu", shapes=shapes, reps=reps, before_each=barrier.wait)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        barrier.abort()  # the others must not wait for this one
        results.put(("error", f"{type(e).__name__}: {e}"))

"""Time the collective library itself on the bench's network: latency and bandwidth per kind.

The TCP probe (:mod:`lowcomm.bench.probe`) says what the link delivers; what a training step
pays is what *gloo* delivers on it. This probe starts the same N workers the methods run in
(same namespaces, same interface, same torch threads), and through
:mod:`lowcomm.comm.accounting` (so reduce-scatter is the point-to-point ring that lowcomm
uses on gloo) times

* each collective kind with a tiny payload (median of ``--reps``): the latency,
* all-reduce, reduce-scatter and all-gather with a tiny payload issued ``STREAM`` times back
  to back before waiting (``stream_s``, per collective): the latency of a collective queued
  behind another, which the library overlaps in part (a step issues one per layer or bucket), and
* all-reduce, reduce-scatter and all-gather with a payload sized to ``--wire-bytes`` on the
  wire per worker (median of 3): the effective bandwidth of that kind, and
* for the kinds run two at a time (gloo's all-reduce and all-gather, the ring), ``STREAM`` tiny ones issued
  behind such a large one (``beside_s``, per tiny collective: what the pair takes beyond the
  large one alone): the latency of a collective that waits beside a transfer, which costs far
  less than one queued behind another tiny one when the transfer leaves the CPU idle.

Rank 0 writes ``{"workers", "small_s": {kind: s}, "stream_s": {kind: s}, "beside_s": {kind: s},
"large": {kind: [payload_bytes, s]}}``;
:func:`lowcomm.sim.calibrate.network_from_probe` fits the simulator's per-kind α/β to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from lowcomm.bench.runner import launch_options, redirect_fds
from lowcomm.runtime.launch import launch_workers

#: Master port inside the namespaces (the trainer uses 29500, the TCP probe 29411-29412).
PORT = 29600
#: Target seconds on the wire for one large probe collective at the measured bandwidth.
LARGE_WIRE_S = 0.3
#: Tiny collectives issued back to back for the queued latency (``stream_s``).
STREAM = 16


def _time(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _back_to_back(issue: Callable[..., Any]) -> Callable[[], None]:
    """``STREAM`` collectives issued (``issue(True)``: asynchronously), then all waited for."""
    def run() -> None:
        for work in [issue(True) for _ in range(STREAM)]:
            work.wait()
    return run


def _behind(large: Callable[..., Any], tiny: Callable[..., Any]) -> Callable[[], None]:
    """One large collective, then ``STREAM`` tiny ones issued behind it, all waited for."""
    def run() -> None:
        for work in [large(True), *(tiny(True) for _ in range(STREAM))]:
            work.wait()
    return run


def _worker(out: str, wire_bytes: int, reps: int, threads: int) -> None:
    import torch
    import torch.distributed as dist

    from lowcomm.comm import accounting

    torch.set_num_threads(threads)
    # gloo and CPU tensors on purpose: this times what gloo delivers on the emulated link, and
    # gloo carries CPU tensors. Timing NCCL would need CUDA tensors and a group with a CUDA
    # backend ("cpu:gloo,cuda:nccl", see lowcomm.runtime.distributed.CUDA_BACKEND).
    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()

    def ops(elems: int, local: int) -> dict[str, Callable[..., Any]]:
        full = torch.ones(elems)
        shard = torch.empty(elems // p)
        mine = torch.ones(local)
        gathered = torch.empty(local * p)
        return {
            "all_reduce": lambda a=False: accounting.all_reduce(full, tag="probe", async_op=a),
            "reduce_scatter": lambda a=False: accounting.reduce_scatter_tensor(shard, full, tag="probe",
                                                                               async_op=a),
            "all_gather": lambda a=False: accounting.all_gather_into_tensor(gathered, mine, tag="probe",
                                                                            async_op=a),
            "broadcast": lambda a=False: accounting.broadcast(full, 0, tag="probe", async_op=a),
        }

    tiny = ops(4 * p, 4)
    small = {k: _time(f, reps, 3) for k, f in tiny.items()}
    # the same tiny collectives issued back to back, as a training step issues them (one per
    # layer or bucket): the cost of each when it queues behind the one before
    stream = {k: _time(_back_to_back(tiny[k]), max(3, reps // 3), 1) / STREAM
              for k in ("all_reduce", "reduce_scatter", "all_gather")}
    large: dict[str, list[float]] = {}
    beside: dict[str, float] = {}
    if wire_bytes > 0 and p > 1:
        # payloads with about ``wire_bytes`` on the wire per worker for each kind
        ar = max(p, (wire_bytes * p // (2 * (p - 1)) // 4) // p * p)
        rs = max(p, (wire_bytes * p // (p - 1) // 4) // p * p)
        ag = max(1, wire_bytes // (p - 1) // 4)
        for kind, (elems, local) in (("all_reduce", (ar, 1)), ("reduce_scatter", (rs, 1)),
                                     ("all_gather", (p, ag))):
            f = ops(elems, local)[kind]
            payload = 4 * (local if kind == "all_gather" else elems)
            large[kind] = [payload, _time(f, 3, 1)]
            # every kind runs two at a time (gloo's threads, the ring's): tiny ones behind it
            beside[kind] = max(0.0, (_time(_behind(f, tiny[kind]), 3, 1) - large[kind][1]) / STREAM)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"workers": p, "threads": threads, "reps": reps,
                                         "small_s": small, "stream_s": stream, "beside_s": beside,
                                         "large": large}) + "\n")
    dist.destroy_process_group()


def run(
    nproc: int,
    *,
    bits_per_s: float | None,
    threads: int = 1,
    cluster: Any = None,
    reps: int = 15,
    timeout_s: float = 180.0,
    work_dir: str | Path | None = None,
    launcher: Callable[..., int] | None = None,
    nproc_per_node: int | None = None,
) -> dict[str, Any]:
    """Run the probe on ``nproc`` workers (in ``cluster``'s namespaces, or on loopback; nodes of
    ``nproc_per_node`` workers, the cluster's by default).

    Returns the probe's JSON, or ``{"error": reason}`` if it did not complete.
    """
    if launcher is None:
        launcher = launch_workers
    wire = int(LARGE_WIRE_S * bits_per_s / 8) if bits_per_s else 0
    wire = min(wire, 64 << 20)  # at >1.7 Gbit/s the CPU, not the wire, sets the pace anyway
    work = Path(work_dir or tempfile.mkdtemp(prefix="lowcomm-collprobe-"))
    out = work / f"collprobe-{os.getpid()}-{time.monotonic_ns()}.json"
    args = ["--out", str(out), "--wire-bytes", str(wire), "--reps", str(reps), "--threads", str(threads)]
    kw: dict[str, Any] = {"timeout_s": timeout_s, "failure_grace_s": 5.0, "quiet": True,
                          "command": [sys.executable, "-m", "lowcomm.bench.collprobe"]}
    kw.update(launch_options(cluster, PORT, nproc_per_node=nproc_per_node))
    log = work / (out.stem + ".log")
    started = time.perf_counter()
    with redirect_fds(log):
        code = launcher(args, nproc, **kw)
    if code != 0 or not out.exists():
        text = log.read_text(errors="replace")[-300:] if log.exists() else ""
        return {"error": f"collective probe failed (exit code {code}): {text.strip()}"}
    data = json.loads(out.read_text())
    data["wall_s"] = time.perf_counter() - started
    return data


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point (``python -m lowcomm.bench.collprobe``): one rank of the probe."""
    p = argparse.ArgumentParser(prog="python -m lowcomm.bench.collprobe")
    p.add_argument("--out", required=True)
    p.add_argument("--wire-bytes", type=int, default=0)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    _worker(a.out, a.wire_bytes, a.reps, a.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

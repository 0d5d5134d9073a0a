"""Measure the CPU that gloo's threads take from compute on this machine (the simulator's
:attr:`~lowcomm.sim.NetworkModel.cpu_s_per_wire_byte` and ``cpu_s_per_collective``), on
workers started by the launcher.

Why here and not in :mod:`lowcomm.sim`: measuring needs real worker processes joined in a
process group, which is the bench's business (like :mod:`lowcomm.bench.collprobe`); the
simulator keeps the per-rank routine (:func:`lowcomm.sim.calibrate._contention_rank`) and the
arithmetic (:func:`lowcomm.sim.calibrate.fit_contention`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lowcomm.bench.runner import launch_options, redirect_fds
from lowcomm.runtime.launch import launch_workers

PORT = 29431


def measure_contention(workers: int = 4, *, seconds: float = 3.0, payload_mb: float = 4.0,
                       small_kb: float = 64.0, matmul_n: int = 192, threads: int = 1, rounds: int = 3,
                       cluster: Any = None, launcher: Callable[..., int] | None = None,
                       timeout_s: float | None = None) -> dict[str, Any]:
    """``workers`` processes (``threads`` torch threads each, as bench workers) run a matmul
    loop for ``seconds`` alone and about as long while a thread of the same process
    all-reduces ``payload_mb`` buffers among them (and, with ``small_kb`` > 0, as long beside
    all-reduces of ``small_kb``), in ``rounds`` alternating phases (a drift in the machine's
    load hits every phase alike). Returns the compute lost per wire byte with the large
    payload (``cpu_s_per_wire_byte``) and per collective with the small one
    (``cpu_s_per_collective``, 0 without it), each the median over ranks (one rank an outside
    job slowed says little), and each rank's raw numbers. Why two sizes: a small collective
    costs a fixed amount of CPU (thread wake-ups, syscalls) that per byte misses; measured on
    4 workers sharing 2 vCPUs at 1 Gbit/s, 2.4-4 ms from 4 to 256 KB, where per byte gives
    under 1.4 ms, while per byte holds within 10 % from 1 to 16 MB (docs/simulator.md §5.2)."""
    from lowcomm.sim.calibrate import fit_contention
    from lowcomm.comm.accounting import wire_bytes

    elems = max(1, int(payload_mb * 2**20 / 4))
    work = Path(tempfile.mkdtemp(prefix="lowcomm-contention-"))
    out = work / f"contention-{os.getpid()}-{time.monotonic_ns()}.json"
    small = max(0, int(small_kb * 2**10 / 4))
    args = ["--out", str(out), "--seconds", str(seconds), "--elems", str(elems), "--matmul-n", str(matmul_n),
            "--threads", str(threads), "--rounds", str(rounds), "--small-elems", str(small)]
    kw: dict[str, Any] = {"timeout_s": timeout_s or 60 + 6 * seconds, "failure_grace_s": 5.0, "quiet": True,
                          "command": [sys.executable, "-m", "lowcomm.bench.contention"]}
    kw.update(launch_options(cluster, PORT))
    log = work / (out.stem + ".log")
    try:
        with redirect_fds(log):
            code = (launcher or launch_workers)(args, workers, **kw)
        if code != 0 or not out.exists():
            text = log.read_text(errors="replace")[-300:] if log.exists() else ""
            raise RuntimeError(f"contention probe failed (exit code {code}): {text.strip()}")
        res = json.loads(out.read_text())
    finally:  # what the caller needs is returned or in the error
        shutil.rmtree(work, ignore_errors=True)

    def lost(r: dict[str, Any], key: str, per_op_bytes: int) -> float:
        """Compute lost per wire byte beside the ``key`` phase (per collective: × per_op_bytes)."""
        return fit_contention(alone_iters=int(r["alone_iters"]), alone_s=r["alone_s"],
                              with_iters=int(r[f"{key}with_iters"]), with_s=r[f"{key}with_s"],
                              wire_bytes_moved=per_op_bytes * r[f"{key}all_reduces"])

    per_op = wire_bytes("all_reduce", elems * 4, workers)
    ks = [lost(r, "", per_op) for r in res]
    per_small = wire_bytes("all_reduce", small * 4, workers)
    cs = [lost(r, "small_", per_small) * per_small for r in res] if small else [0.0]
    return {"workers": workers, "threads": threads, "payload_bytes": elems * 4, "small_payload_bytes": small * 4,
            "cpu_s_per_wire_byte": statistics.median(ks), "cpu_s_per_collective": statistics.median(cs),
            "per_rank": res, "per_rank_cpu_s_per_wire_byte": ks, "per_rank_cpu_s_per_collective": cs}


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point (``python -m lowcomm.bench.contention``): one rank of the probe."""
    import torch.distributed as dist

    from lowcomm.sim.calibrate import _contention_rank

    p = argparse.ArgumentParser(prog="python -m lowcomm.bench.contention")
    p.add_argument("--out", required=True)
    for name, kind in (("--seconds", float), ("--elems", int), ("--matmul-n", int), ("--threads", int),
                       ("--rounds", int)):
        p.add_argument(name, type=kind, required=True)
    p.add_argument("--small-elems", type=int, default=0)
    a = p.parse_args(argv)
    dist.init_process_group("gloo")  # CPU tensors: this times gloo's threads beside CPU compute
    mine = _contention_rank(seconds=a.seconds, payload_elems=a.elems, matmul_n=a.matmul_n, threads=a.threads,
                            rounds=a.rounds, small_elems=a.small_elems)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(every) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

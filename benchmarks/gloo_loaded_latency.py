"""How long a small gloo all-reduce takes while every worker's cores are busy computing.

Why: with real compute on a shared CPU (four workers on two cores here) a collective issued
during backward needs gloo's threads to be scheduled on every rank at every ring step, and
they compete with the compute threads for the cores. The simulator charges the CPU those
threads take *from compute* (``cpu_s_per_wire_byte``, docs/simulator.md 5.2) but not the
converse, the delay compute imposes on the collective. This measures that delay: each of N
workers times ``--reps`` all-reduces of ``--elems`` float32 elements, first with idle cores,
then while a separate process per worker (a single-threaded matmul loop, no shared GIL)
keeps a core busy, the way a worker's backward does. Loopback (no shaping): what is timed is
scheduling, not bandwidth.

    python benchmarks/gloo_loaded_latency.py [--nproc 4] [--elems 1000,40000] [--reps 40]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PORT = 29657


def _burn(stop: Any) -> None:
    """A compute loop on one thread until ``stop`` is set (a stand-in for a worker's backward)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    while not stop.is_set():
        torch.mm(a, b)


def _worker(out: str, sizes: list[int], reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def median_ms(buf: torch.Tensor) -> float:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            samples.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(samples)

    mine: dict[str, dict[str, float]] = {}
    for n in sizes:
        buf = torch.ones(n)
        dist.barrier()
        median_ms(buf)  # warm-up
        alone = median_ms(buf)
        ctx = mp.get_context("fork")
        stop = ctx.Event()
        burner = ctx.Process(target=_burn, args=(stop,))
        burner.start()
        try:
            time.sleep(0.5)  # every rank's loop running before the first timed collective
            dist.barrier()
            loaded = median_ms(buf)
        finally:
            stop.set()
            burner.join()
        mine[str(n)] = {"alone_ms": alone, "loaded_ms": loaded}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(out).write_text(json.dumps({"workers": dist.get_world_size(), "reps": reps, "per_rank": every}) + "\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Run the probe and print a Markdown table (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--elems", default="1000,40000", help="comma list of all-reduce sizes (float32 elements)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in a.elems.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--elems must be a comma list of integers, got {a.elems!r}")
    if not sizes or min(sizes) < 1 or a.reps < 1 or a.nproc < 2:
        ap.error("--elems values and --reps must be >= 1, --nproc >= 2")
    if a.worker_out:
        _worker(a.worker_out, sizes, a.reps)
        return 0

    from lowcomm.bench.runner import launch_options
    from lowcomm.runtime.launch import launch_workers

    out = Path(tempfile.mkdtemp(prefix="lowcomm-loadlat-")) / "loadlat.json"
    args = ["--worker-out", str(out), "--elems", a.elems, "--reps", str(a.reps)]
    command = [sys.executable, str(Path(__file__).resolve())]
    code = launch_workers(args, a.nproc, command=command, timeout_s=600, **launch_options(None, PORT))
    if code != 0 or not out.exists():
        print(f"workers failed (exit code {code})", file=sys.stderr)
        return 1
    data = json.loads(out.read_text())
    rows = []
    for n in sizes:
        alone = statistics.median(r[str(n)]["alone_ms"] for r in data["per_rank"])
        loaded = statistics.median(r[str(n)]["loaded_ms"] for r in data["per_rank"])
        rows.append({"elems": n, "alone_ms": alone, "loaded_ms": loaded, "extra_ms": loaded - alone})
    data["rows"] = rows
    print(f"{data['workers']} workers on loopback, one busy compute process beside each, median over ranks\n")
    print("| elements | alone ms | beside compute ms | extra ms |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['elems']} | {r['alone_ms']:.2f} | {r['loaded_ms']:.2f} | {r['extra_ms']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How fast each way of reduce-scattering on gloo moves bytes through emulated links.

gloo has no reduce-scatter of its own (``reduce_scatter_tensor`` runs an all-reduce
underneath). This times, on N workers in the bench's shaped namespaces (root; loopback
otherwise, said so), one ResNet-50-sized gradient (``--mb`` MB in ``--groups`` groups, as
DeAR's 25 MB fusion sends it), every group started asynchronously and then all waited for:

* ``ring``: lowcomm's reduce-scatter on gloo (:mod:`lowcomm.comm.ring`, P-1 point-to-point
  steps, one flow per link);
* ``all_to_all``: the all-to-all plus a local sum lowcomm used before (P-1 flows per worker
  at once);
* ``gloo_native``: ``torch.distributed.reduce_scatter_tensor`` on gloo (an all-reduce inside);
* ``all_gather``: gloo's ring all-gather of the same bytes, for reference;
* ``all_reduce``: gloo's ring all-reduce of the same gradient (twice the bytes).

Each row gives the median time over ``--reps`` rounds and the bytes per worker the
ring model says each must send, over that time ("goodput"), beside the link's rate.

    python benchmarks/gloo_reduce_scatter.py [--nproc 4] [--net 1gbit] [--mb 96] [--groups 4]
        [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

PORT = 29655


def _worker(out: str, mb: float, groups: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from lowcomm.comm import accounting

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    n = int(mb * 1e6 / 4 / groups) // p * p
    full = [torch.full((n,), float(rank + 1)) for _ in range(groups)]
    shard = [torch.empty(n // p) for _ in range(groups)]
    scratch = [torch.empty(n) for _ in range(groups)]

    def a2a_sum(f: torch.Tensor, s: torch.Tensor, r: torch.Tensor) -> Callable[[], None]:
        work = dist.all_to_all_single(r, f, async_op=True)

        def finish() -> None:
            work.wait()
            torch.sum(r.view(p, -1), dim=0, out=s)
        return finish

    def waiter(work: Any) -> Callable[[], None]:
        return lambda: work.wait()

    kinds: dict[str, Callable[[int], Callable[[], None]]] = {
        "ring": lambda i: waiter(accounting.reduce_scatter_tensor(shard[i], full[i], async_op=True, tag="rs")),
        "all_to_all": lambda i: a2a_sum(full[i], shard[i], scratch[i]),
        "gloo_native": lambda i: waiter(dist.reduce_scatter_tensor(shard[i], full[i], async_op=True)),
        "all_gather": lambda i: waiter(dist.all_gather_into_tensor(scratch[i], shard[i], async_op=True)),
        "all_reduce": lambda i: waiter(dist.all_reduce(scratch[i], async_op=True)),
    }
    times: dict[str, float] = {}
    for kind, start in kinds.items():
        samples = []
        for rep in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            for finish in [start(i) for i in range(groups)]:
                finish()
            if rep:  # the first round is a warm-up
                samples.append(time.perf_counter() - t0)
        times[kind] = statistics.median(samples)
        if kind == "ring":
            assert torch.equal(shard[0], torch.full_like(shard[0], p * (p + 1) / 2))
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"workers": p, "elements_per_group": n, "groups": groups,
                                         "times_s": times}) + "\n")
    dist.destroy_process_group()


def _wire_bytes(kind: str, total: int, p: int) -> float:
    return (2 if kind == "all_reduce" else 1) * (p - 1) / p * total


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a Markdown table (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--net", default="1gbit")
    ap.add_argument("--mb", type=float, default=96.0)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker_out:
        _worker(a.worker_out, a.mb, a.groups, a.reps)
        return 0

    from lowcomm.bench import netns
    from lowcomm.bench.runner import launch_options
    from lowcomm.runtime.launch import launch_workers

    spec = netns.parse_net(a.net)
    out = Path(tempfile.mkdtemp(prefix="lowcomm-rs-")) / "rs.json"
    args = ["--worker-out", str(out), "--mb", str(a.mb), "--groups", str(a.groups), "--reps", str(a.reps)]
    command = [sys.executable, str(Path(__file__).resolve())]
    reason = None if spec.loopback else netns.netns_support()
    if spec.loopback or reason:
        if reason:
            print(f"no emulated network ({reason}): timing on loopback", file=sys.stderr)
        code = launch_workers(args, a.nproc, command=command, timeout_s=900, **launch_options(None, PORT))
        rate = None
    else:
        with netns.Cluster(a.nproc, spec) as cluster:
            code = launch_workers(args, a.nproc, command=command, timeout_s=900, **launch_options(cluster, PORT))
        rate = spec.rate_bits_per_s
    if code != 0:
        print(f"workers failed (exit code {code})", file=sys.stderr)
        return 1
    data = json.loads(out.read_text())
    p, total = data["workers"], data["elements_per_group"] * data["groups"] * 4
    rows = []
    for kind, t in data["times_s"].items():
        goodput = _wire_bytes(kind, total, p) * 8 / t
        rows.append({"kind": kind, "ms": t * 1e3, "wire_mb": _wire_bytes(kind, total, p) / 1e6,
                     "goodput_gbit_s": goodput / 1e9, "of_link": goodput / rate if rate else None})
    data.update(net=a.net, rows=rows)
    print(f"{p} workers, {total / 1e6:.0f} MB in {data['groups']} groups, net {a.net}\n")
    print("| collective | ms | MB sent per worker | Gbit/s | of the link rate |\n|---|---:|---:|---:|---:|")
    for r in rows:
        share = f"{r['of_link']:.2f}" if r["of_link"] else "-"
        print(f"| {r['kind']} | {r['ms']:.0f} | {r['wire_mb']:.1f} | {r['goodput_gbit_s']:.3f} | {share} |")
    if a.json:
        Path(a.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak memory of the client state store vs the number of registered clients.

Usage: python benchmarks/fl_store_memory.py [--clients 1000,10000] [--per-round 100]
       [--rounds 10] [--hidden 256] [--numel N] [--dir PARENT] [--json out.json]

Why: the issue's target is that 10,000 registered SCAFFOLD clients cost < 20% more peak memory
than 1,000. The store is the only part of the run that grows with the number of clients, so
this measures it alone: for each N, a fresh process opens a store of N clients with one
model-sized fp32 state per client (SCAFFOLD's control variate; by default the size of the
MLP 40-256-256-10 of the Flower comparison, 78,858 floats), then plays R rounds of the
engine's protocol: sample K clients (seeded), ``get`` each row, change it, ``put`` it into the
round's journal, ``close``, ``commit``. It reports the process's peak RSS (``ru_maxrss``), its
RSS before the store was opened (torch imported and warmed up), the store's disk use (rows
written) and apparent size (sparse file), and the ratio of the peaks of the largest and the
smallest N. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import psutil
import torch


def _model_numel(hidden: int) -> int:
    from lowcomm.models import count_parameters, create

    return count_parameters(create("mlp", input_dim=40, num_classes=10, hidden=hidden))


def child(clients: int, numel: int, per_round: int, rounds: int, root: str, seed: int) -> dict[str, Any]:
    """One measurement in this (fresh) process: the protocol of R rounds on a new store."""
    from lowcomm.fl.store import ClientStateStore

    torch.zeros(numel).add_(1.0)  # warm-up: allocator and kernels, before the baseline
    baseline = psutil.Process().memory_info().rss
    store = ClientStateStore(root, num_clients=clients, spec={"c": numel})
    times = []
    for r in range(rounds):
        start = time.perf_counter()
        sampled = np.sort(np.random.default_rng([seed, r]).choice(clients, per_round, replace=False))
        with store.writer(r, 0) as w:
            for cid in sampled.tolist():
                state = store.get(cid)
                state["c"].add_(1.0)  # stands in for the client's new control variate
                w.put(cid, state)
        store.commit(r)
        times.append(time.perf_counter() - start)
    states = os.path.join(root, "states.bin")
    result = {
        "clients": clients,
        "visited": store.visited(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_rss_bytes": baseline,
        "final_rss_bytes": psutil.Process().memory_info().rss,
        "disk_bytes": os.stat(states).st_blocks * 512,
        "apparent_bytes": os.path.getsize(states),
        "round_s_median": statistics.median(times),
    }
    store.close()
    return result


def main(argv: list[str] | None = None) -> None:
    """Run one child process per N and print the JSON summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1000,10000", help="registered clients, comma-separated")
    p.add_argument("--per-round", type=int, default=100, help="clients sampled per round (K)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256, help="MLP 40-H-H-10 sets the state size")
    p.add_argument("--numel", type=int, default=None, help="state floats per client (overrides --hidden)")
    p.add_argument("--dir", default=None, help="parent folder of the stores (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    numel = args.numel if args.numel is not None else _model_numel(args.hidden)
    if args.child is not None:
        print(json.dumps(child(args.child, numel, args.per_round, args.rounds, args.root, args.seed)))
        return
    counts = [int(c) for c in args.clients.split(",")]
    if any(c < args.per_round for c in counts):
        p.error(f"every --clients value must be >= --per-round ({args.per_round})")
    parent = tempfile.mkdtemp(prefix="fl-store-", dir=args.dir)
    runs = []
    try:
        for n in counts:
            root = os.path.join(parent, f"store-{n}")
            cmd = [sys.executable, __file__, "--child", str(n), "--root", root, "--numel", str(numel),
                   "--per-round", str(args.per_round), "--rounds", str(args.rounds), "--seed", str(args.seed)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    peaks = {r["clients"]: r["peak_rss_bytes"] for r in runs}
    summary = {
        "benchmark": "fl_store_memory",
        "machine": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "state_numel": numel,
        "state_bytes_per_client": 4 * numel,
        "per_round": args.per_round,
        "rounds": args.rounds,
        "runs": runs,
        "peak_ratio_largest_vs_smallest": peaks[max(peaks)] / peaks[min(peaks)],
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

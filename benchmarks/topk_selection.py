"""Fast top-k selection (sampled threshold + candidates, no full sort) vs ``torch.topk``.

Usage: python benchmarks/topk_selection.py [--sizes 11000000,25000000]
       [--densities 0.001,0.01] [--reps 5] [--threads N] [--json out.json]

For each (size, density): median and minimum wall time (runs of the two interleaved) of
``torch.topk(|x|, k)`` and of :func:`lowcomm.compress.topk.fast_topk_indices`, the speedups,
and the recall of the true top-k set (recall of the last run). The minimum is the robust
figure on a shared, loaded machine; the median is reported alongside. Gradient-like data: Gaussian with a heavy-tailed minority (Student-t, 3 dof).
Prints one JSON document; results go into docs/compression.md with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from lowcomm.compress.topk import fast_topk_indices, num_selected


def _time(fn, reps: int) -> tuple[list[float], torch.Tensor]:  # type: ignore[no-untyped-def]
    out = fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def bench(n: int, density: float, reps: int, seed: int = 0) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    heavy = torch.distributions.StudentT(3.0).sample((n // 10,))
    x[: n // 10] = heavy
    x = x[torch.randperm(n, generator=g)]
    k = num_selected(n, density)
    sampler = torch.Generator().manual_seed(seed + 1)
    t_ref: list[float] = []
    t_fast: list[float] = []
    for _ in range(reps):  # interleaved, so background load hits both alike
        times, ref = _time(lambda: torch.topk(x.abs(), k, sorted=False).indices, 1)
        t_ref += times
        times, fast = _time(lambda: fast_topk_indices(x, k, generator=sampler), 1)
        t_fast += times
    truth = torch.zeros(n, dtype=torch.bool)
    truth[ref] = True
    recall = float(truth[fast].sum()) / k
    return {
        "numel": n,
        "density": density,
        "k": k,
        "torch_topk_s": statistics.median(t_ref),
        "fast_select_s": statistics.median(t_fast),
        "speedup": statistics.median(t_ref) / statistics.median(t_fast),
        "torch_topk_min_s": min(t_ref),
        "fast_select_min_s": min(t_fast),
        "speedup_of_min": min(t_ref) / min(t_fast),
        "recall": recall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="11000000,25000000")
    ap.add_argument("--densities", default="0.001,0.01")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [
        bench(int(n), float(d), args.reps)
        for n in args.sizes.split(",")
        for d in args.densities.split(",")
    ]
    doc = {
        "benchmark": "topk_selection",
        "machine": {
            "load_avg_1m": os.getloadavg()[0],
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": rows,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

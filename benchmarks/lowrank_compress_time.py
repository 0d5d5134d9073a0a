"""Compression + decompression time per step on ResNet-18 gradients: ACP-SGD vs Power-SGD
vs PyTorch's ``powerSGD_hook`` at the same rank (issue 3, benchmark b).

Usage: python benchmarks/lowrank_compress_time.py [--rank 4] [--steps 12] [--rounds 3]
       [--threads 2] [--model resnet18] [--json out.json]

Runs DDP on a 1-rank gloo group, so every all-reduce is a no-op and the wall time of the
hook call plus its future is the method's encode/decode work (the same measurement for all
three, including PyTorch's hook whose phases cannot be separated otherwise). Methods are
run in interleaved rounds; the minimum and median over steps and rounds are reported.
Also reports the all-reduce calls per step of each method on this model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from lowcomm import models
from lowcomm.comm import accounting
from lowcomm.comm.hooks import HOOKS, run_hook
from lowcomm.hooks import options_for
from lowcomm.runtime.launch import free_port


def measure(kind: str, model_name: str, rank: int, steps: int, warm: int = 3) -> dict[str, Any]:
    torch.manual_seed(0)
    model = models.create(model_name)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    start = 2  # compressed from step 2 (DDP rebuilds its buckets after step 0)
    if kind == "torch_powersgd":
        state: Any = torch_powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
        )
        base: Any = torch_powersgd.powerSGD_hook
    else:
        state = HOOKS[kind](ddp, options_for(kind, rank=rank, start_iter=start))
        base = run_hook
    spent = [0.0]

    def hook(st, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks annotations
        t0 = time.perf_counter()
        fut = base(st, bucket)
        fut.wait()
        spent[0] += time.perf_counter() - t0
        return fut

    ddp.register_comm_hook(state, hook)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    times = []
    calls = 0
    for s in range(steps):
        spent[0] = 0.0
        before = accounting.ledger().by_collective["all_reduce"].calls
        ddp.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        if s >= max(warm, start):
            times.append(spent[0])
            calls = accounting.ledger().by_collective["all_reduce"].calls - before
    return {"times": times, "allreduce_calls_per_step": calls if kind != "torch_powersgd" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    kinds = ["acpsgd", "powersgd", "torch_powersgd"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    calls: dict[str, Any] = {}
    for _ in range(args.rounds):
        for k in kinds:
            res = measure(k, args.model, args.rank, args.steps)
            times[k] += res["times"]
            calls[k] = res["allreduce_calls_per_step"]
    dist.destroy_process_group()
    runs = {
        k: {
            "min_s": min(v),
            "median_s": statistics.median(v),
            "allreduce_calls_per_step": calls[k],
        }
        for k, v in times.items()
    }
    doc = {
        "benchmark": "lowrank_compress_time",
        "model": args.model,
        "rank": args.rank,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "runs": runs,
        "acpsgd_over_powersgd_median": runs["acpsgd"]["median_s"] / runs["powersgd"]["median_s"],
        "acpsgd_over_torch_powersgd_median": runs["acpsgd"]["median_s"] / runs["torch_powersgd"]["median_s"],
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

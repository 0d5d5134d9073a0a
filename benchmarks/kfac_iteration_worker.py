"""One rank of the K-FAC iteration-time benchmark (started by ``benchmarks/kfac_iteration.py``).

Why a separate script: every implementation runs the *same* loop on the same model, data and
optimizer, and only the preconditioner differs, so the timings compare preconditioners and
nothing else. The loop is the one both libraries document::

    opt.zero_grad(); loss(model(x), y).backward(); preconditioner.step(); opt.step()

with the model wrapped in ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA: the gradient
all-reduce is DDP's in every row). The input is **synthetic** (random CIFAR-shaped tensors,
labels drawn at random): this measures time, never accuracy.

``--impl``: ``sgd`` (no preconditioner: the baseline the overhead is measured against),
``lowcomm`` (:class:`lowcomm.optim.KFAC`) or ``kfac-pytorch`` (``kfac.preconditioner.
KFACPreconditioner``; importable only in the benchmark's own environment, see
``benchmarks/kfac_env.sh``). Rank 0 writes a JSON with the per-step times of the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("sgd", "lowcomm", "kfac-pytorch"), required=True)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=35)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--factor-update-steps", type=int, default=5)
    ap.add_argument("--inv-update-steps", type=int, default=50)
    ap.add_argument("--damping", type=float, default=1e-3)
    ap.add_argument("--pipeline", type=int, default=1, help="lowcomm only: SPD-KFAC pipelining")
    ap.add_argument("--defer", type=int, default=1,
                    help="lowcomm only: defer_factor_comm (0: a factor step waits for its own all-reduce)")
    ap.add_argument("--symmetric", type=int, default=0,
                    help="send only the upper triangle (lowcomm symmetric_comm, kfac-pytorch symmetry_aware)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: NCCL on CUDA, gloo on CPU; gloo lets ranks share one GPU")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def _preconditioner(a: argparse.Namespace, model: nn.Module) -> Any:
    """The preconditioner under test, with the settings both libraries share."""
    common: dict[str, Any] = {"factor_update_steps": a.factor_update_steps,
                              "inv_update_steps": a.inv_update_steps, "damping": a.damping,
                              "factor_decay": 0.95, "kl_clip": 1e-3, "lr": 0.1}
    if a.impl == "lowcomm":
        from lowcomm.optim import KFAC

        return KFAC(model, **common, compute="eigen", grad_worker_fraction=1.0,
                    pipeline=bool(a.pipeline), symmetric_comm=bool(a.symmetric),
                    defer_factor_comm=bool(a.defer))
    if a.impl == "kfac-pytorch":
        from kfac.preconditioner import KFACPreconditioner  # the benchmark env's, never ours

        return KFACPreconditioner(model, **common, compute_method="eigen",
                                  grad_worker_fraction=1.0, symmetry_aware=bool(a.symmetric))
    return None


def main() -> None:
    a = _args()
    torch.set_num_threads(a.threads)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(("nccl" if cuda else "gloo") if a.backend == "auto" else a.backend)
    rank = dist.get_rank()

    from lowcomm import models

    torch.manual_seed(0)  # identical initial weights on every rank (DDP also broadcasts them)
    net = models.create(a.model, num_classes=10).to(device)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    pre = _preconditioner(a, model)

    gen = torch.Generator().manual_seed(1000 + rank)  # synthetic data: timing only
    x = torch.randn(a.batch_size, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 10, (a.batch_size,), generator=gen).to(device)
    loss_fn = nn.CrossEntropyLoss()
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)

    phases: dict[str, list[float]] = {"forward_backward": [], "preconditioner": [], "optimizer": []}
    steps: list[float] = []
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            sync()
            dist.barrier()
            start = time.perf_counter()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        sync()
        t1 = time.perf_counter()
        if pre is not None:
            pre.step()
        sync()
        t2 = time.perf_counter()
        opt.step()
        sync()
        t3 = time.perf_counter()
        if i >= a.warmup:
            phases["forward_backward"].append(t1 - t0)
            phases["preconditioner"].append(t2 - t1)
            phases["optimizer"].append(t3 - t2)
            steps.append(t3 - t0)
    dist.barrier()
    total = time.perf_counter() - start
    # every rank's mean step time: the slowest rank sets the pace of a synchronous job
    mean = torch.tensor([total / a.steps], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mean) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mean)
    if rank == 0:
        Path(a.out).write_text(json.dumps({
            "impl": a.impl, "world_size": dist.get_world_size(), "device": str(device),
            "backend": dist.get_backend(), "threads": a.threads, "warmup": a.warmup,
            "steps": a.steps, "wall_s": total, "s_per_iter": total / a.steps,
            "s_per_iter_by_rank": [float(t.item()) for t in gathered],
            "phases_mean_s": {k: sum(v) / len(v) for k, v in phases.items()},
            "step_s": steps, "data": "synthetic (timing only)",
        }) + "\n")
    if pre is not None and hasattr(pre, "remove"):
        pre.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

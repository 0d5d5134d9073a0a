"""A 2-rank training run of a tiny MLP classifier decreases the loss with every method."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from compress_testlib import run_ranks
from lowcomm import methods
from lowcomm.methods.base import MethodContext

SPECS = [
    "ssgd",
    "fp16",
    "bf16",
    "signsgd:start_iter=5",
    "signum:start_iter=5",
    "topk:start_iter=5,density=0.05",
    "gtopk:start_iter=5,density=0.05",
    "powersgd:start_iter=5,rank=2",
    "acpsgd:start_iter=5,rank=2",
]


def train(spec: str, steps: int = 100) -> tuple[float, float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(20, 4, generator=g)
    x_all = torch.randn(steps * world * 32, 20, generator=g)
    y_all = (x_all @ teacher).argmax(1)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    method = methods.create(spec)
    ctx = MethodContext(rank=rank, world_size=world, bucket_cap_mb=0.01, seed=0)
    ddp = method.wrap(method.prepare(model), ctx)
    if spec.startswith("signum"):  # momentum lives in the hook (an EMA): no optimizer momentum
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(steps):
        lo = (s * world + rank) * 32
        x, y = x_all[lo : lo + 32], y_all[lo : lo + 32]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        method.finish_sync()
        method.optimizer_step(opt)
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


@pytest.mark.parametrize("spec", SPECS)
def test_two_rank_training_decreases_loss(spec: str) -> None:
    results: list[Any] = run_ranks(train, 2, spec)
    for first, last in results:
        assert last < 0.6 * first, (spec, first, last)

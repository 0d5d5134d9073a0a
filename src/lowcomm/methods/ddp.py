"""Baselines: ``ssgd`` (DDP all-reduce through the accounting layer) and ``nocomm``.

``ssgd`` registers a comm hook that does exactly what DDP's default reducer does (sum, then
divide by world size) but through :mod:`lowcomm.comm.accounting`, so its bytes are counted
the same way as every other method's. ``nocomm`` sends nothing: it exists to measure the
compute-only lower bound and is refused for real training runs by the CLI.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.methods import register
from lowcomm.methods.base import Method


def allreduce_mean_hook(group, bucket):  # type: ignore[no-untyped-def]
    """DDP's default: average the flat bucket with one all-reduce.

    (No annotations: DDP checks them at run time and string annotations fail its check.)
    """
    buf = bucket.buffer()
    world = dist.get_world_size(group)
    buf.div_(world)
    work = accounting.all_reduce(buf, group=group, async_op=True, tag="ssgd")
    return work.get_future().then(lambda fut: fut.value()[0])


def noop_hook(_, bucket):  # type: ignore[no-untyped-def]
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@register
class SSGD(Method):
    """Synchronous SGD: DDP with bucketed all-reduce overlapped with backward."""

    name = "ssgd"

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(self.ctx.process_group if self.ctx else None, allreduce_mean_hook)


@register
class NoComm(Method):
    """No gradient communication at all (timing only: the compute lower bound)."""

    name = "nocomm"
    timing_only = True

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(None, noop_hook)

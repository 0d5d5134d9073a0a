"""Baselines: ``ssgd`` (DDP all-reduce through the accounting layer) and ``nocomm``.

``ssgd`` registers the comm hook of :mod:`lowcomm.comm.hooks` without a codec: exactly what
DDP's default reducer does (sum, then the mean) but through :mod:`lowcomm.comm.accounting`,
so its bytes are counted the same way as every other method's. It is the same hook that
``lowcomm.hooks.register(ddp, "ssgd")`` attaches: one implementation. ``nocomm`` sends
nothing: it exists to measure the compute-only lower bound and is refused for real training
runs by the CLI.
"""

from __future__ import annotations

import torch
from torch import nn

from lowcomm.comm.hooks import SSGD as SSGD_NAME
from lowcomm.methods import register
from lowcomm.methods.base import Method
from lowcomm.methods.compression import HookMethod


def noop_hook(_, bucket):  # type: ignore[no-untyped-def]
    """Leave the local gradient as it is (no annotations: DDP checks them at run time)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@register
class SSGD(HookMethod):
    """Synchronous SGD: DDP with bucketed all-reduce overlapped with backward."""

    name = SSGD_NAME


@register
class NoComm(Method):
    """No gradient communication at all (timing only: the compute lower bound)."""

    name = "nocomm"
    timing_only = True

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Register the hook that sends nothing."""
        ddp.register_comm_hook(None, noop_hook)

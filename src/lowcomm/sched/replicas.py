"""Keeping the engine's model replicas alike where no gradient does: rank 0's parameters and
buffers at the start, rank 0's buffers (BatchNorm statistics) before each training forward.

Why apart from :mod:`lowcomm.sched.engine`: these are DDP's two broadcasts, the same for every
schedule and independent of how gradients travel; the engine only says when.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting


def broadcast_initial(
    model: nn.Module, src: int, group: dist.ProcessGroup | None, tag: str
) -> None:
    """Every parameter and buffer of ``model`` from global rank ``src`` (counted under ``<tag>.init``)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            accounting.broadcast(t.data, src, group=group, tag=f"{tag}.init")


def broadcast_buffers(
    model: nn.Module, src: int, group: dist.ProcessGroup | None, tag: str
) -> None:
    """``model``'s non-empty buffers from global rank ``src`` in one flat message (``<tag>.buffers``)."""
    bufs = [b for b in model.buffers() if b.numel()]
    if not bufs:
        return
    flat = torch._utils._flatten_dense_tensors([b.data for b in bufs])
    accounting.broadcast(flat, src, group=group, tag=f"{tag}.buffers")
    for b, v in zip(bufs, torch._utils._unflatten_dense_tensors(flat, bufs)):
        b.data.copy_(v)

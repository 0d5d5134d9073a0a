"""Reference rows for ``lowcomm bench``: PyTorch's own DDP comm hooks, unchanged.

``torch_powersgd`` (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) and
``torch_fp16`` (``default_hooks.fp16_compress_hook``) show how our implementations compare
with the ones users already have. Their bytes must be counted like ours, but the hooks call
``torch.distributed.all_reduce`` themselves; so, in the worker process only, the two hook
modules' ``dist`` name is pointed at :class:`CountingDist`, which forwards every attribute
to ``torch.distributed`` and routes ``all_reduce`` through :mod:`lowcomm.comm.accounting`.
The hooks' code is not modified. They report no separate compression time: their encode
and decode work is inside ``backward`` / ``comm_wait`` of the breakdown. On gloo,
``torch_powersgd`` runs with one DDP bucket (see :meth:`TorchPowerSGD.wrap`).
"""

from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext


class CountingDist:
    """``torch.distributed`` with ``all_reduce`` counted under ``tag``."""

    def __init__(self, tag: str) -> None:
        self._tag = tag

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return accounting.all_reduce(tensor, op=op, group=group, async_op=async_op, tag=self._tag)


def _count_in(module: Any, tag: str) -> None:
    if not isinstance(module.dist, CountingDist):
        module.dist = CountingDist(tag)


@dataclass
class TorchPowerSGDOptions:
    rank: int = 4
    start_iter: int = 10
    error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise UsageError(f"torch_powersgd: rank must be >= 1, got {self.rank}")
        if self.start_iter < 0:
            raise UsageError(f"torch_powersgd: start_iter must be >= 0, got {self.start_iter}")
        if not (math.isfinite(self.min_compression_rate) and self.min_compression_rate > 0):
            raise UsageError(
                "torch_powersgd: min_compression_rate must be a finite number > 0, "
                f"got {self.min_compression_rate}"
            )
        # PyTorch refuses start_powerSGD_iter < 2 with error feedback or warm start.
        if self.error_feedback or self.warm_start:
            self.start_iter = max(2, self.start_iter)


@register
class TorchPowerSGD(Method):
    """PyTorch's ``powerSGD_hook`` (reference implementation), bytes counted by lowcomm."""

    name = "torch_powersgd"
    Options = TorchPowerSGDOptions

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """On gloo, use a single DDP bucket.

        The hook issues its P and Q all-reduces from future callbacks; with several buckets in
        flight the callbacks of different buckets run in a different order on different ranks,
        gloo pairs mismatched collectives and aborts ("Received data size doesn't match").
        One bucket keeps a single chain of collectives, identical on every rank.
        """
        if accounting.device_backend(ctx.process_group, ctx.device) == "gloo":
            ctx = dataclasses.replace(ctx, bucket_cap_mb=max(ctx.bucket_cap_mb, 1e5))
        return super().wrap(model, ctx)

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        _count_in(ps, "torch_powersgd")
        o = self.options
        state = ps.PowerSGDState(
            process_group=self.ctx.process_group if self.ctx else None,
            matrix_approximation_rank=o.rank,
            start_powerSGD_iter=o.start_iter,
            min_compression_rate=o.min_compression_rate,
            use_error_feedback=o.error_feedback,
            warm_start=o.warm_start,
            random_seed=self.ctx.seed if self.ctx else 0,
        )
        ddp.register_comm_hook(state, ps.powerSGD_hook)


@register
class TorchFP16(Method):
    """PyTorch's ``fp16_compress_hook`` (reference implementation), bytes counted by lowcomm."""

    name = "torch_fp16"

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        _count_in(default_hooks, "torch_fp16")
        ddp.register_comm_hook(self.ctx.process_group if self.ctx else None, default_hooks.fp16_compress_hook)

"""Timing references: PyTorch's own implementations, unchanged, with their bytes counted.

``torch_powersgd`` (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``) and
``torch_fp16`` (``default_hooks.fp16_compress_hook``) show how our implementations compare
with the DDP comm hooks users already have; ``torch_fsdp`` (FSDP2 ``fully_shard`` in
shard-grad-op mode) is the closest existing engine to DeAR and Lee et al. 2018.

Bytes must be counted like ours, but these call ``torch.distributed`` themselves; so, in the
worker process only, the ``dist`` name of the hook modules (and of FSDP's collectives module)
is pointed at a proxy that forwards every attribute to ``torch.distributed`` and routes the
collectives through :mod:`lowcomm.comm.accounting`. Their code is not modified. The part of a
hook that runs before it returns its future (``fp16``'s cast, PowerSGD's error feedback and P
factors) is reported as ``compress``, device work as lowcomm's own hooks report theirs, so
emulated compute makes the next layers wait for it as a GPU's stream would (unreported, it
hid inside the emulated backward's waits); what runs in the future's callbacks (the decode,
PowerSGD's Q factors) stays inside ``comm_wait``. On gloo, ``torch_powersgd`` runs with one DDP bucket (see
:meth:`TorchPowerSGD.wrap`).

``torch_fsdp``: gradients are reduce-scattered during backward and parameters all-gathered
before forward. ``reshard_after_forward=False`` keeps parameters gathered between forward and
backward (ZeRO-2 style), so each step costs one all-gather and one reduce-scatter per block,
like ``dear``/``lee18``. gloo's native reduce-scatter runs a full all-reduce underneath
(measured on the emulated cluster: 2(P-1)/P·n bytes sent), so on gloo it is counted with the
all-reduce formula; elsewhere with the reduce-scatter one. Sharding unit: every child of a
top-level container (e.g. each ResNet block), every other top-level child with parameters,
then the root. Timing only: checkpoints of sharded (DTensor) state are not supported by the
trainer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods import register
from lowcomm.methods.base import DDP_BUCKET_MB, Method, MethodContext
from lowcomm.runtime import timing


class CountingDist:
    """``torch.distributed`` with ``all_reduce`` counted under ``tag``: what the reference hooks
    see as their ``dist`` module, so their traffic lands in the same ledger as ours."""

    def __init__(self, tag: str) -> None:
        self._tag = tag

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(
        self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """:func:`lowcomm.comm.accounting.all_reduce` under this proxy's tag."""
        return accounting.all_reduce(tensor, op=op, group=group, async_op=async_op, tag=self._tag)


class _CountingFSDPDist(CountingDist):
    """``torch.distributed`` with FSDP's flat collectives counted by lowcomm."""

    def __init__(self) -> None:
        super().__init__("torch_fsdp.ar")

    def all_gather_single(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        """FSDP's parameter all-gather, counted with the all-gather formula."""
        nbytes = input_tensor.numel() * input_tensor.element_size()
        world = dist.get_world_size(group)
        accounting.device_backend(group, input_tensor.device, what="torch_fsdp all-gather")
        accounting.ledger().record("all_gather", "torch_fsdp.ag", nbytes, accounting.wire_bytes("all_gather", nbytes, world))
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Any:
        """FSDP's gradient reduce-scatter, native; on gloo counted as the all-reduce it is."""
        nbytes = input.numel() * input.element_size()
        world = dist.get_world_size(group)
        backend = accounting.device_backend(group, input.device, what="torch_fsdp reduce-scatter")
        kind = "all_reduce" if backend == "gloo" else "reduce_scatter"
        accounting.ledger().record("reduce_scatter", "torch_fsdp.rs", nbytes, accounting.wire_bytes(kind, nbytes, world))
        return dist.reduce_scatter_single(output=output, input=input, group=group, op=op, async_op=async_op)


def _timed(hook: Any) -> Any:
    """``hook`` with the time until it returns its future reported as ``compress`` (device work)."""

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        fut = hook(state, bucket)
        timing.add("compress", time.perf_counter() - start)
        return fut

    return as_comm_hook(timed)


def as_comm_hook(fn: Any) -> Any:
    """``fn`` with the annotations DDP's ``register_comm_hook`` checks, as objects: a hook
    defined under postponed evaluation (``from __future__ import annotations``) has strings."""
    fn.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                          "return": torch.futures.Future[torch.Tensor]}
    return fn


def _count_in(module: ModuleType, proxy: CountingDist) -> None:
    """Point ``module``'s ``dist`` name at ``proxy`` (once: a second call keeps the first)."""
    if not isinstance(module.__dict__["dist"], type(proxy)):
        module.__dict__["dist"] = proxy


@dataclass
class TorchPowerSGDOptions:
    """``torch_powersgd``'s options: those of PyTorch's ``PowerSGDState`` that we compare on."""

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
            ctx = dataclasses.replace(ctx, bucket_cap_mb=max(ctx.bucket_cap_mb or DDP_BUCKET_MB, 1e5))
        return super().wrap(model, ctx)

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Attach PyTorch's hook with our options; its all-reduces are counted."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        _count_in(ps, CountingDist("torch_powersgd"))
        # its plain all-reduces before start_iter go through default_hooks' own ``dist``
        _count_in(default_hooks, CountingDist("torch_powersgd.warmup"))
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
        ddp.register_comm_hook(state, _timed(ps.powerSGD_hook))


@register
class TorchFP16(Method):
    """PyTorch's ``fp16_compress_hook`` (reference implementation), bytes counted by lowcomm."""

    name = "torch_fp16"

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Attach PyTorch's hook; its all-reduce is counted."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        _count_in(default_hooks, CountingDist("torch_fp16"))
        ddp.register_comm_hook(self.ctx.process_group if self.ctx else None,
                               _timed(default_hooks.fp16_compress_hook))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """Modules to wrap with ``fully_shard``, innermost first (root excluded): one unit per
    block, so FSDP gathers and reduces per block as DeAR does per fused group."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            units.extend(c for c in child.children() if any(True for _ in c.parameters()))
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


@register
class TorchFSDP(Method):
    """PyTorch FSDP2 ``fully_shard(reshard_after_forward=False)``; timing reference only."""

    name = "torch_fsdp"
    timing_only = True
    # FSDP2 gathers a block's parameters in the block's forward hook; the emulated model calls its
    # parameterized layers one after the other, never the blocks, so the layers would see sharded
    # parameters and the optimizer unreduced gradients
    emulated_compute_refusal = "FSDP gathers each block's parameters in the block's forward, which emulated layers skip"

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """Shard every unit of :func:`shard_units`, then the root; FSDP's collectives counted."""
        self.ctx = ctx
        if not dist.is_initialized():
            raise UsageError("torch_fsdp needs a process group (run with --nproc >= 2)")
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        _count_in(_fsdp_collectives, _CountingFSDPDist())
        for unit in shard_units(model):
            fully_shard(unit, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        self.ddp = model
        return model

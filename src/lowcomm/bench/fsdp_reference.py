"""Reference row ``torch_fsdp``: PyTorch FSDP2 (``fully_shard``) in shard-grad-op mode.

The closest existing engine to DeAR and Lee et al. 2018: gradients are reduce-scattered
during backward and parameters all-gathered before forward. ``reshard_after_forward=False``
keeps parameters gathered between forward and backward (ZeRO-2 style), so each step costs
one all-gather and one reduce-scatter per block, like ``dear``/``lee18``.

Bytes: FSDP calls ``torch.distributed`` itself, so in the worker process only the name
``dist`` of FSDP's collectives module is pointed at a counting proxy; FSDP's code is not
modified. gloo's native reduce-scatter runs a full all-reduce underneath (measured on the
emulated cluster: 2(P-1)/P·n bytes sent), so on gloo it is counted with the all-reduce
formula; elsewhere with the reduce-scatter one. Sharding unit: every child of a top-level
container (e.g. each ResNet block), every other top-level child with parameters, then the
root. Timing only: checkpoints of sharded (DTensor) state are not supported by the trainer.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext


class _CountingFSDPDist:
    """``torch.distributed`` with FSDP's flat collectives counted by lowcomm."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_gather_single(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        nbytes = input_tensor.numel() * input_tensor.element_size()
        world = dist.get_world_size(group)
        accounting.device_backend(group, input_tensor.device, what="torch_fsdp all-gather")
        accounting.ledger().record("all_gather", "torch_fsdp.ag", nbytes, accounting.wire_bytes("all_gather", nbytes, world))
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    @staticmethod
    def reduce_scatter_single(output: Any, input: Any, group: Any = None, op: Any = dist.ReduceOp.SUM,
                              async_op: bool = False) -> Any:
        nbytes = input.numel() * input.element_size()
        world = dist.get_world_size(group)
        backend = accounting.device_backend(group, input.device, what="torch_fsdp reduce-scatter")
        kind = "all_reduce" if backend == "gloo" else "reduce_scatter"
        accounting.ledger().record("reduce_scatter", "torch_fsdp.rs", nbytes, accounting.wire_bytes(kind, nbytes, world))
        return dist.reduce_scatter_single(output=output, input=input, group=group, op=op, async_op=async_op)

    @staticmethod
    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return accounting.all_reduce(tensor, op=op, group=group, async_op=async_op, tag="torch_fsdp.ar")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """Modules to wrap with ``fully_shard``, innermost first (root excluded)."""
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

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        self.ctx = ctx
        if not dist.is_initialized():
            raise UsageError("torch_fsdp needs a process group (run with --nproc >= 2)")
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        if not isinstance(_fsdp_collectives.dist, _CountingFSDPDist):
            _fsdp_collectives.dist = _CountingFSDPDist()  # type: ignore[assignment]
        for unit in shard_units(model):
            fully_shard(unit, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        self.ddp = model
        return model

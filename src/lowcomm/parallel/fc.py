"""Model-parallel fully-connected layers (Lee et al. 2018's treatment of VGG's FC head).

Why: a data-parallel Linear sends its whole gradient every step (an all-reduce of
``out x in`` numbers, ~124 M for VGG-16's head), while the activations it sees are only
``batch x (in + out)`` numbers. :class:`ModelParallelLinear` keeps the layer's output neurons
split over the ranks: rank ``r`` holds rows ``r*o .. (r+1)*o`` of ``W`` and ``b``
(``o = out / P``) and is the only one that updates them, so no gradient of those weights is
ever exchanged, and the full weight never exists on any rank during training.

One step, per layer, with ``n`` rows per rank (:class:`_ModelParallelLinearFn`):

* forward: all-gather the ``n x in`` inputs of every rank (``P*n x in``), compute this rank's
  ``o`` output neurons for the global batch, then an all-to-all hands every rank its own
  samples' full ``n x out`` output, so the layer is a drop-in replacement (dropout, ReLU,
  the loss run per rank as in data-parallel training);
* backward: the mirror all-to-all gives this rank the errors of its ``o`` neurons for the
  global batch; the weight gradient ``G^T X / P`` is exactly DDP's averaged gradient for those
  rows; the input gradient ``G W_r`` is a partial sum over ranks, reduce-scattered so every
  rank gets its samples' rows (skipped when the input needs no gradient).

Bytes per worker and layer (ring model of :func:`lowcomm.comm.accounting.wire_bytes`) are
:func:`model_parallel_bytes`; the data-parallel alternative is :func:`data_parallel_bytes`,
and :func:`choose_model_parallel` is the α-β rule of ``lee18:fc=auto``.

Checkpoints and evaluation: :meth:`ModelParallelLinear.consolidate` (collective, every rank;
``lee18``'s ``flush`` calls it) all-gathers the partitions once into a cached full weight;
``state_dict()`` then gives ordinary ``weight``/``bias`` entries (the same keys and shapes as
the ``nn.Linear`` it replaced) and an eval-mode forward computes locally from the cache, with
no collective, so ranks may evaluate different numbers of samples. A stale cache (weights
stepped since) is refused instead of silently used. ``load_state_dict`` takes the full
weights and keeps this rank's rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.sched.cost import AlphaBeta

__all__ = [
    "ModelParallelLinear",
    "choose_model_parallel",
    "data_parallel_bytes",
    "model_parallel_bytes",
    "is_model_parallel_param",
]

#: attribute set on the partition parameters: the data-parallel engine skips them
LOCAL_ATTR = "lowcomm_model_parallel"


def is_model_parallel_param(p: torch.Tensor) -> bool:
    """True for a parameter each rank holds a different partition of (never averaged)."""
    return bool(getattr(p, LOCAL_ATTR, False))


def model_parallel_bytes(
    in_features: int,
    out_features: int,
    rows: int,
    world: int,
    *,
    element_size: int = 4,
    input_grad: bool = True,
) -> int:
    """Bytes one worker sends per step for one model-parallel Linear with ``rows`` input rows
    per worker: forward all-gather + all-to-all, backward all-to-all (+ reduce-scatter of the
    input gradient when ``input_grad``). Exactly what the layer's collectives count."""
    wb = accounting.wire_bytes
    act_in = rows * in_features * element_size
    act_out = rows * out_features * element_size
    total = wb("all_gather", act_in, world) + 2 * wb("all_to_all", act_out, world)
    if input_grad:
        total += wb("reduce_scatter", world * act_in, world)
    return total


def data_parallel_bytes(
    in_features: int, out_features: int, world: int, *, bias: bool = True, element_size: int = 4
) -> int:
    """Bytes one worker sends per step to average one Linear's gradient and share the update
    (an all-reduce's worth: lee18's reduce-scatter plus all-gather, DDP's all-reduce)."""
    numel = out_features * in_features + (out_features if bias else 0)
    return accounting.wire_bytes("all_reduce", numel * element_size, world)


def choose_model_parallel(
    in_features: int,
    out_features: int,
    rows: int,
    world: int,
    cost: AlphaBeta,
    *,
    bias: bool = True,
    element_size: int = 4,
    input_grad: bool = True,
) -> bool:
    """``lee18:fc=auto``'s rule: model-parallel when moving the activations and errors (3-4
    collectives) costs less under ``cost`` than averaging the weights (2 collectives), and the
    output neurons split evenly over the ranks."""
    if world <= 1 or out_features % world:
        return False
    mp = (4 if input_grad else 3) * cost.alpha + cost.beta * model_parallel_bytes(
        in_features, out_features, rows, world, element_size=element_size, input_grad=input_grad
    )
    dp = 2 * cost.alpha + cost.beta * data_parallel_bytes(
        in_features, out_features, world, bias=bias, element_size=element_size
    )
    return mp < dp


class _Comm:
    """Where a model-parallel layer's collectives go: group, world size and counting tag."""

    __slots__ = ("group", "world", "tag")

    def __init__(self, group: dist.ProcessGroup | None, world: int, tag: str) -> None:
        self.group, self.world, self.tag = group, world, tag


class _ModelParallelLinearFn(torch.autograd.Function):
    """``y = x W^T + b`` with ``W``'s rows split over the ranks (see module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: _Comm
    ) -> torch.Tensor:
        p, n = comm.world, x.shape[0]
        gathered = x.new_empty((p * n, x.shape[1]))
        accounting.all_gather_into_tensor(
            gathered, x.contiguous(), group=comm.group, tag=f"{comm.tag}.fwd"
        )
        mine = F.linear(gathered, weight, bias)  # (P*n, o): my neurons, every rank's samples
        received = torch.empty_like(mine)
        accounting.all_to_all_single(received, mine, group=comm.group, tag=f"{comm.tag}.fwd")
        ctx.save_for_backward(gathered, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        # received[r] = rank r's neurons for my samples -> (n, P*o) in neuron order
        return received.view(p, n, -1).permute(1, 0, 2).reshape(n, -1)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gathered, weight = ctx.saved_tensors
        comm: _Comm = ctx.comm
        p, o = comm.world, weight.shape[0]
        n = grad_out.shape[0]
        send = grad_out.reshape(n, p, o).permute(1, 0, 2).contiguous()  # block r: rank r's neurons
        errors = torch.empty_like(send)
        accounting.all_to_all_single(errors, send, group=comm.group, tag=f"{comm.tag}.bwd")
        errors = errors.view(p * n, o)  # my neurons' errors for every rank's samples
        # under autocast the forward ran in the errors' dtype: so does the backward (autograd
        # casts each gradient to its input's dtype), as for autocast's own linear
        weight, gathered = weight.to(errors.dtype), gathered.to(errors.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            partial = errors @ weight  # this rank's share of every sample's input gradient
            grad_x = partial.new_empty((n, weight.shape[1]))
            accounting.reduce_scatter_tensor(
                grad_x, partial, group=comm.group, tag=f"{comm.tag}.bwd"
            )
        # the global batch's gradient of my rows, averaged over ranks as DDP does
        grad_w = (errors.t() @ gathered).div_(p)
        grad_b = errors.sum(0).div_(p) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class ModelParallelLinear(nn.Module):
    """An ``nn.Linear`` whose output neurons are split over the ranks (module docstring).

    Built from a full ``nn.Linear`` that is identical on every rank (after the initial
    broadcast); keeps rows ``rank*o .. (rank+1)*o``. Parameters are named ``weight`` and
    ``bias`` like the Linear's, but hold only this rank's partition, and carry
    :data:`LOCAL_ATTR` so data-parallel machinery leaves them alone.
    """

    def __init__(
        self,
        linear: nn.Linear,
        *,
        group: dist.ProcessGroup | None,
        world: int,
        rank: int,
        tag: str = "fc",
    ) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        if world < 2 or out_f % world:
            raise UsageError(
                f"a model-parallel Linear needs out_features divisible by the world size, got "
                f"{out_f} over {world} ranks (valid: a world of 2+ that divides {out_f})"
            )
        self.in_features, self.out_features = in_f, out_f
        self.world, self.rank, self.rows = world, rank, out_f // world
        self._comm = _Comm(group, world, tag)
        sl = slice(rank * self.rows, (rank + 1) * self.rows)
        self.weight = nn.Parameter(linear.weight.detach()[sl].clone())
        self.bias = (
            nn.Parameter(linear.bias.detach()[sl].clone()) if linear.bias is not None else None
        )
        for q in self._local():
            setattr(q, LOCAL_ATTR, True)
        # the consolidated full weight, only between a flush and the next step (memory: the
        # full weight is what this layer exists not to hold)
        self._full: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._stamp = self._versions()

    def _local(self) -> list[nn.Parameter]:
        return [q for q in (self.weight, self.bias) if q is not None]

    def _versions(self) -> tuple[int, ...]:
        return tuple(q._version for q in self._local())

    def extra_repr(self) -> str:
        """Shape and partition, for ``print(model)``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rows {self.rank * self.rows}..{(self.rank + 1) * self.rows} of rank {self.rank}/{self.world}"
        )

    # --- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training: the model-parallel exchange. Eval: the consolidated full weight, locally."""
        if not self.training:
            w, b = self.full_weights()
            return F.linear(x, w, b)
        if self._full is not None and self._stamp != self._versions():
            self._full = None  # stepped since the flush: free the stale copy
        lead = x.shape[:-1]
        y = _ModelParallelLinearFn.apply(
            x.reshape(-1, self.in_features), self.weight, self.bias, self._comm
        )
        return y.reshape(*lead, self.out_features)

    # --- consolidation ------------------------------------------------------------------
    def consolidate(self) -> None:
        """All-gather the partitions into the cached full weight (collective: every rank)."""
        if self._full is not None and self._stamp == self._versions():
            return
        full: list[torch.Tensor | None] = []
        for q in (self.weight, self.bias):
            if q is None:
                full.append(None)
                continue
            out = q.new_empty((self.out_features, *q.shape[1:]))
            accounting.all_gather_into_tensor(
                out,
                q.detach().contiguous(),
                group=self._comm.group,
                tag=f"{self._comm.tag}.consolidate",
            )
            full.append(out)
        assert full[0] is not None
        self._full = (full[0], full[1])
        self._stamp = self._versions()

    def full_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The consolidated ``(weight, bias)``; refused when the partitions changed since."""
        if self._full is None or self._stamp != self._versions():
            raise RuntimeError(
                "a model-parallel Linear holds only its partition of the weights: call the method's "
                "flush() on every rank (it consolidates them) before evaluation or state_dict()"
            )
        return self._full

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        w, b = self.full_weights()
        destination[prefix + "weight"] = w.clone()
        if b is not None:
            destination[prefix + "bias"] = b.clone()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        sl = slice(self.rank * self.rows, (self.rank + 1) * self.rows)
        full: list[torch.Tensor | None] = [None, None]
        for i, (name, q) in enumerate((("weight", self.weight), ("bias", self.bias))):
            if q is None:
                continue
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if value.shape[0] != self.out_features or value.shape[1:] != q.shape[1:]:
                error_msgs.append(
                    f"size mismatch for {key}: expected the full ({self.out_features}, "
                    f"{', '.join(map(str, q.shape[1:]))}) weight, got {tuple(value.shape)}"
                )
                continue
            with torch.no_grad():
                q.copy_(value[sl])
            full[i] = value.detach().to(q.device, q.dtype).clone()
        if full[0] is not None and (self.bias is None or full[1] is not None):
            self._full = (full[0], full[1])
            self._stamp = self._versions()

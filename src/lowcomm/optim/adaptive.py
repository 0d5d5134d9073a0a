"""What LARS and LAMB share: which parameters are adapted, the trust ratio as tensors, and
the bucketing of a parameter group for torch's multi-tensor (``torch._foreach_*``) kernels.

Why apart: the two optimizers differ only in the update they rescale (LARS: the decayed
gradient before momentum; LAMB: Adam's step plus decay); the rules around it -- who is
excluded, what a zero norm means, how a group is split so that every ``_foreach`` call sees
one device and dtype -- must be the same in both, and in both of their code paths (multi-
tensor and per-parameter loop), or the equivalence the tests check would be accidental.

Sync-free by construction: norms come from ``torch._foreach_norm`` (or
``torch.linalg.vector_norm`` in the loop) as 0-dim float32 device tensors, the ratio is a
``torch.where`` over them, and it is applied with a tensor multiply. Nothing calls
``.item()``, ``bool(tensor)`` or ``float(tensor)``, so on CUDA a step launches kernels
without waiting for the GPU, and it can be captured in a CUDA graph.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm.errors import UsageError

#: The param-group key that switches adaptation off for a whole group. Set by
#: :func:`lowcomm.optim.builders.param_groups` on its no-decay group (norms and biases);
#: LARS/LAMB also exclude every ``ndim <= 1`` tensor on their own (``exclude_1d=True``).
EXCLUDE_KEY = "exclude_from_adaptation"


def is_adapted(group: dict[str, Any], p: torch.Tensor, exclude_1d: bool) -> bool:
    """True when ``p`` gets a trust ratio and weight decay.

    Why norms and biases are excluded (You et al. 2017; Jia et al. 2018): a bias or a norm's
    scale has few elements and a norm of order one; a layer-wise ratio computed on it is noise,
    and decaying it pulls it towards zero for no reason. They take the plain step instead.
    """
    if group.get(EXCLUDE_KEY, False):
        return False
    return not (exclude_1d and p.ndim <= 1)


@dataclass
class Bucket:
    """The parameters of one group with a gradient, on one device and dtype, split into the
    adapted (trust ratio + decay) and the excluded ones; ``state`` lists run in parallel."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    adapted: list[bool] = field(default_factory=list)

    def split(self, values: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``values`` (parallel to :attr:`params`) as (adapted, excluded) lists."""
        yes = [v for v, a in zip(values, self.adapted) if a]
        no = [v for v, a in zip(values, self.adapted) if not a]
        return yes, no


#: On CPU, a bucket holds at most this many bytes of parameters (a larger tensor goes alone).
#: Why: a multi-tensor op allocates its output for every tensor of the bucket at once; over a
#: whole ResNet-50 (100 MB) the temporaries are fresh pages every step (page faults) and out
#: of cache, which made LAMB's multi-tensor step slower than the loop on CPU. On CUDA there is
#: no such cost and one launch per op over the whole group is the point, so no limit.
CPU_BUCKET_BYTES = 4 << 20


def dense_grads(group: dict[str, Any], name: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, gradient)`` for the group's parameters that have a gradient; a sparse
    gradient is refused (the trust ratio needs the whole tensor's norm)."""
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise UsageError(f"{name} does not support sparse gradients (use a dense embedding, or SGD)")
        yield p, p.grad


def buckets(group: dict[str, Any], exclude_1d: bool, name: str) -> list[Bucket]:
    """The group's parameters that have a gradient, bucketed by (device, dtype) -- one
    ``_foreach`` call per bucket takes the fast path (one kernel launch per op on CUDA) -- and
    on CPU into chunks of about :data:`CPU_BUCKET_BYTES`."""
    out: dict[tuple[torch.device, torch.dtype], list[Bucket]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for p, g in dense_grads(group, name):
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        chain = out.setdefault(key, [Bucket()])
        if p.device.type == "cpu" and chain[-1].params and sizes[key] + nbytes > CPU_BUCKET_BYTES:
            chain.append(Bucket())
            sizes[key] = 0
        b = chain[-1]
        sizes[key] = sizes.get(key, 0) + nbytes
        b.params.append(p)
        b.grads.append(g)
        b.adapted.append(is_adapted(group, p, exclude_1d))
    return [b for chain in out.values() for b in chain]


def norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norms (0-dim, float32, on the tensors' device) in one multi-tensor call. float32
    whatever the parameters' dtype: an fp16 tensor's norm overflows at 65504."""
    return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float32))


def norm(t: torch.Tensor) -> torch.Tensor:
    """:func:`norms` of one tensor (the per-parameter loop's)."""
    return torch.linalg.vector_norm(t, dtype=torch.float32)


def trust_ratios(w_norms: Sequence[torch.Tensor], u_norms: Sequence[torch.Tensor], coeff: float,
                 decay: float = 0.0, eps: float = 0.0, clip: float | None = None) -> list[torch.Tensor]:
    """``coeff * ||w|| / (||u|| + decay * ||w|| + eps)`` per tensor, 1 where either norm is 0.

    One formula for both optimizers: LARS passes the raw gradient's norm as ``||u||`` and its
    weight decay as ``decay`` (You et al. 2017, eq. 6); LAMB passes the norm of the decayed
    Adam step with ``decay = 0`` and ``coeff = 1`` (You et al. 2019, Alg. 2). A zero weight
    (a freshly zeroed layer) or a zero update (a layer that got no gradient) would give a ratio
    of 0 or inf; 1 leaves the plain step. ``clip`` caps the ratio (LAMB's phi clamp).
    Returned as 0-dim tensors on the norms' device: no host sync.
    """
    if not w_norms:
        return []
    w = torch.stack(list(w_norms)).float()  # already float32 from norms(): no copy
    u = torch.stack(list(u_norms)).float()
    ratio = coeff * w / (u + decay * w + eps)
    ratio = torch.where((w > 0) & (u > 0), ratio, torch.ones_like(ratio))
    if clip is not None:
        ratio = ratio.clamp(max=clip)
    return list(ratio.unbind())


def check_hyper(name: str, *, lr: float, weight_decay: float, eps: float, **ranges: tuple[float, float, float]) -> None:
    """Refuse a bad hyperparameter in one line naming it and what is valid.

    ``ranges``: name -> (value, low, high) with ``low <= value < high``.
    """
    import math

    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise UsageError(f"{name}: lr must be a finite number >= 0, got {lr!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise UsageError(f"{name}: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise UsageError(f"{name}: eps must be a finite number >= 0, got {eps!r}")
    for key, (value, low, high) in ranges.items():
        if not (math.isfinite(value) and low <= value < high):
            raise UsageError(f"{name}: {key} must be in [{low:g}, {high:g}), got {value!r}")


class LayerwiseOptimizer(torch.optim.Optimizer, metaclass=ABCMeta):
    """What LARS and LAMB share: ``step`` runs each param group either on the multi-tensor
    path (``foreach=True``) or the per-parameter reference loop; subclasses give both."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter with a gradient; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["foreach"]:
                self._step_foreach(group)
            else:
                self._step_loop(group)
        return loss

    @abstractmethod
    def _step_foreach(self, group: dict[str, Any]) -> None:
        """The update of ``group`` on torch's multi-tensor kernels."""

    @abstractmethod
    def _step_loop(self, group: dict[str, Any]) -> None:
        """The same update, one parameter at a time (the reference)."""

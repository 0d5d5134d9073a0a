"""Kronecker factors: micro-batch accumulation, running averages, symmetric packing.

Why packing lives here: a factor is symmetric, so its upper triangle (``n(n+1)/2`` numbers)
says everything; sending only that halves the factor traffic (SPD-KFAC's ``symmetry_aware``).
Packing and unpacking are gathers and scatters with cached index tensors on the factor's
device: no host reads, so the hooks may pack and launch a collective without stalling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_TRIU: dict[tuple[int, str], torch.Tensor] = {}


def triu_size(n: int) -> int:
    """Numbers in the upper triangle (diagonal included) of an ``n x n`` matrix."""
    return n * (n + 1) // 2


def _triu_index(n: int, device: torch.device) -> torch.Tensor:
    """Flat indices of the upper triangle of an ``n x n`` matrix (row-major), cached."""
    key = (n, str(device))
    idx = _TRIU.get(key)
    if idx is None:
        rows, cols = torch.triu_indices(n, n, device=device)
        idx = rows * n + cols
        _TRIU[key] = idx
    return idx


def pack(matrix: torch.Tensor, symmetric: bool, *, copy: bool = True) -> torch.Tensor:
    """A flat copy of ``matrix``: its upper triangle when ``symmetric``, else every entry.

    A vector (a diagonal factor) is returned flat as it is, and so is a full matrix with
    ``copy=False``: the caller owns ``matrix`` and hands it over (a statistic about to be
    all-reduced in place), so a copy would only cost time.
    """
    if matrix.dim() == 1:
        return matrix.reshape(-1)
    if not symmetric:
        flat = matrix.reshape(-1)
        return flat.clone() if copy else flat
    return matrix.reshape(-1)[_triu_index(matrix.shape[0], matrix.device)]


def unpack(flat: torch.Tensor, n: int, symmetric: bool, *, diagonal: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack`: the ``n x n`` matrix (mirrored when ``symmetric``) or vector."""
    if diagonal:
        return flat.reshape(n)
    if not symmetric:
        return flat.reshape(n, n)
    out = torch.zeros(n * n, dtype=flat.dtype, device=flat.device)
    out[_triu_index(n, flat.device)] = flat
    upper = out.reshape(n, n)
    return upper + upper.triu(1).t()


def packed_numel(n: int, symmetric: bool, *, diagonal: bool = False) -> int:
    """Numbers :func:`pack` produces for a factor of size ``n``."""
    if diagonal:
        return n
    return triu_size(n) if symmetric else n * n


@dataclass
class Accumulator:
    """Sum of one factor's statistics over the micro-batches of the current step."""

    total: torch.Tensor | None = None
    count: int = 0

    def add(self, stat: torch.Tensor) -> None:
        """Add one micro-batch's statistic."""
        self.total = stat if self.total is None else self.total + stat
        self.count += 1

    def mean(self) -> torch.Tensor | None:
        """The mean over the micro-batches seen (None if none); the statistic itself after
        one micro-batch (no copy: :meth:`clear` follows, the caller owns it then)."""
        if self.total is None:
            return None
        return self.total if self.count == 1 else self.total / self.count

    def clear(self) -> None:
        """Forget the step's statistics (after they were folded into the factor)."""
        self.total, self.count = None, 0


@dataclass
class LayerFactors:
    """A layer's two running-average factors and this step's statistics in flight."""

    a: torch.Tensor | None = None
    g: torch.Tensor | None = None
    a_acc: Accumulator = field(default_factory=Accumulator)
    g_acc: Accumulator = field(default_factory=Accumulator)
    #: :class:`~lowcomm.optim.kfac.fusion.Flight` s of the all-reduces in progress; a list,
    #: since a layer called twice in one step (weight sharing) launches twice
    a_flight: list[Any] = field(default_factory=list)
    g_flight: list[Any] = field(default_factory=list)


def running_average(old: torch.Tensor | None, new: torch.Tensor, decay: float,
                    guard_finite: bool = False) -> torch.Tensor:
    """``decay·old + (1-decay)·new``, written into ``old``; the first statistic initializes the factor.

    In place because a large layer's factor is tens of megabytes (ResNet-18's 4608² are 85 MB
    each): fresh temporaries of that size cost more in page faults than the arithmetic (an
    out-of-place version took 1.2 s of a 4.4 s factor step on one core). ``new`` is this
    step's statistic, owned by the caller and consumed here.

    With ``guard_finite`` (a step the grad scaler or the trainer skips has inf/nan values) a
    non-finite statistic leaves the factor unchanged, decided on the device (no host read):
    one sum tells (a NaN or inf anywhere makes it non-finite; a finite statistic whose sum
    overflows float32, some 10³⁸, counts as non-finite too), the statistic's non-finite
    entries are zeroed and it is weighted by 0 instead of ``1-decay``.
    """
    if old is None:
        if guard_finite:
            ok = torch.isfinite(new.sum())
            return torch.where(ok, new, torch.zeros_like(new))
        return new.clone()
    if not guard_finite:
        return old.mul_(decay).add_(new, alpha=1.0 - decay)
    ok = torch.isfinite(new.sum()).to(old.dtype)
    take = ok * (1.0 - decay)
    new.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # 0 · NaN would still be NaN
    return old.mul_(1.0 - take).addcmul_(new, take)

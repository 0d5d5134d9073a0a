"""Low-rank (PowerSGD / ACP-SGD) tensor math: matrix views, batching, orthogonalization.

Pure functions; the comm hooks decide which factor is all-reduced when.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """View an n-d gradient as ``shape[0] x prod(shape[1:])`` (as PowerSGD does)."""
    return int(shape[0]), int(math.prod(shape[1:]))


def should_compress(shape: Sequence[int], rank: int, min_compression_rate: float) -> bool:
    """Compress iff the tensor is >= 2-D and ``(n + m) * r * min_rate < n * m``."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = min(rank, n, m)
    return (n + m) * r * min_compression_rate < n * m


def effective_rank(shape: Sequence[int], rank: int) -> int:
    n, m = matrix_shape(shape)
    return min(rank, n, m)


def orthogonalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` (batched ``(..., n, r)``), via reduced QR in fp32.

    QR (not Gram-Schmidt) so zero or dependent columns give no NaN. Deterministic for equal
    inputs, so every rank derives the same factor from the same all-reduced tensor.
    """
    q, _ = torch.linalg.qr(x.to(torch.float32), mode="reduced")
    return q.to(x.dtype)


def factor_seed(seed: int, param_index: int, salt: int) -> int:
    """Seed of a parameter's initial factor: same on every rank, distinct per parameter.

    ``salt`` is 0 for Q (m x r), 1 for P (n x r)."""
    return (seed * 1_000_003 + param_index * 2 + salt) % (2**63)


def seeded_normal(shape: Sequence[int], seed: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Identical random init on every rank (CPU generator, then moved): no broadcast needed."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)

"""The one SVD every low-rank layer is initialized from.

Pufferfish starts each factorized layer from the truncated SVD of the dense layer it replaces,
so that at full rank the factors reproduce the dense layer exactly and at lower rank they are
its best approximation (Eckart-Young).
"""

from __future__ import annotations

import torch


def svd_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of a 2-D ``weight`` (out x in) -> ``(U·Σ^½ [out x r], Σ^½·Vᵀ [r x in])``.

    Computed on the CPU in float64 so that every data-parallel rank, given identical weights,
    gets bit-identical factors (LAPACK on one machine is deterministic; GPU SVD need not be).
    """
    if weight.device.type == "meta":  # shape-only models (counting parameters / MACs)
        return (
            torch.empty(weight.shape[0], rank, device="meta", dtype=weight.dtype),
            torch.empty(rank, weight.shape[1], device="meta", dtype=weight.dtype),
        )
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:rank].sqrt()
    first = u[:, :rank] * root  # out x r
    second = root[:, None] * vh[:rank]  # r x in
    return (
        first.to(device=weight.device, dtype=weight.dtype),
        second.to(device=weight.device, dtype=weight.dtype),
    )


def copy_bias(target: torch.Tensor | None, source: torch.Tensor | None) -> None:
    """Copy a dense layer's bias into its factorized replacement (both exist or neither: the
    replacement is built with ``bias=source is not None``)."""
    if target is not None and source is not None:
        target.copy_(source)

"""Decompositions of the factors and the preconditioned gradient, eigen or inverse.

Two forms, as in KAISA:

* ``compute="eigen"``: ``A = Q_A diag(d_A) Q_Aᵀ``, ``G = Q_G diag(d_G) Q_Gᵀ`` once per inverse
  update; each step ``V = Q_G [(Q_Gᵀ ∇W Q_A) / (d_G d_Aᵀ + γ)] Q_Aᵀ``, which is
  ``(G ⊗ A + γI)⁻¹ vec ∇W``: damping can change every step at no cost.
* ``compute="inverse"``: ``(A + γI)⁻¹`` and ``(G + γI)⁻¹`` once per inverse update; each step
  ``V = (G + γI)⁻¹ ∇W (A + γI)⁻¹``. Cheaper per step, damping fixed between updates.

A diagonal ``A`` (Embedding) needs no decomposition: its eigenbasis is the identity.
Eigenvalues are clamped at 0 (round-off may make a PSD factor's smallest ones negative).
KL clipping scales all layers' updates together by ``min(1, sqrt(kl_clip / |Σ lr²·V·∇W|))``,
computed on the device (no host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowcomm.optim.kfac.factors import pack, packed_numel, unpack


@dataclass
class Decomposition:
    """One factor's decomposition: eigenbasis and eigenvalues, or a damped inverse.

    ``q is None`` with ``d`` set is a diagonal factor's eigenvalues (identity basis).
    """

    q: torch.Tensor | None = None
    d: torch.Tensor | None = None
    inv: torch.Tensor | None = None


def decompose(factor: torch.Tensor, compute: str, damping: float, diagonal: bool) -> Decomposition:
    """The decomposition the preconditioner applies (see the module docstring)."""
    if diagonal:
        if compute == "eigen":
            return Decomposition(d=factor.clamp(min=0.0))
        return Decomposition(inv=1.0 / (factor.clamp(min=0.0) + damping))
    if compute == "eigen":
        d, q = torch.linalg.eigh(factor)
        return Decomposition(q=q.contiguous(), d=d.clamp(min=0.0))
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    # (F + γI) is SPD: Cholesky is cheaper and steadier than a general inverse
    return Decomposition(inv=torch.cholesky_inverse(torch.linalg.cholesky(factor + damping * eye)))


def wire_numel(n: int, compute: str, symmetric: bool, diagonal: bool = False) -> int:
    """Numbers one factor's decomposition takes when broadcast."""
    if diagonal:
        return n  # eigenvalues, or the damped inverse, of a diagonal: a vector
    if compute == "eigen":
        return n * n + n  # the eigenbasis is not symmetric: sent whole, plus the eigenvalues
    return packed_numel(n, symmetric)


def to_wire(dec: Decomposition, compute: str, symmetric: bool) -> torch.Tensor:
    """A flat tensor holding ``dec`` (what the owner broadcasts)."""
    if dec.q is None and dec.d is not None:  # diagonal, eigen form
        return dec.d
    if compute == "eigen":
        assert dec.q is not None and dec.d is not None
        return torch.cat([dec.q.reshape(-1), dec.d])
    assert dec.inv is not None
    return pack(dec.inv, symmetric)


def from_wire(flat: torch.Tensor, n: int, compute: str, symmetric: bool, diagonal: bool = False) -> Decomposition:
    """Inverse of :func:`to_wire`; the owner applies it too, so every rank uses the same bits."""
    if diagonal:
        return Decomposition(d=flat) if compute == "eigen" else Decomposition(inv=flat)
    if compute == "eigen":
        return Decomposition(q=flat[: n * n].reshape(n, n), d=flat[n * n:])
    return Decomposition(inv=unpack(flat, n, symmetric))


def precondition(grad: torch.Tensor, a: Decomposition, g: Decomposition, damping: float) -> torch.Tensor:
    """The preconditioned ``g_dim x a_dim`` gradient matrix (damping: eigen form only)."""
    grad = grad.to(torch.float32)
    if g.inv is not None:  # inverse form (A may be a diagonal inverse, a vector)
        assert a.inv is not None
        left = g.inv @ grad
        return left * a.inv if a.inv.dim() == 1 else left @ a.inv
    assert g.q is not None and g.d is not None and a.d is not None
    v = g.q.t() @ grad
    if a.q is not None:
        v = v @ a.q
    v = v / (g.d[:, None] * a.d[None, :] + damping)
    v = g.q @ v
    return v @ a.q.t() if a.q is not None else v


def kl_clip_scale(pairs: list[tuple[torch.Tensor, torch.Tensor]], kl_clip: float, lr: float) -> torch.Tensor | None:
    """The factor ``min(1, sqrt(kl_clip / |Σ lr²·⟨V, ∇W⟩|))`` over all (V, ∇W) pairs, as a
    0-d tensor on the device (None when there is nothing to clip)."""
    if not pairs:
        return None
    total = torch.stack([(v * g.to(v.dtype)).sum() for v, g in pairs]).sum() * (lr * lr)
    return torch.clamp(torch.sqrt(kl_clip / total.abs()), max=1.0)

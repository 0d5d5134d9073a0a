"""Deep Gradient Compression's schedule and clipping (Lin et al., ICLR 2018), for top-k codecs.

Two of DGC's devices are plain functions of the step or of one gradient, kept here so the
sparse codecs (:mod:`lowcomm.compress.topk`, :mod:`lowcomm.compress.gtopk`) share them:

* **sparsity warm-up** (DGC, "warm-up training"): right after the dense ``start_iter`` phase the
  density starts at ``warmup_density`` and shrinks by :data:`STAGE_FACTOR` per stage
  (``0.25, 0.0625, 0.015625``, ...) until the next stage would reach the target
  ``density``, which is then kept. The stages split the warm-up's steps evenly.
  :func:`density_at` is a pure function of the step, so every rank (and a resumed run)
  agrees on it without talking: gTop-k's point-to-point message sizes depend on it.
* **local gradient clipping** (DGC): each worker clips its gradient, before it is
  accumulated, to the norm ``clip * N**-0.5`` (``N`` workers: the sum of N independent
  clipped gradients then has about the norm ``clip``). Clipping is per tensor, as in the
  authors' code (``clip_grad_norm_`` per gradient), so the result does not depend on how
  DDP fuses tensors into buckets; it is branch-free (no host synchronization).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: DGC's density ratio between consecutive warm-up stages
STAGE_FACTOR = 0.25
#: more stages than any density > 0 needs (0.25**64 is far below one element in 2**63)
_MAX_STAGES = 64
#: added to the norm before dividing (as in ``torch.nn.utils.clip_grad_norm_``)
CLIP_EPS = 1e-6


def stage_densities(warmup_density: float, density: float) -> list[float]:
    """Densities of the warm-up stages: ``warmup_density * STAGE_FACTOR**j`` while above
    ``density`` (empty when ``warmup_density <= density``: no warm-up needed)."""
    out: list[float] = []
    d = float(warmup_density)
    while d > density and len(out) < _MAX_STAGES:
        out.append(d)
        d *= STAGE_FACTOR
    return out


def density_at(step: int, *, density: float, warmup_density: float, begin: int, length: int) -> float:
    """The density used at codec step ``step``.

    The warm-up spans steps ``begin .. begin + length - 1`` (``begin``: the first compressed
    step, ``start_iter``); its ``n`` stages (:func:`stage_densities`) take step ``begin + t``
    to stage ``t * n // length`` (stage lengths differ by at most one step). Steps before
    ``begin`` (dense ones; only a cost query asks) get the first stage's density; from
    ``begin + length`` on, and when ``length <= 0``, the target ``density``.
    """
    stages = stage_densities(warmup_density, density)
    if length <= 0 or not stages:
        return density
    t = max(0, step - begin)
    j = t * len(stages) // length
    return stages[j] if j < len(stages) else density


def clip_threshold(clip: float, world: int) -> float:
    """DGC's per-worker norm bound: ``clip * world**-0.5`` (0: clipping off)."""
    return float(clip) * max(1, int(world)) ** -0.5


def clip_segments_(flat: torch.Tensor, sizes: Sequence[int], threshold: float) -> torch.Tensor:
    """Scale each segment (one tensor of a fused buffer) of ``flat`` in place so its L2 norm
    is at most ``threshold``: ``x <- x * min(1, threshold / (||x|| + eps))``.

    Branch-free: the factor is a device tensor, never read on the host. Norms are taken in
    float32 for half-precision input. A non-finite segment stays non-finite (the NaN policy:
    the poison must travel on; the caller's finite flag keeps the state unchanged).
    """
    if threshold <= 0 or flat.numel() == 0:
        return flat
    parts = list(flat.split(list(sizes) if sizes else [flat.numel()]))
    # batched: every norm in one call, every factor in one vector op, every scaling in one
    # call (the same per-tensor norms and products as a loop, bit for bit; two passes over
    # ``flat``, the least: the factor needs the whole norm before any element is scaled)
    torch._foreach_mul_(parts, list(clip_factors(flat, sizes, threshold).unbind()))
    return flat


def clip_factors(flat: torch.Tensor, sizes: Sequence[int], threshold: float) -> torch.Tensor:
    """The factors :func:`clip_segments_` scales the segments by, one per segment, in
    ``flat``'s dtype: ``min(1, threshold / (||x|| + eps))`` (one read of ``flat``). For a
    kernel that applies them while it reads the segments anyway (ACP-SGD's fused encode),
    which saves the scaling pass. ``threshold > 0``."""
    acc = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
    parts = list(flat.split(list(sizes) if sizes else [flat.numel()]))
    norms = torch.stack(torch._foreach_norm(parts, dtype=acc))
    return (threshold / (norms + CLIP_EPS)).clamp_(max=1.0).to(flat.dtype)

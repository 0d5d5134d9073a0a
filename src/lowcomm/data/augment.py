"""Batch-level image augmentation as tensor ops (runs on whatever device the batch is on).

Randomness comes from ``generator`` when given (it must live on the batch's device), else
from torch's global RNG, which the trainer seeds per rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def _rand(n: int, *, device: torch.device, generator: torch.Generator | None) -> Tensor:
    return torch.rand(n, device=device, generator=generator)


def random_flip(x: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    """Mirror each image of ``x: (B, C, H, W)`` left-right with probability 1/2."""
    flip = _rand(x.shape[0], device=x.device, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def random_crop(x: Tensor, *, padding: int, fill: Sequence[float] | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Pad ``x: (B, C, H, W)`` by ``padding`` and crop a random ``H x W`` window per image.

    ``fill`` is the per-channel pad value; for normalized images pass the normalized value
    of black, ``-mean/std``, to match torchvision's pad-then-normalize pipeline.
    """
    b, c, h, w = x.shape
    padded = x.new_empty(b, c, h + 2 * padding, w + 2 * padding)
    if fill is None:
        padded.zero_()
    else:
        padded.copy_(torch.as_tensor(fill, dtype=x.dtype, device=x.device).view(1, c, 1, 1)
                     .expand_as(padded))
    padded[:, :, padding:padding + h, padding:padding + w] = x
    span = 2 * padding + 1
    oy = (_rand(b, device=x.device, generator=generator) * span).long().clamp_(max=span - 1)
    ox = (_rand(b, device=x.device, generator=generator) * span).long().clamp_(max=span - 1)
    rows = oy[:, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = ox[:, None] + torch.arange(w, device=x.device)  # (B, W)
    batch = torch.arange(b, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()


class CropFlip:
    """Random crop with padding, then random horizontal flip (the standard CIFAR recipe)."""

    def __init__(self, *, padding: int = 4, fill: Sequence[float] | None = None) -> None:
        self.padding = padding
        self.fill = list(fill) if fill is not None else None

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Augment a batch on its own device; ``generator`` makes the draws reproducible."""
        x = random_crop(x, padding=self.padding, fill=self.fill, generator=generator)
        return random_flip(x, generator=generator)

    def __repr__(self) -> str:
        return f"CropFlip(padding={self.padding})"


class Flip:
    """Random horizontal flip only."""

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Flip a batch on its own device; ``generator`` makes the draws reproducible."""
        return random_flip(x, generator=generator)

    def __repr__(self) -> str:
        return "Flip()"

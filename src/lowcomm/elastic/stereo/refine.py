"""Disparity refinement at the input resolution (StereoDRNet / AANet style).

Why: the finest cost volume sits at 1/4 (or 1/2) resolution and its soft-argmin is upsampled
bilinearly, which blurs depth edges. A small residual network that sees the disparity, the left
image and the photometric error of warping the right image with that disparity can sharpen
edges (the image says where they are) and fix matches the error map exposes -- StereoDRNet's
refinement, which AANet and EASNet keep. Dilated convolutions widen its view cheaply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def warp_right_to_left(right: Tensor, disparity: Tensor) -> Tensor:
    """Sample ``right`` at ``x - d``: the right view as the left camera would see it if
    ``disparity`` (``(B, H, W)``, pixels) were right. Out-of-image samples are 0."""
    b, _, h, w = right.shape
    xs = torch.arange(w, dtype=right.dtype, device=right.device).view(1, 1, w).expand(b, h, w)
    ys = torch.arange(h, dtype=right.dtype, device=right.device).view(1, h, 1).expand(b, h, w)
    x_src = xs - disparity
    # grid_sample's normalized coordinates with align_corners=True: -1 and 1 are pixel centres
    # of the first and last column/row.
    gx = 2.0 * x_src / max(w - 1, 1) - 1.0
    gy = 2.0 * ys / max(h - 1, 1) - 1.0
    grid = torch.stack([gx, gy], dim=-1)
    return F.grid_sample(right, grid, mode="bilinear", padding_mode="zeros", align_corners=True)


class _DilatedResidual(nn.Module):
    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """``x + act(bn(conv(x)))``."""
        return x + self.act(self.bn(self.conv(x)))


class Refinement(nn.Module):
    """``forward(disparity (B, H, W), images (B, 6, H, W)) -> refined disparity (B, H, W) >= 0``.

    Input to the convs: disparity / ``max_disp`` (so its scale matches the images'), the left
    image, and ``|left - warp(right, disparity)|`` (7 channels). The net predicts a residual in
    pixels; ReLU keeps the result a valid (non-negative) disparity.
    """

    def __init__(self, *, max_disp: float, channels: int = 16, dilations: tuple[int, ...] = (1, 2)) -> None:
        super().__init__()
        self.max_disp = max_disp
        self.channels = channels
        self.dilations = tuple(dilations)
        self.stem = nn.Sequential(
            nn.Conv2d(7, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.LeakyReLU(0.2, inplace=True),
        )
        self.body = nn.Sequential(*[_DilatedResidual(channels, d) for d in dilations])
        self.out = nn.Conv2d(channels, 1, 3, padding=1)

    def forward(self, disparity: Tensor, images: Tensor) -> Tensor:
        """See the class docstring."""
        left, right = images[:, :3], images[:, 3:]
        error = (left - warp_right_to_left(right, disparity)).abs()
        x = torch.cat([disparity.unsqueeze(1) / self.max_disp, left, error], dim=1)
        # channels-last: oneDNN's convolutions (and their backward) are ~2x faster on CPU
        x = x.contiguous(memory_format=torch.channels_last)
        residual = self.out(self.body(self.stem(x))).squeeze(1)
        return F.relu(disparity + residual)

"""Correlation cost volume, 3D-free cost aggregation and soft-argmin regression for one scale.

Why this shape (AANet, and EASNet which keeps AANet's back end): a *correlation* volume has one
channel per disparity candidate, whatever the feature width, so the aggregation below does not
change when the elastic feature pyramid changes its channels or depth -- it is a plain module
shared by every sub-network, and only the *number of scales* decides which heads run. AANet
aggregates with 2D convolutions that treat the disparity axis as channels (no 3D convs, which
are what make PSMNet/GC-Net slow); we keep that, without deformable convolutions (no CPU
kernels), and fuse scales coarse-to-fine only (the coarser scale's aggregated cost, upsampled
and mapped to this scale's candidates by a 1x1 conv, is added before aggregating) -- the
lightest form of AANet's cross-scale aggregation.

Disparity regression is GC-Net's soft argmin over the similarity (higher = better match):
``d = sum_k k * softmax(cost)_k``, differentiable and sub-pixel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowcomm.errors import UsageError


def correlation_volume(left: Tensor, right: Tensor, num_disp: int) -> Tensor:
    """``cost[b, d, y, x] = mean_c left[b, c, y, x] * right[b, c, y, x - d]`` for ``d < num_disp``.

    Pixels whose match would fall left of the image (``x < d``) get 0 (no evidence), as in
    AANet. ``left``/``right``: ``(B, C, H, W)``; returns ``(B, num_disp, H, W)``.
    """
    if left.shape != right.shape or left.dim() != 4:
        raise UsageError(
            f"correlation_volume needs left and right features of the same (B, C, H, W) shape, "
            f"got {tuple(left.shape)} and {tuple(right.shape)}"
        )
    if num_disp < 1:
        raise UsageError(f"correlation_volume needs num_disp >= 1, got {num_disp}")
    width = left.shape[-1]
    slices = []
    for d in range(num_disp):
        if d == 0:
            slices.append((left * right).mean(1))
        elif d < width:
            corr = (left[..., d:] * right[..., : width - d]).mean(1)
            slices.append(F.pad(corr, (d, 0)))
        else:  # a shift beyond the image: no pixel has a match
            slices.append(left.new_zeros(left.shape[0], *left.shape[2:]))
    return torch.stack(slices, 1)


def soft_argmin(cost: Tensor) -> Tensor:
    """Expected disparity under ``softmax(cost)`` over dim 1: ``(B, D, H, W) -> (B, H, W)``,
    in pixels of the cost volume's resolution, always in ``[0, D - 1]``."""
    prob = torch.softmax(cost, dim=1)
    candidates = torch.arange(cost.shape[1], dtype=cost.dtype, device=cost.device)
    return (prob * candidates.view(1, -1, 1, 1)).sum(1)


def _conv_bn_relu(cin: int, cout: int, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class ScaleHead(nn.Module):
    """Everything one pyramid scale does after its features: correlation, (fusion), aggregation,
    and -- when it is needed -- soft-argmin regression upsampled to the input resolution.

    ``forward(features, coarser=None) -> (cost, disparity | None)``:

    * ``features``: ``(2B, C, h, w)``, the left images' features stacked over the right ones'
      (the pyramid runs both views as one batch, sharing weights);
    * ``coarser``: the next-coarser scale's aggregated cost ``(B, D', h/2, w/2)`` or ``None``
      (the coarsest active scale); ``fuse`` maps it onto this scale's ``num_disp`` candidates;
    * ``cost``: the aggregated cost ``(B, num_disp, h, w)``, passed on to the next-finer scale;
    * ``disparity``: ``(B, h * downsample, w * downsample)`` in input pixels. The finest scale
      (``finest=True``) always regresses, since refinement starts from it; the others only in
      training mode, where the multi-scale loss supervises them -- at inference they would be
      wasted work, and the latency units time inference.
    """

    def __init__(
        self,
        *,
        num_disp: int,
        downsample: int,
        channels: int,
        coarser_disp: int | None,
        finest: bool,
    ) -> None:
        super().__init__()
        if num_disp < 1:
            raise UsageError(
                f"a scale at 1/{downsample} resolution has no disparity candidates; "
                f"use max_disp >= {downsample}"
            )
        self.num_disp = num_disp
        self.downsample = downsample
        self.finest = finest
        self.channels = channels
        # Fusion only exists where a coarser scale can feed this one; whether it is used is
        # the caller's business (``coarser=None`` skips it when that scale is inactive).
        self.fuse = nn.Conv2d(coarser_disp, num_disp, 1) if coarser_disp is not None else None
        self.aggregate = nn.Sequential(
            _conv_bn_relu(num_disp, channels),
            _conv_bn_relu(channels, channels, dilation=2),
            nn.Conv2d(channels, num_disp, 3, padding=1),
        )

    def forward(self, features: Tensor, coarser: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """See the class docstring."""
        left, right = features.chunk(2, dim=0)
        cost = correlation_volume(left, right, self.num_disp)
        if coarser is not None:
            if self.fuse is None:
                raise UsageError("this scale has no fusion layer: it is the coarsest of its network")
            up = F.interpolate(coarser, size=cost.shape[-2:], mode="bilinear", align_corners=False)
            cost = cost + self.fuse(up)
        cost = cost + self.aggregate(cost)
        if not (self.training or self.finest):
            return cost, None
        disp = soft_argmin(cost).unsqueeze(1) * self.downsample
        full = (cost.shape[-2] * self.downsample, cost.shape[-1] * self.downsample)
        disp = F.interpolate(disp, size=full, mode="bilinear", align_corners=False)
        return cost, disp.squeeze(1)

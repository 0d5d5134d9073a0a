"""Multi-scale smooth-L1 loss and the stereo metrics EPE and D1, over valid pixels only.

Valid pixels are ``0 < target < max_disp`` (AANet / PSMNet): a ground truth of 0 means "no
measurement" (KITTI's sparse maps, occlusion masks), and disparities at or beyond ``max_disp``
cannot be represented by a cost volume with that many candidates, so they are neither trained
on nor scored. ``error_sums`` returns the three float64 sums that the metrics are ratios of, so
sharded evaluation can all-reduce them and divide once (a mean of per-rank means would weight
ranks with fewer valid pixels too much).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lowcomm.errors import UsageError, check_positive

#: KITTI's D1 outlier rule: error > 3 px and > 5% of the true disparity.
D1_PIXELS = 3.0
D1_RELATIVE = 0.05


def valid_mask(target: Tensor, max_disp: float) -> Tensor:
    """Pixels with ground truth a cost volume of ``max_disp`` candidates can represent."""
    return (target > 0) & (target < max_disp)


def _check(pred: Tensor, target: Tensor, max_disp: float) -> None:
    check_positive("max_disp", max_disp)
    if pred.shape != target.shape:
        raise UsageError(
            f"a disparity prediction must have the target's shape {tuple(target.shape)} (B, H, W), "
            f"got {tuple(pred.shape)}"
        )


def default_weights(n: int) -> list[float]:
    """AANet's pyramid weights generalised to ``n`` predictions ordered coarsest first:
    ``min(1, (i + 1) / (n - 1))`` -- for AANet's 4 outputs exactly its ``[1/3, 2/3, 1, 1]``;
    the last two (finest scale and its refinement) always weigh 1, coarser ones less."""
    if n < 1:
        raise UsageError("multiscale_loss needs at least one prediction")
    if n == 1:
        return [1.0]
    return [min(1.0, (i + 1) / (n - 1)) for i in range(n)]


def multiscale_loss(
    preds: Sequence[Tensor],
    target: Tensor,
    max_disp: float,
    weights: Sequence[float] | None = None,
) -> Tensor:
    """``sum_i w_i * smooth_l1(preds[i], target)`` averaged over the valid pixels.

    ``preds``: disparity maps ``(B, H, W)`` at the target's resolution, coarsest first (what
    ``elastic_stereo`` returns in training mode; any number). ``weights`` default to
    :func:`default_weights`. With no valid pixel in the batch the loss is an exact zero that is
    still connected to every prediction (so DDP sees a gradient for every parameter).
    """
    if isinstance(preds, Tensor):
        preds = [preds]
    if len(preds) == 0:
        raise UsageError("multiscale_loss needs at least one prediction")
    w = list(default_weights(len(preds)) if weights is None else weights)
    if len(w) != len(preds):
        raise UsageError(f"multiscale_loss got {len(preds)} predictions but {len(w)} weights")
    mask = valid_mask(target, max_disp)
    total = target.new_zeros(())
    for pred, weight in zip(preds, w):
        _check(pred, target, max_disp)
        if bool(mask.any()):
            term = F.smooth_l1_loss(pred[mask], target[mask], reduction="mean")
        else:
            term = pred.sum() * 0.0
        total = total + weight * term
    return total


def error_sums(pred: Tensor, target: Tensor, max_disp: float) -> Tensor:
    """``float64 [sum |pred - target|, count of D1 outliers, count of valid pixels]``."""
    _check(pred, target, max_disp)
    mask = valid_mask(target, max_disp)
    err = (pred.detach().to(torch.float64) - target.to(torch.float64)).abs()[mask]
    true = target.to(torch.float64)[mask]
    bad = (err > D1_PIXELS) & (err > D1_RELATIVE * true)
    return torch.stack(
        [err.sum(), bad.sum().to(torch.float64), torch.tensor(float(err.numel()), dtype=torch.float64)]
    )


def epe(pred: Tensor, target: Tensor, max_disp: float) -> Tensor:
    """End-point error: mean ``|pred - target|`` over valid pixels (0 if there are none)."""
    s = error_sums(pred, target, max_disp)
    return s[0] / s[2].clamp_min(1.0)


def d1(pred: Tensor, target: Tensor, max_disp: float) -> Tensor:
    """KITTI's D1: fraction of valid pixels with error > 3 px and > 5% of the true disparity."""
    s = error_sums(pred, target, max_disp)
    return s[1] / s[2].clamp_min(1.0)

"""Test-set evaluation, sharded over ranks, with one host sync.

Why apart from the loop: evaluation shares nothing with the step but the model, the loss and
autocast; each rank scores a strided slice of the test set and one all-reduce combines them.
"""

from __future__ import annotations

import math
from collections.abc import Sized
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from lowcomm.comm import accounting
from lowcomm.runtime.distributed import Dist
from lowcomm.runtime.precision import autocast
from lowcomm.runtime.workload import Batches, loss_fn


@torch.no_grad()
def evaluate(
    model: nn.Module,
    test_set: Dataset[Any],
    *,
    task: str,
    dist_info: Dist,
    batch_size: int,
    amp: torch.dtype | None,
    target_is_input: bool,
    max_disp: float | None = None,
) -> dict[str, float]:
    """``test_loss`` and ``test_accuracy`` (classification), ``test_perplexity`` (language
    models) or ``test_epe`` and ``test_d1`` (stereo: end-point error in pixels and KITTI's D1
    fraction over the valid pixels, ``max_disp`` the model's), identical on every rank.
    ``model`` must be complete (the caller flushes the method first)."""
    if task == "stereo":
        return _evaluate_stereo(model, test_set, dist_info=dist_info, batch_size=batch_size, amp=amp,
                                max_disp=float(max_disp or 192.0))
    was_training = model.training
    model.eval()
    n = len(cast(Sized, test_set))  # map-style datasets: every registered one has a length
    idx = list(range(dist_info.rank, n, dist_info.world_size))
    # Statistics stay on the training device: no host sync per batch, and the all-reduce
    # below runs on the backend that carries the model's tensors (NCCL has no CPU one).
    dev = dist_info.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
    correct = torch.zeros((), dtype=torch.float64, device=dev)
    count = torch.zeros((), dtype=torch.float64, device=dev)
    fetch = Batches(test_set, batch_size, 0, 1, 0, shuffle=False).fetch
    for b in range(0, len(idx), batch_size):
        x, y = fetch(idx[b : b + batch_size])
        x, y = x.to(dev), y.to(dev)
        if target_is_input:
            y = x
        with autocast(amp, dev):
            out = model(x)
        out = out.float()
        loss_sum += loss_fn(task, out, y).double() * y.numel()
        count += y.numel()
        if task == "classification":
            correct += (out.argmax(-1) == y).sum().double()
    stats = torch.stack([loss_sum, correct, count])
    if dist.is_initialized():
        accounting.all_reduce(stats, tag="eval")
    stats = stats.cpu()  # the one host sync of the evaluation
    model.train(was_training)
    loss = float(stats[0] / stats[2].clamp(min=1))
    result = {"test_loss": loss}
    if task == "classification":
        result["test_accuracy"] = float(stats[1] / stats[2].clamp(min=1))
    else:
        result["test_perplexity"] = float(math.exp(min(loss, 50.0)))
    return result


@torch.no_grad()
def _evaluate_stereo(model: nn.Module, test_set: Dataset[Any], *, dist_info: Dist, batch_size: int,
                     amp: torch.dtype | None, max_disp: float) -> dict[str, float]:
    """EPE and D1 over every valid test pixel (sums all-reduced once, as above)."""
    from lowcomm.elastic.stereo.loss import error_sums, multiscale_loss

    was_training = model.training
    model.eval()
    n = len(cast(Sized, test_set))
    idx = list(range(dist_info.rank, n, dist_info.world_size))
    dev = dist_info.device
    sums = torch.zeros(4, dtype=torch.float64, device=dev)  # abs error, bad pixels, valid pixels, loss*batch
    fetch = Batches(test_set, batch_size, 0, 1, 0, shuffle=False).fetch
    for b in range(0, len(idx), batch_size):
        x, y = fetch(idx[b : b + batch_size])
        x, y = x.to(dev), y.to(dev)
        with autocast(amp, dev):
            out = model(x)
        pred = out[-1] if isinstance(out, (list, tuple)) else out
        pred = pred.float()
        sums[:3] += error_sums(pred, y, max_disp)
        sums[3] += multiscale_loss([pred], y, max_disp=max_disp).double() * y.shape[0]
    if dist.is_initialized():
        accounting.all_reduce(sums, tag="eval")
    stats = sums.cpu()
    model.train(was_training)
    valid = float(stats[2].clamp(min=1))
    return {"test_loss": float(stats[3]) / max(n, 1), "test_epe": float(stats[0]) / valid,
            "test_d1": float(stats[1]) / valid}

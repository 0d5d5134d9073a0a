"""The α-β communication cost model: a start-up probe and the MG-WFBP merge planner.

An all-reduce of ``s`` bytes is modelled as ``α + β·s``. :func:`probe_alpha_beta` measures
α and β with a few all-reduces of two sizes, averaged over ranks so every rank agrees.
:func:`plan_mgwfbp` is the merge rule of MG-WFBP (Shi et al.): walking the layers in
backward order, a layer's gradient joins the group still waiting to be sent when sending
that group separately would not finish any earlier anyway — the link is still busy when the
layer's gradient becomes ready — or when the time until the layer is ready is shorter than
the start-up cost α that merging saves. Tiny tensors (< 8192 elements) are always merged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from lowcomm.comm import accounting

SMALL_TENSOR_ELEMS = 8192


@dataclass(frozen=True)
class AlphaBeta:
    """Latency-bandwidth model of one collective: ``alpha + beta * bytes`` seconds."""

    alpha: float  # seconds per collective
    beta: float  # seconds per byte

    def time(self, nbytes: float) -> float:
        """Predicted seconds for a collective of ``nbytes``."""
        return self.alpha + self.beta * nbytes


def probe_alpha_beta(
    *,
    group: dist.ProcessGroup | None = None,
    small_bytes: int = 4 * 1024,
    large_bytes: int = 4 * 1024 * 1024,
    repeats: int = 5,
    device: torch.device | None = None,
    tag: str = "sched.probe",
) -> AlphaBeta:
    """Time all-reduces of two sizes; return (α, β) averaged over ranks (identical everywhere)."""
    device = device or torch.device("cpu")

    def timed(nbytes: int) -> float:
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        accounting.all_reduce(t, group=group, tag=tag)  # warm-up
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            accounting.all_reduce(t, group=group, tag=tag)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        samples.sort()
        return samples[len(samples) // 2]

    t_small = timed(small_bytes)
    t_large = timed(large_bytes)
    vals = torch.tensor([t_small, t_large], dtype=torch.float64, device=device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        accounting.all_reduce(vals, group=group, tag=tag)
        vals /= world
    t_small, t_large = float(vals[0]), float(vals[1])
    beta = max(0.0, (t_large - t_small) / (large_bytes - small_bytes))
    alpha = max(0.0, t_small - beta * small_bytes)
    return AlphaBeta(alpha, beta)


def plan_mgwfbp(
    ready_times: Sequence[float],
    nbytes: Sequence[int],
    numels: Sequence[int],
    cost: AlphaBeta,
) -> list[int]:
    """Merge plan for layers given in FORWARD order; returns unit counts per group (forward order).

    ``ready_times[i]`` is when layer i's gradient is ready during backward (any common
    origin); backward visits layers in reverse, so ``ready_times`` should decrease with i.
    """
    n = len(ready_times)
    if not (n == len(nbytes) == len(numels)):
        raise ValueError("ready_times, nbytes and numels must have the same length")
    if n == 0:
        return []
    order = list(range(n - 1, -1, -1))  # backward order
    groups_bwd: list[list[int]] = [[order[0]]]
    cur_ready = ready_times[order[0]]
    cur_bytes = nbytes[order[0]]
    link_free = float("-inf")
    for i in order[1:]:
        start = max(cur_ready, link_free)  # when the current group's collective would begin
        r = ready_times[i]
        merge = (
            numels[i] < SMALL_TENSOR_ELEMS
            or start >= r  # link busy until layer i is ready: sending now hides nothing
            or r - start < cost.alpha  # waiting for layer i is cheaper than one more α
        )
        if merge:
            groups_bwd[-1].append(i)
            cur_ready = max(cur_ready, r)
            cur_bytes += nbytes[i]
        else:
            link_free = start + cost.time(cur_bytes)
            groups_bwd.append([i])
            cur_ready, cur_bytes = r, nbytes[i]
    sizes = [len(g) for g in reversed(groups_bwd)]
    return sizes


def predict_iteration(
    ready_times: Sequence[float], nbytes: Sequence[int], sizes: Sequence[int], cost: AlphaBeta
) -> float:
    """End time of the last collective for a grouping (forward-order sizes) under the model."""
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    link_free = float("-inf")
    for lo, hi in reversed(bounds):
        ready = max(ready_times[lo:hi])
        begin = max(ready, link_free)
        link_free = begin + cost.time(sum(nbytes[lo:hi]))
    return link_free

"""gTop-k's sparse merge on the device paths: every tensor's segment at once, no host waits.

Why a module: the per-tensor merge (:func:`lowcomm.compress.topk.merge_sparse`) runs a
``torch.unique`` per tensor and round, whose output size the host must wait for, and the CPU
kernels (:mod:`lowcomm.compress.sparse_kernels`) read values on the host; on a GPU both
serialize the decode with the device's queue. This is the device form: whole-payload
operations whose sizes are known in advance, the per-tensor results bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: per (ks, device): each entry's segment, and ks with a 0 for the sentinel segment, on the
#: device (built once per density: a host-to-device copy waits for the stream)
_SEGMENTS: dict[tuple[tuple[int, ...], torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _segments(ks: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (tuple(int(k) for k in ks), device)
    hit = _SEGMENTS.get(key)
    if hit is None:
        if len(_SEGMENTS) >= 64:  # (a few densities per run; bounded all the same)
            _SEGMENTS.clear()
        counts = torch.tensor(key[0], dtype=torch.int64)
        hit = _SEGMENTS[key] = (torch.repeat_interleave(torch.arange(len(ks)), counts).to(device),
                                torch.cat([counts, counts.new_zeros(1)]).to(device))
    return hit


def merge_sparse_batched(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], ks: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_sparse_segments` for every segment at once, bit for bit: a fixed number of
    whole-payload operations and no host read, where the per-segment form runs a
    ``torch.unique`` (whose size the host must wait for) and a branch per tensor and round:
    on a GPU, gTop-k's decode spent 51-106 ms in those waits (ResNet-50, one H100).

    How: the parts' entries are sorted by index (stable, so a part listed first stays first;
    each index occurs at most once per part), equal neighbours summed into one slot (two
    addends: the same float in either order); the slots ordered by segment, magnitude
    descending and index ascending (stable sorts: ties go to the smaller index, as
    :func:`merge_sparse`); the first ``ks[s]`` of each segment kept. Every segment has at
    least ``ks[s]`` distinct indices (each part lists ``ks[s]`` distinct ones), so exactly
    ``sum(ks)`` are kept, in index order, which is segment order."""
    total = sum(int(k) for k in ks)
    vals = torch.cat([v for v, _ in parts])
    idx = torch.cat([i for _, i in parts]).long()
    if idx.numel() == 0:  # (no entries: nothing to merge)
        return vals, idx.to(torch.int32)
    seg_of, k_of = _segments(ks, vals.device)
    seg = seg_of.repeat(len(parts))
    order = torch.argsort(idx, stable=True)
    sidx = idx[order]
    new = torch.ones_like(sidx, dtype=torch.bool)
    new[1:] = sidx[1:] != sidx[:-1]
    slot = torch.cumsum(new, 0) - 1
    n = sidx.numel()
    summed = torch.zeros_like(vals).index_add_(0, slot, vals[order])
    uidx = torch.zeros_like(sidx).index_copy_(0, slot, sidx)  # (duplicates write the same index)
    sentinel = len(ks)  # unused slots sort after every segment
    used = torch.arange(n, device=vals.device) <= slot[-1]
    useg = torch.where(used, torch.zeros_like(sidx).index_copy_(0, slot, seg[order]),
                       torch.full_like(sidx, sentinel))
    by_mag = torch.argsort(summed.abs(), descending=True, stable=True)
    perm = by_mag[torch.argsort(useg[by_mag], stable=True)]
    pseg = useg[perm]
    counts = torch.zeros(sentinel + 1, dtype=torch.int64, device=vals.device).index_add_(0, useg, torch.ones_like(useg))
    start = torch.cumsum(counts, 0) - counts
    keep = (torch.arange(n, device=vals.device) - start[pseg]) < k_of[pseg]
    chosen = perm[torch.argsort((~keep).to(torch.uint8), stable=True)[:total]]
    chosen = torch.sort(chosen).values  # slot order is index order
    return summed[chosen], uidx[chosen].to(torch.int32)

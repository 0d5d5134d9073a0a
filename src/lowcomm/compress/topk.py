"""Top-k sparsification: send the k largest-magnitude entries as (values, int32 indices).

Selection is either exact (:func:`topk_indices`, ``torch.topk``) or fast
(:func:`fast_topk_indices`): estimate the magnitude threshold from a random sample, keep the
candidates above it (found with a per-block min/max pre-filter, so the tensor is read about
once), and run ``torch.topk`` on the candidates only. When at least k candidates survive, the result is *exactly* the top-k set
(every true top-k element is above the threshold); otherwise the threshold is lowered and
tried again, and after a few misses it falls back to the exact method. No full sort happens.

Selection is per tensor (``k_i = ceil(density * n_i)`` for each parameter fused in a bucket)
so the result does not depend on DDP's bucket layout: changing ``bucket_cap_mb``, DDP's
bucket rebuild after the first iteration, or a resume with the initial layout all select
the same entries. The payload of a whole bucket still travels in one collective.

Sparse payloads are not sum-compatible (indices differ between workers), so top-k is a
gathered codec: every worker scatter-adds everyone's values. gTop-k
(:mod:`lowcomm.compress.gtopk`) shares the selection, its seeding and the memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowcomm.compress.base import Compressor
from lowcomm.compress.codec import Layout, Work, register_codec

from lowcomm.compress.gathered import PayloadCodec
from lowcomm.compress.options import check_density, check_start


def num_selected(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` elements: ``max(1, ceil(density * numel))``."""
    return max(1, min(numel, math.ceil(density * numel)))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact indices of the k largest ``|x|`` (flat ``x``)."""
    return torch.topk(x.abs(), k, sorted=False).indices


def _candidates(flat: torch.Tensor, thr: torch.Tensor, block: int) -> torch.Tensor:
    """Indices with ``|x| >= thr``, reading ``flat`` about once.

    A per-block ``aminmax`` (one read pass, tiny output) finds the few blocks that can hold a
    candidate; only those blocks are gathered and compared element-wise. With a threshold
    near the top 0.1-1 %, that is a few percent of the tensor instead of several full
    passes (``abs`` + compare + ``nonzero``).
    """
    n = flat.numel()
    main = n - n % block
    xb = flat[:main].view(-1, block)
    hi, lo = xb.amax(dim=1), xb.amin(dim=1)  # (separately: faster than aminmax on CPU)
    blk = torch.nonzero((hi >= thr) | (lo <= -thr)).squeeze(1)
    inner = torch.nonzero(xb[blk].abs() >= thr)
    cand = blk[inner[:, 0]] * block + inner[:, 1]
    if main < n:
        tail = torch.nonzero(flat[main:].abs() >= thr).squeeze(1) + main
        cand = torch.cat([cand, tail])
    return cand


def _sample_abs(flat: torch.Tensor, size: int, generator: torch.Generator | None) -> torch.Tensor:
    """``|x|`` at ``size`` positions: random runs of 64 contiguous elements (cache friendly;
    runs start anywhere, so no layout stride is favoured)."""
    run = 64
    starts = torch.randint(0, flat.numel() - run + 1, (max(1, size // run),), generator=generator)
    idx = (starts[:, None] + torch.arange(run)).reshape(-1)
    return flat[idx.to(flat.device)].abs()


def fast_topk_indices(
    x: torch.Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    sample_size: int = 65_536,
    oversample: float = 1.5,
    max_tries: int = 3,
    block: int = 64,
) -> torch.Tensor:
    """Indices of the k largest ``|x|`` via a sampled threshold (see module docstring).

    ``oversample`` aims the threshold at ``oversample * k`` survivors so that sampling noise
    rarely leaves fewer than k. ``generator`` makes the sample reproducible (same on every
    rank and after a resume, given the same seed). NaNs are never selected by the fast path.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    if k * 4 >= n or n <= sample_size:
        return topk_indices(flat, k)
    sample = _sample_abs(flat, sample_size, generator)
    sample_size = sample.numel()
    target = oversample * k
    for _ in range(max_tries):
        keep = min(sample_size, max(1, math.ceil(target / n * sample_size)))
        thr = torch.topk(sample, keep, sorted=False).values.min()
        cand = _candidates(flat, thr, block)
        if cand.numel() >= k:
            sel = torch.topk(flat[cand].abs(), k, sorted=False).indices
            return cand[sel]
        target *= 4
    return topk_indices(flat, k)


class TopK(Compressor):
    """Keep ``density`` of the entries by magnitude; payload = values + int32 indices."""

    def __init__(self, density: float, *, fast_select: bool = False) -> None:
        self.density = density
        self.fast_select = fast_select
        self.generator: torch.Generator | None = None  # set per step by the hook when fast

    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k largest ``|x|`` (fast or exact, see the module docstring)."""
        if self.fast_select:
            return fast_topk_indices(x, k, generator=self.generator)
        return topk_indices(x, k)

    def select_segments(self, flat: torch.Tensor, segments: Sequence[int] | None) -> torch.Tensor:
        """Per-segment top-k indices into ``flat``, concatenated in segment order."""
        seg = list(segments) if segments else [flat.numel()]
        out, off = [], 0
        for size in seg:
            out.append(self.select(flat[off : off + size], num_selected(size, self.density)) + off)
            off += size
        return torch.cat(out) if len(out) > 1 else out[0]

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """The selected values and their int32 indices (per segment, concatenated)."""
        flat = tensor.reshape(-1)
        idx = self.select_segments(flat, segments)
        return [flat[idx], idx.to(torch.int32)], (flat.numel(), flat.dtype)

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The dense tensor with the sent values at their indices."""
        numel, dtype = ctx
        out = torch.zeros(numel, dtype=dtype, device=payload[0].device)
        return out.index_add_(0, payload[1].long(), payload[0].to(dtype))

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """Scatter-add every worker's values, divide by the number of workers."""
        numel, dtype = ctx
        vals = torch.cat([p[0] for p in payloads]).to(dtype)
        idx = torch.cat([p[1] for p in payloads]).long()
        out = torch.zeros(numel, dtype=dtype, device=vals.device)
        return out.index_add_(0, idx, vals).div_(len(payloads))

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        """For one tensor; a bucket's payload is the sum over its tensors."""
        k = num_selected(numel, self.density)
        return k * (torch.empty((), dtype=dtype).element_size() + 4)


def merge_sparse(
    values: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum sparse vectors (coinciding indices add) and keep the k largest by magnitude.

    Deterministic and symmetric in its inputs' *order of listing*: callers list the
    lower-rank part first so both partners of a gTop-k exchange compute identical results.
    Ties in magnitude are broken towards the smaller index.
    """
    idx = torch.cat(list(indices)).long()
    val = torch.cat(list(values))
    uniq, inv = torch.unique(idx, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=val.dtype, device=val.device).index_add_(0, inv, val)
    if uniq.numel() <= k:
        return summed, uniq.to(torch.int32)
    # stable: sort by magnitude descending; equal magnitudes keep ascending-index order
    order = torch.sort(summed.abs(), descending=True, stable=True).indices[:k]
    order = torch.sort(order).values
    return summed[order], uniq[order].to(torch.int32)


def merge_sparse_segments(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], ks: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_sparse` per segment. Each part lists ``ks[s]`` entries for segment 0,
    then segment 1, ...; so does the result."""
    split = [(v.split(list(ks)), i.split(list(ks))) for v, i in parts]
    vals, idx = [], []
    for s, k in enumerate(ks):
        v, i = merge_sparse([p[0][s] for p in split], [p[1][s] for p in split], k)
        vals.append(v)
        idx.append(i)
    return torch.cat(vals), torch.cat(idx)


@dataclass
class TopKOptions:
    """topk / gtopk: ``density`` kept per tensor, warm-up, residual memory, fast selection
    (seeded by ``seed``: the same sample on every rank and after a resume)."""

    density: float = 0.01
    start_iter: int = 10
    error_feedback: bool = True
    fast_select: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_density(self.density)
        check_start(self.start_iter)


@register_codec
class TopKCodec(PayloadCodec):
    """Top-k with residual memory; values + int32 indices all-gathered and scatter-added."""

    name = "topk"
    summary = "Top-k sparsification: k values + int32 indices per tensor, all-gathered"
    caveat = "sparse: needs error feedback; very low density slows convergence; traffic grows with P (all-gather)."
    Options = TopKOptions

    def build(self) -> Compressor:
        """Per-tensor top-k selection (fast or exact)."""
        self.topk = TopK(self.options.density, fast_select=self.options.fast_select)
        return self.topk

    def prepare(self, layout: Layout) -> None:
        """Fast selection samples with a generator seeded by (seed, step, first tensor):
        the same on every rank, for every bucket layout, and after a resume."""
        if self.options.fast_select:
            g = torch.Generator(device="cpu")
            first = layout.index[0] if layout.index else 0
            g.manual_seed((self.options.seed * 1_000_003 + self.step * 10_007 + first) % (2**63))
            self.topk.generator = g

    def ks(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        """k of every tensor: ``max(1, ceil(density * n_i))``."""
        return [num_selected(math.prod(s), self.options.density) for s in shapes]

    def payload_bytes(self, shapes: Sequence[Sequence[int]], dtype_bytes: int) -> int:
        """``sum_i k_i * (dtype_bytes + 4)`` (values and int32 indices)."""
        return sum(self.ks(shapes)) * (dtype_bytes + 4)

    def work(self, shapes: Sequence[Sequence[int]]) -> tuple[Work, Work]:
        """Select over every element (plus the residual's add and subtraction); scatter-add
        each payload's k values."""
        n = sum(math.prod(s) for s in shapes)
        return Work(elementwise=2 * n, topk=n), Work(scatter=sum(self.ks(shapes)))

    def decode_once(self, shapes: Sequence[Sequence[int]]) -> Work:
        """Zero-fill and divide the dense output once."""
        return Work(elementwise=sum(math.prod(s) for s in shapes))

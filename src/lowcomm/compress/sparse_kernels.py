"""CPU kernels of gTop-k's merges and of the residual hand-over of gtopk and hitopk.

Why a module of its own: gTop-k's tree merged its sparse vectors tensor by tensor with
``torch.unique`` (a sort per tensor and round), and both gtopk and hitopk formed ``g + e``
in a fresh tensor (page faults) and then copied it, minus the sent entries, back into the
residual memory (another full pass) only once the step's result was known to be finite.
Here (CPU tensors only, where a 0-dim flag is read without a device sync; device tensors
keep the torch forms):

* :func:`merge_sorted_segments` merges the workers' (value, index) lists of every tensor at
  once: the indices of a payload ascend (each tensor's selection ascends, tensors follow
  each other in the buffer), so a stable sort of two concatenated lists is one linear merge
  (timsort finds the two runs), coinciding indices add in listing order, and only the
  tensors whose union exceeds their k run a selection, numpy's ``partition`` with the
  selector's own tie rule (:func:`~lowcomm.compress.selection.exact_topk`);
* :class:`Spares` keeps a second buffer per layout: ``g + e`` is written into it, and when
  the step's result is finite the residual memory takes that buffer's storage (``set_``,
  O(1)) instead of a copy; the memory's old storage becomes the next step's spare.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lowcomm.compress.base import cpu_fast
from lowcomm.compress.selection import exact_topk

_FLOATS = (torch.float32, torch.float64)


def ascending(i: np.ndarray) -> bool:
    """Whether the indices strictly ascend (what the fast forms here rely on)."""
    return i.size < 2 or bool(np.all(i[1:] > i[:-1]))


def mergeable(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether :func:`merge_sorted_segments` may serve these parts: two of them (gTop-k's
    exchanges), CPU fast path, float32/64 values of one dtype, every part's indices ascending."""
    dtype = parts[0][0].dtype
    return (len(parts) == 2 and all(cpu_fast(v, i) and v.dtype == dtype for v, i in parts) and dtype in _FLOATS
            and all(ascending(i.numpy()) for _, i in parts))


def merge_sorted_segments(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], ks: Sequence[int],
                          bounds: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~lowcomm.compress.topk.merge_sparse_segments` of parts whose int32 indices ascend
    (two parts; check with :func:`mergeable`), bit for bit: per tensor (buffer positions ``bounds[s]`` to
    ``bounds[s + 1]``), sum the parts (coinciding indices add in listing order, starting from
    ``+0`` as ``index_add_`` into zeros does) and keep the ``ks[s]`` largest magnitudes, ties
    towards the smaller index, in ascending index order."""
    idx = np.concatenate([i.numpy() for _, i in parts])
    val = np.concatenate([v.numpy() for v, _ in parts])
    order = np.argsort(idx, kind="stable")  # a merge of ascending runs; listing order kept
    si, sv = idx.take(order), val.take(order)  # (take: several times faster than [] here)
    first = np.empty(si.size + 1, dtype=bool)  # first[j]: si[j] starts an index; a sentinel
    first[0] = first[-1] = True
    np.not_equal(si[1:], si[:-1], out=first[1:-1])
    starts = np.flatnonzero(first[:-1])
    uniq = si.take(starts)
    # at most two entries per index: a pair's sum where the next entry repeats the index
    pair = np.empty_like(sv)
    np.add(sv[:-1], sv[1:], out=pair[:-1])
    pair[-1:] = sv[-1:]
    summed = np.where(~first.take(starts + 1), pair.take(starts), sv.take(starts))
    summed += summed.dtype.type(0)  # as from zeros, 0 + a + b: a -0.0 sum becomes +0.0
    cuts = np.searchsorted(uniq, bounds)
    ks_arr = np.asarray(ks, dtype=np.int64)
    over = np.flatnonzero(np.diff(cuts) > ks_arr)
    if over.size == 0:
        return torch.from_numpy(summed), torch.from_numpy(uniq)
    keep = np.ones(uniq.size, dtype=bool)
    mag = np.abs(summed)
    for s in over.tolist():  # over tensors whose union exceeds k (a selection each), not elements
        a, b, k = int(cuts[s]), int(cuts[s + 1]), int(ks_arr[s])
        keep[a:b] = _top(summed[a:b], mag[a:b], k)
    kept = np.flatnonzero(keep)
    return torch.from_numpy(summed.take(kept)), torch.from_numpy(uniq.take(kept))


def _top(x: np.ndarray, mag: np.ndarray, k: int) -> np.ndarray:
    """Mask of the k largest ``mag`` (``k < mag.size``), ties towards the smaller position:
    :func:`~lowcomm.compress.selection.exact_topk`'s trim without its position array (its
    own form, and ``torch.topk``'s set, when NaNs leave fewer than k comparable values)."""
    m = mag.size
    v = np.partition(mag, m - k)[m - k]
    sel = mag > v
    need = k - int(np.count_nonzero(sel))
    if need > 0:
        sel[np.flatnonzero(mag == v)[:need]] = True
    if np.count_nonzero(sel) != k:  # NaN among the magnitudes
        sel = np.zeros(m, dtype=bool)
        sel[exact_topk(x, k)] = True
    return sel


def sent_mask(local: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """For each of the ascending positions ``local``: whether it is among the ascending
    positions ``chosen`` (a merge-like search, no buffer-sized mask)."""
    li, ci = local.numpy(), chosen.numpy()
    both = np.concatenate([li.astype(ci.dtype, copy=False), ci])  # int32: the payload's own type
    order = np.argsort(both, kind="stable")  # one merge of two ascending runs
    s = both.take(order)
    hit = np.flatnonzero(s[1:] == s[:-1])  # a local position, then the same chosen one
    sent = np.zeros(li.size, dtype=bool)
    sent[order.take(hit)] = True
    return torch.from_numpy(sent)


class Spares:
    """One spare buffer per layout (see the module docstring). Per codec instance: several
    codecs in one process (a test's simulated ranks) must not share one."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, ...], torch.Tensor] = {}

    def get(self, key: tuple[str, ...], like: torch.Tensor) -> torch.Tensor:
        """The spare of this layout (allocated on first use), shaped and typed as ``like``."""
        buf = self._bufs.get(key)
        if buf is None or buf.numel() != like.numel() or buf.dtype != like.dtype or buf.device != like.device:
            self.forget_overlapping(key)
            buf = self._bufs[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return buf

    def forget_overlapping(self, key: tuple[str, ...]) -> None:
        """Drop the spares of other layouts sharing a name with ``key``: after DDP rebuilds
        its buckets (or the engine regroups) the old layouts never come back, and each spare
        is a gradient-sized buffer (as :class:`~lowcomm.compress.feedback.ParamStore` drops
        their flats)."""
        names = set(key)
        for other in [k for k in self._bufs if k != key and names.intersection(k)]:
            del self._bufs[other]

    def hand_over(self, key: tuple[str, ...], mem: torch.Tensor, new: torch.Tensor) -> None:
        """``mem`` takes ``new``'s storage (``new`` is this layout's spare, now the residual);
        ``mem``'s old storage becomes the spare. O(1), the values of ``mem`` become ``new``'s."""
        if new.data_ptr() == mem.data_ptr():
            return
        old = torch.empty(0, dtype=mem.dtype, device=mem.device)
        old.set_(mem.untyped_storage(), mem.storage_offset(), mem.size(), mem.stride())
        mem.set_(new.untyped_storage(), new.storage_offset(), new.size(), new.stride())
        self._bufs[key] = old

    def keep(self, key: tuple[str, ...], mem: torch.Tensor, new: torch.Tensor) -> None:
        """``mem <- new``: by :meth:`hand_over` when ``new`` is this layout's spare, else a copy."""
        if new is self._bufs.get(key) and self.usable(mem, new):
            self.hand_over(key, mem, new)
        else:
            mem.copy_(new)

    def usable(self, mem: torch.Tensor, new: torch.Tensor) -> bool:
        """Whether :meth:`hand_over` may swap these (same dtype, size, contiguous, CPU)."""
        return (cpu_fast(mem, new) and mem.dtype == new.dtype and mem.numel() == new.numel()
                and mem.is_contiguous() and new.is_contiguous() and mem.storage_offset() == 0
                and new.storage_offset() == 0 and mem.dim() == new.dim() == 1)

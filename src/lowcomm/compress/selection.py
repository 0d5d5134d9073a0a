"""Exact top-k by magnitude at memory speed: sampled threshold, one filtering pass, exact trim.

Why: ``torch.topk`` at 1 % density costs ~40x the memory bound on a CPU (11.2 M elements:
~290 ms against ~7 ms to copy them). The k largest ``|x|`` are found here in three steps:

1. a threshold ``t`` estimated from a sample of ``|x|`` (runs of 64 contiguous elements at
   seeded positions), aimed at ``oversample * k`` survivors;
2. one pass over ``x`` keeping the positions with ``|x| >= t`` (numpy, in L2-sized chunks
   with reused scratch buffers, so no tensor-sized temporary is written);
3. the exact k-th largest magnitude ``v`` among the survivors (a selection, ``kthvalue``),
   then every survivor above ``v`` plus the *lowest-index* survivors equal to ``v``.

When at least k positions survive step 2, every true top-k element is among them, so the
result is exactly the top-k set. Otherwise the threshold is aimed lower and tried again;
after a few misses the exact trim runs on the whole tensor. The sample only decides the
speed, never the result: the result is a function of ``x`` and ``k`` alone.

**Ties** are broken towards the smaller index (the set is then unique; ``torch.topk``
leaves it unspecified, so the two agree whenever the k-th largest magnitude is not tied
across the cut). Indices come out in ascending order.

**NaN**: a NaN is never a survivor; a tensor holding a NaN is poisoned downstream anyway (the
NaN policy), so only the count matters: if fewer than k finite candidates exist, the
answer is ``torch.topk``'s (which ranks NaN highest).

**Devices**: the fast path runs on CPU tensors of float32/float64 only (it reads counts on
the host and uses numpy). CUDA tensors (and other dtypes) keep ``torch.topk``: no host
synchronization inside a communication hook.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lowcomm.compress.base import cpu_fast
from lowcomm.compress.base import device_paths as device_paths  # the one switch, re-exported

#: tensors up to this many elements take the exact trim directly (no sampling)
SMALL = 1 << 15
#: elements of |x| sampled to estimate the threshold
SAMPLE = 1 << 14
#: elements per chunk of the filtering pass (float32: 256 KiB per operand, L2-resident)
CHUNK = 1 << 16
_RUN = 64
_NUMPY_DTYPES = (torch.float32, torch.float64)


def fast_path(x: torch.Tensor) -> bool:
    """Whether :func:`topk_magnitude` takes the CPU path for ``x`` (else ``torch.topk``)."""
    return cpu_fast(x) and x.dtype in _NUMPY_DTYPES and not x.requires_grad


def topk_magnitude(x: torch.Tensor, k: int, *, generator: torch.Generator | None = None,
                   oversample: float = 1.3, max_tries: int = 3) -> torch.Tensor:
    """int64 indices of the k largest ``|x|`` of a flat tensor (see the module docstring).

    ``generator`` only seeds the sample (default: a generator seeded by ``x.numel()``; the
    global RNG is never touched)."""
    flat = x.reshape(-1)
    n = flat.numel()
    k = int(k)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    if not fast_path(flat):
        return torch.topk(flat.abs(), k, sorted=False).indices
    xn = flat.detach().numpy()
    if k * 4 >= n or n <= SMALL:
        return _exact(flat, xn, np.arange(n), np.abs(xn), k)
    sample = _sample_abs(xn, generator)
    target = oversample * k
    for _ in range(max_tries):
        keep = min(sample.size, max(1, math.ceil(target / n * sample.size)))
        thr = np.partition(sample, sample.size - keep)[sample.size - keep]
        cand = survivors(xn, thr)
        if cand.size >= k:
            return _exact(flat, xn, cand, np.abs(xn[cand]), k)
        target *= 4
    return _exact(flat, xn, np.arange(n), np.abs(xn), k)


def accumulate_topk(e: torch.Tensor, g: torch.Tensor, k: int, *, generator: torch.Generator | None = None,
                    oversample: float = 1.3, out: torch.Tensor | None = None) -> torch.Tensor:
    """``e <- e + g`` in place (with ``out``: ``out <- e + g``, ``e`` untouched), then
    :func:`topk_magnitude` of the sum, fused.

    Why: error-feedback top-k needs the sum only to select from it and keep it; adding and
    filtering chunk by chunk while the chunk is in cache reads ``g`` and ``e`` and writes
    ``e`` once, the least the update can touch. The threshold's sample is ``g + e`` at the
    sample positions (the same floats the add produces). ``e`` and ``g``: flat, contiguous,
    same dtype, :func:`fast_path` tensors (else add and select separately)."""
    n = e.numel()
    dst = e if out is None else out
    if not (fast_path(e) and fast_path(g) and fast_path(dst) and e.dtype == g.dtype == dst.dtype
            and e.is_contiguous() and g.is_contiguous() and dst.is_contiguous()) \
            or k * 4 >= n or n <= SMALL or k <= 0:
        return topk_magnitude(torch.add(e, g, out=dst), k, generator=generator, oversample=oversample)
    en, gn, dn = e.detach().numpy(), g.detach().numpy(), dst.detach().numpy()
    pos = _sample_positions(n, generator)
    sample = np.abs(en[pos] + gn[pos])
    keep = min(sample.size, max(1, math.ceil(oversample * k / n * sample.size)))
    thr = np.partition(sample, sample.size - keep)[sample.size - keep]
    cand = survivors(en, thr, add=gn, into=dn)
    if cand.size >= k:
        return _exact(dst, dn, cand, np.abs(dn[cand]), k)
    return topk_magnitude(dst, k, generator=generator, oversample=oversample * 4)


def survivors(xn: np.ndarray, thr: float, *, add: np.ndarray | None = None,
              into: np.ndarray | None = None) -> np.ndarray:
    """Ascending positions with ``|x| >= thr`` (NaN never), in chunks with reused scratch;
    with ``add``, first ``x <- x + add`` chunk by chunk (in place, or into ``into``: then the
    positions are those of ``into``)."""
    n = xn.size
    if n <= CHUNK and add is None:
        return np.flatnonzero(np.abs(xn) >= thr)
    dn = xn if into is None or add is None else into
    a = np.empty(min(n, CHUNK), dtype=xn.dtype)
    b = np.empty(min(n, CHUNK), dtype=bool)
    t = xn.dtype.type(thr)
    out = []
    for s in range(0, n, CHUNK):  # over chunks, not elements: each step is 3-4 vector calls
        m = min(CHUNK, n - s)
        if add is not None:
            np.add(xn[s : s + m], add[s : s + m], out=dn[s : s + m])
        np.abs(dn[s : s + m], out=a[:m])
        np.greater_equal(a[:m], t, out=b[:m])
        hit = b[:m].nonzero()[0]  # (the method: np.flatnonzero's wrappers cost more here)
        if hit.size:
            out.append(hit + s)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _sample_positions(n: int, generator: torch.Generator | None) -> np.ndarray:
    """SAMPLE positions: runs of 64 contiguous elements starting anywhere (cache friendly;
    no layout stride is favoured). Default generator: seeded by ``n`` (never the global RNG)."""
    g = generator
    if g is None:
        g = torch.Generator(device="cpu")
        g.manual_seed(n)
    starts = torch.randint(0, n - _RUN + 1, (SAMPLE // _RUN,), generator=g).numpy()
    return (starts[:, None] + np.arange(_RUN)).reshape(-1)


def _sample_abs(xn: np.ndarray, generator: torch.Generator | None) -> np.ndarray:
    """``|x|`` at :func:`_sample_positions`."""
    return np.abs(xn[_sample_positions(xn.size, generator)])


def exact_topk(xn: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest ``|x|`` of a float32/64 array (``0 < k``), ties towards the
    smaller position, ascending: :func:`topk_magnitude`'s exact trim on the whole array
    (``torch.topk``'s set, unordered, if NaNs leave fewer than k comparable values)."""
    return _exact(torch.from_numpy(xn), xn, np.arange(xn.size), np.abs(xn), k).numpy()


def _exact(flat: torch.Tensor, xn: np.ndarray, pos: np.ndarray, mag: np.ndarray, k: int) -> torch.Tensor:
    """The k largest of ``mag`` (magnitudes at ascending positions ``pos``), ties to the
    smaller position; ``torch.topk`` if NaNs leave fewer than k comparable values."""
    m = mag.size
    if k >= m:
        if m == k and not np.isnan(mag).any():
            return torch.from_numpy(np.ascontiguousarray(pos, dtype=np.int64))
        return torch.topk(flat.abs(), k, sorted=False).indices
    v = np.partition(mag, m - k)[m - k]  # the k-th largest (NaN sorts last: then v is NaN)
    sel = mag > v
    need = k - int(np.count_nonzero(sel))
    if need > 0:
        sel[np.flatnonzero(mag == v)[:need]] = True
    chosen = np.flatnonzero(sel)
    if chosen.size != k:  # NaN among the magnitudes
        return torch.topk(flat.abs(), k, sorted=False).indices
    return torch.from_numpy(np.ascontiguousarray(pos[chosen], dtype=np.int64))


#: output elements per chunk of :func:`scatter_mean` (float32: 1 MiB, about one L2)
OUT_CHUNK = 1 << 18


def scatter_mean(out: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """``out <- (sum of every worker's (values, indices) scattered) / len(pairs)``, in place.

    The same float operations as zero-fill, ``index_add`` of the pairs in worker order and a
    division of the whole of ``out`` (bit-identical). When every worker's indices ascend
    (top-k's payloads do: :func:`topk_magnitude` returns them so), ``out`` is done one
    cache-sized chunk at a time: zero, each worker's entries of the chunk in worker order,
    divide; so ``out`` is written once and the scatter hits cache instead of memory.
    Otherwise (pairs from elsewhere) the plain three passes."""
    count = len(pairs)
    n = out.size
    # the indices as sent (int32): converting them to intp first made 16 workers' scatter 1.5x
    # slower here (measured), for the same additions
    ascending = all(i.size < 2 or bool(np.all(i[1:] > i[:-1])) for _, i in pairs)
    if not ascending or n <= OUT_CHUNK:
        out.fill(0)
        for v, i in pairs:  # over workers (P), each one vector call
            np.add.at(out, i, v)
        out /= count
        return out
    bounds = np.arange(0, n + OUT_CHUNK, OUT_CHUNK)
    bounds[-1] = n
    cuts = [np.searchsorted(i, bounds.astype(i.dtype, copy=False)) for _, i in pairs]  # no copy of i
    for c in range(bounds.size - 1):  # over chunks of out, then workers: 2 vector calls each
        part = out[bounds[c] : bounds[c + 1]]
        part.fill(0)
        for (v, i), cut in zip(pairs, cuts):
            a, b = cut[c], cut[c + 1]
            if b > a:
                np.add.at(out, i[a:b], v[a:b])
        part /= count
    return out

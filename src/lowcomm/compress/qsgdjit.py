"""QSGD's CPU kernels compiled by numba: one fused pass each for the encode and the decode.

Why compiled: QSGD's encode is per element a random draw, a product, a sum, a floor, a clamp
and a cast to int8. Written as torch or numpy operations each of those is a pass over the
buffer (or over an in-cache chunk, with Python between chunks), and the random words alone
cost about 3x the memory bound of the whole encode (issue 18: 6.3-6.6x the bound with
PCG64 words and chunked torch passes). Here each element is drawn, scaled, rounded and
written in one loop that the compiler vectorizes; the decode adds the P payloads bucket by
bucket while the bucket's output is in cache.

The arithmetic is the documented one (:mod:`lowcomm.compress.qsgdkern`) step for step, in
fp32, with no fast-math (no contraction of the product and sum into a fused multiply-add),
so these kernels give the same bits as the torch path that device tensors take; the tests
check it. numba is an optional dependency (``pip install lowcomm[fast]``; ``make`` installs
it): importing this module without it raises ``ImportError``, and
:func:`lowcomm.compress.qsgdkern.compiled` then sends CPU tensors down the torch path, with
the same results, more slowly. Compiled on first use and cached on disk by numba.
"""

from __future__ import annotations

import numba
import numpy as np

#: the two multipliers of Wellons' ``lowbias32`` integer hash (``hash-prospector``)
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B
_U32 = np.uint32


@numba.njit(inline="always", cache=True)
def lowbias32(x: np.uint32) -> np.uint32:  # pragma: no cover - compiled
    """The 32-bit hash (a bijection): xor-shift, multiply, xor-shift, multiply, xor-shift."""
    x = x ^ (x >> _U32(16))
    x = _U32(x * _U32(MUL1))
    x = x ^ (x >> _U32(15))
    x = _U32(x * _U32(MUL2))
    return x ^ (x >> _U32(16))


@numba.njit(inline="always", cache=True)
def _pair(i: int, k1: int, k2: int) -> np.uint32:  # pragma: no cover - compiled
    """The 32-bit hash holding the words of elements ``2 * (i // 2)`` (low half) and
    ``2 * (i // 2) + 1`` (high half) of a tensor keyed by ``(k1, k2)``."""
    return lowbias32(lowbias32(_U32((i >> 1) + k1)) ^ _U32(k2))


@numba.njit(inline="always", cache=True)
def _level(v: np.float32, word: np.uint32, scale: np.float32, s: np.float32) -> np.int8:  # pragma: no cover
    """``int8(clamp(floor(v * scale + u), -s, s))`` with ``u = (word + 1/2) / 2**16``."""
    u = np.float32(np.int32(word)) * np.float32(2.0**-16) + np.float32(2.0**-17)
    y = np.floor(v * scale + u)
    y = y if y > -s else -s
    y = y if y < s else s
    return np.int8(np.int32(y))


@numba.njit(inline="always", cache=True)
def _bucket_levels(xs: np.ndarray, out: np.ndarray, first: int, k1: int, k2: int,
                   scale: np.float32, s: np.float32, pairs: np.ndarray) -> None:  # pragma: no cover
    """One bucket starting at element ``first`` of its tensor: the hashes of the pairs it
    touches into ``pairs`` (one simple loop), read back as 16-bit words (little-endian: the
    low half of hash ``j`` is word ``2j``), then one simple loop over the elements. Two
    loops without branches or strided stores, so the compiler vectorizes both."""
    n = xs.shape[0]
    p0 = first >> 1
    count = ((first + n + 1) >> 1) - p0
    for q in range(count):
        pairs[q] = _pair(2 * (p0 + q), k1, k2)
    w = pairs[:count].view(np.uint16)
    o = first & 1
    for j in range(n):
        out[j] = _level(xs[j], _U32(w[o + j]), scale, s)


@numba.njit(nogil=True, cache=True)
def levels(x: np.ndarray, norms: np.ndarray, starts: np.ndarray, firsts: np.ndarray, k1: np.ndarray,
           k2: np.ndarray, bs: int, s: float, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """The int8 levels of the flat fp32 ``x`` into ``out``: tensor ``t`` spans
    ``starts[t]:starts[t + 1]``, its buckets' norms start at ``norms[firsts[t]]``, its words
    are keyed by ``(k1[t], k2[t])``. ``nogil``: encodes and decodes may run on several threads."""
    sf = np.float32(s)
    longest = np.max(starts[1:] - starts[:-1]) if starts.shape[0] > 1 else 0
    pairs = np.empty(min(bs, longest) // 2 + 2, dtype=np.uint32)
    for t in range(starts.shape[0] - 1):
        a, n, b0 = starts[t], starts[t + 1] - starts[t], firsts[t]
        for b in range((n + bs - 1) // bs):
            norm = norms[b0 + b]
            # torch's ``s / norm`` is ``norm.reciprocal() * s``: the same two roundings
            scale = (np.float32(1.0) / norm) * sf if norm > 0 else np.float32(0.0)
            lo, hi = b * bs, min(n, b * bs + bs)
            _bucket_levels(x[a + lo : a + hi], out[a + lo : a + hi], lo, k1[t], k2[t], scale, sf, pairs)


@numba.njit(nogil=True, cache=True)
def mean(payloads: tuple, steps: tuple, starts: np.ndarray, firsts: np.ndarray, bs: int,
         out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out <-`` the mean over the payloads (a tuple of int8 level arrays, ``steps`` their
    buckets' ``norm / s``) of ``level * step``: worker 0's product, each next worker's product
    added, then the division by P (the generic decode's order), one bucket at a time."""
    world = np.float32(len(payloads))
    for t in range(starts.shape[0] - 1):
        a, n, b0 = starts[t], starts[t + 1] - starts[t], firsts[t]
        for b in range((n + bs - 1) // bs):
            lo, hi = a + b * bs, a + min(n, b * bs + bs)
            o = out[lo:hi]
            level, step = payloads[0][lo:hi], steps[0][b0 + b]
            for j in range(o.shape[0]):
                o[j] = np.float32(level[j]) * step
            for p in range(1, len(payloads)):
                level, step = payloads[p][lo:hi], steps[p][b0 + b]
                for j in range(o.shape[0]):
                    o[j] = o[j] + np.float32(level[j]) * step
            for j in range(o.shape[0]):
                o[j] = o[j] / world

"""The sign codecs' CPU table lookups compiled by numba: decode, majority vote and residual.

Why compiled: every sign decode is, per element, "gather the element's bit from each payload,
form a code, look a value up in its segment's table" (:mod:`lowcomm.compress.signbits`). As
numpy passes that is an unpack per payload, a combine, an index add and a gather, each a pass
over per-element temporaries (4-7x the memory bound at P = 4). Here the codes of 8 elements
come from one spread-table load per payload byte (``SPREAD[b]`` puts bit ``k`` of ``b`` in byte
``k`` of a 64-bit word: adding or or-ing shifted spreads of P payload bytes forms 8 codes at
once, a byte each, for P <= 8 patterns or counts below 256) and each element is one lookup.

The tables are the ones the numpy paths use (built with the generic decode's arithmetic), and
a lookup copies a table value, so every result is the same bit for bit; the residual is the
same single float subtraction. numba is optional (:mod:`lowcomm.compress.native`).
"""

from __future__ import annotations

import numba
import numpy as np

_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
#: byte b -> bit k of b in byte k of a little-endian uint64
SPREAD = (_BITS.astype(np.uint64) << (8 * np.arange(8, dtype=np.uint64))).sum(axis=1).astype(np.uint64)


@numba.njit(inline="always", cache=True)
def _code(payloads: np.ndarray, i: int, count: bool) -> int:  # pragma: no cover - compiled
    """Element ``i``'s code: its sign pattern over the payloads (bit ``p`` = payload ``p``) or,
    with ``count``, how many payloads have ``+`` there."""
    c = 0
    for p in range(payloads.shape[0]):
        bit = (int(payloads[p, i >> 3]) >> (i & 7)) & 1
        c += bit if count else bit << p
    return c


@numba.njit(inline="always", cache=True)
def _codes8(payloads: np.ndarray, j: int, count: bool, spread: np.ndarray) -> np.uint64:  # pragma: no cover
    """The codes of the 8 elements of byte ``j``, one per byte of the result."""
    c = np.uint64(0)
    for p in range(payloads.shape[0]):
        s = spread[payloads[p, j]]
        c += s if count else s << np.uint64(p)
    return c


@numba.njit(nogil=True, cache=True)
def table_decode(payloads: np.ndarray, table: np.ndarray, starts: np.ndarray, count: bool,
                 out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[i] = table[segment of i, code of i]`` for a ``(segments, 256)`` table and the
    ``(P, bytes)`` packed payloads; segment ``s`` spans elements ``starts[s]:starts[s + 1]``. Whole bytes of a segment 8 elements at
    a time, the unaligned ends one element at a time."""
    for s in range(starts.shape[0] - 1):
        a, b = starts[s], starts[s + 1]
        row = table[s]
        head = min(b, (a + 7) & ~7)
        for i in range(a, head):
            out[i] = row[_code(payloads, i, count)]
        for j in range(head >> 3, b >> 3):
            c = _codes8(payloads, j, count, SPREAD)
            for k in range(8):
                out[8 * j + k] = row[(c >> np.uint64(8 * k)) & np.uint64(255)]
        for i in range(max(head, b & ~7), b):
            out[i] = row[_code(payloads, i, count)]


@numba.njit(nogil=True, cache=True)
def table_residual(comp: np.ndarray, packed: np.ndarray, table: np.ndarray, starts: np.ndarray,
                   out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[i] = comp[i] - table[segment of i, sign bit of i]``: error feedback's residual of
    one payload (``table[s]``: the segment's decoded ``-scale`` and ``+scale``); ``out`` may
    be ``comp``. Whole bytes 8 elements at a time (constant shifts), the ends one by one."""
    for s in range(starts.shape[0] - 1):
        a, b = starts[s], starts[s + 1]
        row = table[s]
        head = min(b, (a + 7) & ~7)
        for i in range(a, head):
            out[i] = comp[i] - row[(int(packed[i >> 3]) >> (i & 7)) & 1]
        for j in range(head >> 3, b >> 3):
            byte = int(packed[j])
            for k in range(8):
                out[8 * j + k] = comp[8 * j + k] - row[(byte >> k) & 1]
        for i in range(max(head, b & ~7), b):
            out[i] = comp[i] - row[(int(packed[i >> 3]) >> (i & 7)) & 1]


@numba.njit(nogil=True, cache=True)
def abs_pack(x: np.ndarray, absolute: np.ndarray, packed: np.ndarray) -> None:  # pragma: no cover
    """One read of ``x``: ``absolute = |x|`` (for the scales' means) and the bits ``x >= 0``
    packed little-endian into ``packed`` (``-0.0`` packs as ``+``, NaN as ``-``, as
    :func:`lowcomm.compress.signbits.pack`)."""
    n = x.shape[0]
    for j in range(n >> 3):
        byte = 0
        for k in range(8):
            v = x[8 * j + k]
            absolute[8 * j + k] = abs(v)
            byte |= (1 if v >= 0 else 0) << k
        packed[j] = byte
    if n & 7:
        byte = 0
        for i in range(n & ~7, n):
            v = x[i]
            absolute[i] = abs(v)
            byte |= (1 if v >= 0 else 0) << (i & 7)
        packed[n >> 3] = byte


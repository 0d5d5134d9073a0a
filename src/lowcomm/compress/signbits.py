"""CPU kernels of the sign codecs: packing, and decoding by table lookup instead of unpacking.

Why a module of its own: the torch forms in :mod:`lowcomm.compress.sign` build 8 uint8 lanes
per packed byte and one float tensor per worker's payload, 20-300x slower than memory speed
on a CPU. Here (CPU tensors only; device tensors keep the torch forms, with no host
round-trip):

* packing is one comparison and numpy's ``packbits``;
* the packed bytes become one uint8 0/1 per element (numpy's SIMD ``unpackbits``); those of
  several workers are shifted and or-ed (an 8-bit sign pattern per element, one bit per
  worker) or added (a count of ``+`` signs per element, exact for P < 256);
* the result is one lookup per element in a small per-segment table of every value the
  pattern or count can stand for, computed with the generic decode's arithmetic so the
  results stay the same bit for bit;
* when the codes fit in 4 bits (float32; sign patterns of up to 4 payloads, counts of up to
  15) two elements are looked up at once in a table of float32 pairs (one int64 gather per
  pair, about half the gathers' cost), and their 8-bit pair codes come straight from the
  packed bytes of two payloads at a time through a 65536-entry table (nothing unpacked).

Temporaries are reused buffers (:func:`~lowcomm.compress.base.scratch`); the per-segment
index base is cached per layout (int32, one per element).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from lowcomm.compress import native
from lowcomm.compress.base import scratch

_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
#: byte -> its 8 signs as int8 +1/-1 in one uint64 (bit set: +1)
SIGNS8 = (_BITS.astype(np.int8) * 2 - 1).view(np.uint64).reshape(256)
#: workers combined in one sign pattern (8 bits per element)
GROUP = 8
#: worker p's bit weight in a pattern (numpy vectorizes a uint8 multiply, not a uint8 shift)
_WEIGHT = [np.uint8(1 << p) for p in range(GROUP)]
#: bytes of each payload decoded per chunk (256 K elements: codes and indices stay in cache)
CHUNK_BYTES = 1 << 15

_BASES: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
_LOCK = threading.Lock()
_PAIRS: OrderedDict[tuple[object, ...], tuple[torch.Tensor, np.ndarray, np.ndarray]] = OrderedDict()
_BASES_KEPT = 8  # layouts whose index base stays cached (DDP keeps a handful of buckets)


def padded(numel: int) -> int:
    """Elements covered by ``ceil(numel / 8)`` packed bytes."""
    return -(-numel // 8) * 8


def pack(flat: torch.Tensor) -> torch.Tensor:
    """Bits ``flat >= 0`` packed little-endian (a new uint8 tensor of ``ceil(n/8)`` bytes)."""
    bits = scratch("sign.bits", flat.numel(), torch.bool).numpy()
    if flat.dtype == torch.bfloat16:  # numpy has no bf16
        torch.ge(flat, 0, out=torch.from_numpy(bits))
    else:
        np.greater_equal(flat.numpy(), 0, out=bits)
    return torch.from_numpy(np.packbits(bits, bitorder="little"))


def signs_i8(packed: torch.Tensor) -> torch.Tensor:
    """The packed signs as int8 +1/-1, 8 per byte (new tensor, ``8 * packed.numel()``)."""
    return torch.from_numpy(np.take(SIGNS8, packed.reshape(-1).numpy()).view(np.int8))


def segment_base(seg: Sequence[int]) -> torch.Tensor:
    """int32 per element (padded to whole bytes): ``256 *`` the number of its segment. Cached
    per layout: the index of an element's entry in a ``(segments, 256)`` table is this plus
    the element's pattern or count."""
    key = tuple(seg)
    with _LOCK:  # decodes may run on several communication threads
        hit = _BASES.get(key)
        if hit is not None:
            _BASES.move_to_end(key)
            return hit
    numel = sum(seg)
    base = np.zeros(padded(numel), dtype=np.int32)
    base[:numel] = np.repeat(np.arange(len(seg), dtype=np.int32) * 256, seg)
    out = torch.from_numpy(base)
    with _LOCK:
        _BASES[key] = out
        while len(_BASES) > _BASES_KEPT:
            _BASES.popitem(last=False)
    return out


def decode(table: torch.Tensor, packed: Sequence[torch.Tensor], seg: Sequence[int], numel: int,
           out: torch.Tensor | None = None, *, count: bool = False) -> torch.Tensor:
    """``out[i] = table[segment of i, code of i]`` for a ``(segments, 256)`` table, where the
    code of element ``i`` is its sign pattern over the payloads (bit ``p`` = worker ``p``'s
    sign, at most 8 payloads) or, with ``count``, how many payloads have ``+`` there (fewer
    than 256 payloads).

    Chunk by chunk (``CHUNK_BYTES`` of every payload, 8 elements per byte), so that the
    per-element codes and indices stay in cache and memory sees about what it must: every
    payload read once, the index base read once and the result written once. Per chunk:
    numpy's SIMD ``unpackbits`` (one uint8 0/1 per element) per payload, shifted and or-ed
    (or added), plus the index base, then one gather (``index_select``); or, for codes of 4
    bits, :class:`_Pairs` (bit-identical: the pair table holds the same floats)."""
    result = torch.empty(numel, dtype=table.dtype) if out is None else out
    if compiled_decode(table, packed, seg, result, count=count):
        return result
    flat = table.reshape(-1)
    arrays = [p.reshape(-1).numpy() for p in packed]
    # two elements per lookup, in a table of float32 pairs, when the codes fit in 4 bits: sign
    # patterns of up to 4 payloads, vote counts of up to 15 (more: the lookups of the payloads'
    # bytes cost more than unpacking them, measured)
    pairs = (table.dtype == torch.float32 and result.data_ptr() % 8 == 0
             and len(arrays) <= (15 if count else 4))
    pair = _Pairs(table, seg, result, count) if pairs else None
    base = segment_base(seg).numpy() if pair is None else pair.base
    nbytes = arrays[0].size
    idx_buf = scratch("sign.idx", 8 * CHUNK_BYTES, torch.int32)
    for b0 in range(0, nbytes, CHUNK_BYTES):  # over chunks of the buffer, not tensors
        b1 = min(b0 + CHUNK_BYTES, nbytes)
        e0, e1 = 8 * b0, min(8 * b1, numel)
        if pair is not None:
            pair.lookup(pair.codes(arrays, b0, b1), e0, e1)
            continue
        codes = np.unpackbits(arrays[0][b0:b1], bitorder="little")
        for p, a in enumerate(arrays[1:], start=1):
            lane = np.unpackbits(a[b0:b1], bitorder="little")
            if count:
                np.add(codes, lane, out=codes)
            else:
                np.bitwise_or(codes, np.multiply(lane, _WEIGHT[p], out=lane), out=codes)  # 10x a uint8 shift
        idx = idx_buf[: e1 - e0]
        np.add(base[e0:e1], codes[: e1 - e0], out=idx.numpy())
        torch.index_select(flat, 0, idx, out=result[e0:e1])
    return result


def starts(seg: Sequence[int]) -> np.ndarray:
    """The segments' first elements and the buffer's end (int64), for the compiled kernels."""
    return np.concatenate(([0], np.cumsum(seg, dtype=np.int64))).astype(np.int64)


def compiled_decode(table: torch.Tensor, packed: Sequence[torch.Tensor], seg: Sequence[int],
                    result: torch.Tensor, *, count: bool) -> bool:
    """:func:`decode` by the compiled kernel (:func:`lowcomm.compress.signjit.table_decode`)
    where numba is installed, the table and the result are float32 and the codes fit a byte
    (at most 8 patterns' payloads, fewer than 256 counted ones); ``False`` (nothing written)
    otherwise. The same lookups, so the same bits."""
    if table.dtype != torch.float32 or result.dtype != torch.float32 or not result.is_contiguous() \
            or len(packed) > (255 if count else GROUP):
        return False
    jit = native.load("signjit")
    if jit is None:
        return False
    rows = np.stack([p.reshape(-1).numpy() for p in packed])  # (P, bytes): P / 8 bytes per element
    jit.table_decode(rows, table.contiguous().numpy(), starts(seg), count, result.reshape(-1).numpy())
    return True


def _pair_lut(weight: int) -> torch.Tensor:
    """int32 per 16-bit index ``lo | hi << 8`` (the bytes of two payloads): their 4 pair codes
    (byte j: ``c(2j) | c(2j+1) << 4``, ``c(e) = bit e of lo + weight * bit e of hi``)."""
    i = np.arange(1 << 16)
    nib = _BITS[i & 255].astype(np.int64) + weight * _BITS[i >> 8].astype(np.int64)
    val = np.zeros(i.size, dtype=np.int64)
    for j in range(4):  # over the 4 pairs of a byte
        val |= (nib[:, 2 * j] | (nib[:, 2 * j + 1] << 4)) << (8 * j)
    return torch.from_numpy(val.astype(np.uint32).view(np.int32))


#: two payloads' bytes -> pair codes: vote counts (added) and sign patterns (bits 0 and 1)
_LUT_COUNT = _pair_lut(1)
_LUT_PATTERN = _pair_lut(2)


def pair_table(table: torch.Tensor) -> torch.Tensor:
    """int64 ``(segments * 256)``: entry ``256 s + (lo | hi << 4)`` holds the float32 bits of
    ``table[s, lo]`` then ``table[s, hi]`` (little-endian: two consecutive elements)."""
    bits = table[:, :16].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    j = torch.arange(256)
    return (bits[:, j & 15] | (bits[:, j >> 4] << 32)).reshape(-1)


def pair_layout(seg: Sequence[int]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(int32 per element pair: ``256 *`` the segment of its first element; the elements that
    start a segment at an odd position, the second of a pair whose first belongs to another
    segment; ``256 *`` their segment). Cached per layout, as :func:`segment_base`."""
    key = ("pairs", *seg)
    with _LOCK:
        hit = _PAIRS.get(key)
        if hit is not None:
            _PAIRS.move_to_end(key)
            return hit
    elem = segment_base(seg).numpy()
    starts = np.cumsum([0, *seg[:-1]], dtype=np.int64)
    odd = np.flatnonzero(starts % 2 == 1)
    made = (torch.from_numpy(np.ascontiguousarray(elem[::2])), starts[odd], (odd * 256).astype(np.int64))
    with _LOCK:
        _PAIRS[key] = made
        while len(_PAIRS) > _BASES_KEPT:
            _PAIRS.popitem(last=False)
    return made


class _Pairs:
    """Two elements per lookup (see :func:`decode`): the buffers and views of one decode, made
    once so that each chunk costs a few vector calls and no Python-side set-up."""

    def __init__(self, table: torch.Tensor, seg: Sequence[int], result: torch.Tensor, count: bool) -> None:
        self.flat, self.fn = table.reshape(-1), table.reshape(-1).numpy()
        self.ptable = pair_table(table)
        base, self.odd_pos, self.odd_rows = pair_layout(seg)
        self.base, self.ends = base.numpy(), np.cumsum(seg)
        self.result, self.rn = result, result.numpy()
        self.lut = _LUT_COUNT if count else _LUT_PATTERN
        self.count = count
        m = CHUNK_BYTES
        self.u8 = scratch("sign.u16", m, torch.int16).numpy().view(np.uint8)
        self.ix, self.acc, self.tmp = (scratch(f"sign.{name}", m, torch.int32) for name in ("ix", "acc", "tmp"))
        self.idx = scratch("sign.pairidx", 4 * m, torch.int32)
        self.ixn, self.accn, self.tmpn, self.idxn = (t.numpy() for t in (self.ix, self.acc, self.tmp, self.idx))

    def codes(self, arrays: Sequence[np.ndarray], b0: int, b1: int) -> np.ndarray:
        """The pair codes (``lo | hi << 4``, uint8) of bytes ``b0:b1`` of every payload (at most
        4 patterns, or counts of at most 15 payloads): one lookup per byte of two payloads,
        added (counts; a pattern's second pair of payloads shifted to bits 2 and 3)."""
        m = b1 - b0
        u8, ix, acc, tmp = self.u8[: 2 * m], self.ix[:m], self.acc[:m], self.tmp[:m]
        for q in range(0, len(arrays), 2):  # over pairs of payloads
            u8[0::2] = arrays[q][b0:b1]
            u8[1::2] = arrays[q + 1][b0:b1] if q + 1 < len(arrays) else 0
            np.copyto(self.ixn[:m], u8.view(np.uint16), casting="unsafe")
            torch.index_select(self.lut, 0, ix, out=tmp if q else acc)
            if q:
                if not self.count:
                    np.left_shift(self.tmpn[:m], q, out=self.tmpn[:m])
                np.add(self.accn[:m], self.tmpn[:m], out=self.accn[:m])
        return self.accn[:m].view(np.uint8)

    def lookup(self, pc: np.ndarray, e0: int, e1: int) -> None:
        """``result[e0:e1]`` (``e0`` even) from the chunk's pair codes; a pair split by a
        segment boundary gets its second element from its own segment's row, and an odd last
        element is looked up alone."""
        half = (e1 - e0) // 2
        j0 = e0 // 2
        np.add(self.base[j0 : j0 + half], pc[:half], out=self.idxn[:half])
        torch.index_select(self.ptable, 0, self.idx[:half], out=self.result[e0 : e0 + 2 * half].view(torch.int64))
        a, b = np.searchsorted(self.odd_pos, [e0, e1])
        fix, rows = self.odd_pos[a:b], self.odd_rows[a:b]
        if (e1 - e0) % 2:  # the buffer's odd last element
            fix = np.append(fix, e1 - 1)
            rows = np.append(rows, 256 * int(np.searchsorted(self.ends, e1 - 1, side="right")))
        if fix.size:
            rel = fix - e0
            self.rn[fix] = self.fn[rows + ((pc[rel // 2] >> (4 * (rel % 2))) & 15)]


def sum_table(scales: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``(segments, 256)``: for each sign pattern, ``sum_p (+-1) * scale_p`` of the group's
    workers added in worker order in ``dtype`` (the generic decode's operations, applied to
    ``segments x 256`` values instead of to every element)."""
    codes = torch.arange(256, dtype=torch.int64)
    out: torch.Tensor | None = None
    for p, s in enumerate(scales):
        sign = ((codes >> p) & 1).to(dtype).mul_(2).sub_(1)
        term = sign[None, :].mul(s.to(dtype)[:, None])
        out = term if out is None else out.add_(term)
    assert out is not None
    return out


def vote_table(scales: torch.Tensor, world: int, dtype: torch.dtype) -> torch.Tensor:
    """``(segments, 256)``: for ``c`` workers of ``world`` voting ``+``, ``sign(2c - world)``
    (the sign of the summed +-1 votes) times the segment's scale, in ``dtype``."""
    votes = torch.zeros(256, dtype=dtype)
    votes[: world + 1] = torch.arange(world + 1, dtype=dtype).mul_(2).sub_(world).sign_()
    return votes[None, :].mul(scales.to(dtype)[:, None])


def usable(out: torch.Tensor | None, dtype: torch.dtype, numel: int) -> bool:
    """Whether results may be written straight into ``out``."""
    return (out is not None and out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
            and out.numel() == numel)


#: most payloads :func:`vote` takes (``2 * count - P`` must fit in int8)
VOTE_MAX = 63


def vote(packed: Sequence[torch.Tensor], scales: torch.Tensor, seg: Sequence[int], numel: int,
         out: torch.Tensor) -> torch.Tensor:
    """Majority vote of float32 ``out[i] = sign(2 c_i - P) * scales[segment of i]``, ``c_i`` the
    payloads with ``+`` at element ``i`` (``P <= VOTE_MAX``).

    Why not :func:`decode`'s table: its per-element lookup (and the per-element segment index
    it reads) cost 2-3x the vote itself. Here, chunk by chunk (in cache): the counts by SIMD
    ``unpackbits`` and adds (uint8), the vote as int8 (``2c - P``, then its sign), cast to
    float32 into the result, then one in-place multiply per piece of a segment in the chunk
    by the segment's scale. Bit-identical to the generic path: the same float32 products of
    -1, 0 or +1 and the scale."""
    world = len(packed)
    if compiled_decode(vote_table(scales, world, torch.float32), packed, seg, out, count=True):
        return out
    arrays = [p.reshape(-1).numpy() for p in packed]
    rn = out.numpy()
    scale = scales.to(torch.float32).numpy()
    ends = np.cumsum(seg)
    nbytes = arrays[0].size
    for b0 in range(0, nbytes, CHUNK_BYTES):  # over chunks of the buffer, not tensors
        b1 = min(b0 + CHUNK_BYTES, nbytes)
        e0, e1 = 8 * b0, min(8 * b1, numel)
        counts = np.unpackbits(arrays[0][b0:b1], bitorder="little")
        for a in arrays[1:]:
            np.add(counts, np.unpackbits(a[b0:b1], bitorder="little"), out=counts)
        votes = counts.view(np.int8)
        np.multiply(votes, 2, out=votes)
        np.subtract(votes, world, out=votes)
        np.sign(votes, out=votes)
        np.copyto(rn[e0:e1], votes[: e1 - e0], casting="unsafe")  # int8 -> float32, numpy's SIMD cast
        s = int(np.searchsorted(ends, e0, side="right"))
        start = e0
        while start < e1:  # the pieces of segments in this chunk
            stop = min(int(ends[s]), e1)
            np.multiply(rn[start:stop], scale[s], out=rn[start:stop])
            start, s = stop, s + 1
    return out

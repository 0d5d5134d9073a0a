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
  results stay the same bit for bit.

Temporaries are reused buffers (:func:`~lowcomm.compress.base.scratch`); the per-segment
index base is cached per layout (int32, one per element).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

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
    (or added), plus the index base, then one gather (``index_select``)."""
    result = torch.empty(numel, dtype=table.dtype) if out is None else out
    base = segment_base(seg).numpy()
    flat = table.reshape(-1)
    arrays = [p.reshape(-1).numpy() for p in packed]
    nbytes = arrays[0].size
    idx_buf = scratch("sign.idx", 8 * CHUNK_BYTES, torch.int32)
    for b0 in range(0, nbytes, CHUNK_BYTES):  # over chunks of the buffer, not tensors
        b1 = min(b0 + CHUNK_BYTES, nbytes)
        e0, e1 = 8 * b0, min(8 * b1, numel)
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

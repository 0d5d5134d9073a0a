"""fp16 / bf16: halve the bytes with a sum-compatible cast (all-reduce kind).

The tensor is divided by the world size *before* the cast (as PyTorch's fp16 hook does) so
that the sum of P half-precision values does not overflow where the mean would not.
Stateless and elementwise: a slice of the summed message decodes to the same slice of the
mean, so lee18 may reduce-scatter it and DeAR may split it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm.buffers import BufferPool
from lowcomm.compress.base import Compressor, cpu_fast, scratch
from lowcomm.compress.codec import Aggregation, Codec, CodecCost, Layout, Message, Round, Work, register_codec
from lowcomm.compress.feedback import finite_flag, poison_

#: elements per in-cache chunk of the CPU encode
CHUNK = 1 << 18


class CastCompressor(Compressor):
    """The cast as a plain :class:`Compressor` (payload math only, without the codec's division by P
    and padding): the form the payload unit tests check."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """The tensor in the wire dtype (the original dtype is the decode's context)."""
        return [tensor.to(self.dtype)], tensor.dtype

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Back to the original dtype."""
        return payload[0].to(ctx)

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        """``numel`` times the wire dtype's size."""
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class CastOptions:
    """fp16 / bf16 take no options."""


class CastCodec(Codec):
    """Divide by P, cast to :attr:`dtype`, sum, cast back."""

    Options = CastOptions
    aggregation = Aggregation.SUM
    elementwise = True
    dtype: ClassVar[torch.dtype] = torch.float16

    def __init__(self, options: Any = None, *, world: int = 1, rank: int = 0) -> None:
        super().__init__(options, world=world, rank=rank)
        #: CPU message buffers; one is reused once nothing else references its memory
        self._buffers = BufferPool(limit=8)  # one per bucket in flight, for a few buckets at most
        self._wire = torch.empty(0, dtype=self.dtype)  # names the pool's dtype and device (CPU)

    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *,
               pad_to: int = 1) -> Message:
        """``flat / P`` in the wire dtype, zero-padded to ``pad_to``, poisoned if not finite.

        Finiteness is checked after the cast as well: a finite fp32 value above the wire
        range (65504 * P for fp16) becomes inf here, and an unpoisoned inf would land in one
        rank's shard only after a reduce-scatter, so the ranks would disagree on skipping."""
        n = flat.numel()
        padded = -(-n // pad_to) * pad_to
        if cpu_fast(flat) and flat.dtype != self.dtype and flat.is_contiguous():
            return self._encode_cpu(flat, finite, n, padded)
        buf = torch.empty(padded, dtype=self.dtype, device=flat.device)
        buf[n:].zero_()
        if flat.dtype == self.dtype:
            torch.div(flat, self.world, out=buf[:n])  # divide before the cast: no overflow
        else:
            buf[:n].copy_(torch.div(flat, self.world))
        poison_(buf, finite & finite_flag(buf[:n]))
        return Message(buf, "all_reduce", ctx=flat.dtype, numel=n)

    def _encode_cpu(self, flat: torch.Tensor, finite: torch.Tensor, n: int, padded: int) -> Message:
        """:meth:`encode` on the CPU: the same values (divide in the input's dtype, round once
        on the cast), chunk by chunk in cache (torch's CPU division with a casting ``out=``
        runs an element-by-element loop ~8x slower, and two full-size passes write and read
        a temporary), into a message buffer of an earlier step that no one holds any more
        (:meth:`_take`; a fresh 50 MB tensor is fresh pages, ~5x a copy to fault in); the
        finiteness of the cast values is taken per chunk while it is in cache (its min and max)."""
        buf = self._take(padded)
        buf[n:].zero_()
        tmp = scratch("cast.div", min(n, CHUNK), flat.dtype)
        chunks = -(-n // CHUNK)
        lo = scratch("cast.lo", chunks, self.dtype)
        hi = scratch("cast.hi", chunks, self.dtype)
        for c in range(chunks):
            a, b = c * CHUNK, min(n, (c + 1) * CHUNK)
            part = buf[a:b].copy_(torch.div(flat[a:b], self.world, out=tmp[: b - a]))
            torch.aminmax(part, out=(lo[c], hi[c]))
        ok = bool(finite) and (chunks == 0 or bool(torch.isfinite(lo.min()) & torch.isfinite(hi.max())))
        if not ok:
            buf.fill_(float("nan"))
        return Message(buf, "all_reduce", ctx=flat.dtype, numel=n)

    def _take(self, numel: int) -> torch.Tensor:
        """A CPU buffer of ``numel`` wire-dtype elements: a pooled one whose memory nothing
        else references (no message, view, received tensor or pending collective of an
        earlier step holds it: the pool hands out views, each of which counts), else a new
        one added to the pool. Safe by construction whatever the transport does with a
        message and for how long; without torch's storage use count, never reused."""
        return self._buffers.take(numel, self._wire)

    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """The sum of ``flat / P`` is the mean: cast back (any matching slice works too)."""
        out.copy_(received[: out.numel()])

    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None) -> CodecCost:
        """One all-reduce of ``n`` elements in the wire dtype (2 bytes each)."""
        n = sum(math.prod(s) for s in shapes)
        size = torch.empty((), dtype=self.dtype).element_size()
        return CodecCost(Work(elementwise=n), [Round("all_reduce", n * size, Work(elementwise=n))])


@register_codec
class FP16Codec(CastCodec):
    """IEEE half precision: 5 exponent bits (needs loss scaling for small gradients)."""

    name = "fp16"
    summary = "fp16 all-reduce (2 bytes per element)"
    caveat = "fp16 gradients can overflow/underflow without loss scaling; usually accuracy-neutral."
    dtype = torch.float16


@register_codec
class BF16Codec(CastCodec):
    """bfloat16: fp32's exponent range, 8 bits of mantissa."""

    name = "bf16"
    summary = "bf16 all-reduce (2 bytes per element)"
    caveat = "bf16 keeps fp32's range but only 8 bits of mantissa; usually accuracy-neutral."
    dtype = torch.bfloat16

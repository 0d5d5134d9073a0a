"""Payload math (:class:`Compressor`) and the byte-level packing of gathered payloads.

A :class:`Compressor` is the pure tensor math of one payload format (encode one flat
tensor, decode one payload, average several): the codecs of :mod:`lowcomm.compress` build on
it, and the simulator's profiler times it. It knows nothing of collectives, steps or state.

A payload is a list of tensors. :func:`pack_payload` flattens it into one ``uint8`` tensor so
an all-gather-kind method issues exactly one collective per bucket (fewer latency terms, and
bytes that match the analytic formula exactly); :func:`unpack_payload` inverts it using the
``spec`` (dtype, numel per part) that every rank can compute locally.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

PayloadSpec = list[tuple[torch.dtype, int]]


class Compressor(ABC):
    """Encode a flat gradient into a payload and decode it back.

    ``compress`` returns ``(payload, ctx)``; ``ctx`` holds whatever the local decode needs
    (never sent). ``decompress(payload, ctx)`` reconstructs the flat tensor;
    :meth:`aggregate` decodes several workers' payloads into their mean (how payloads
    combine on the wire is the codec's :attr:`~lowcomm.compress.codec.Codec.aggregation`).
    """

    @abstractmethod
    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """``segments``: sizes of the tensors fused in ``tensor`` (one per parameter)."""

    @abstractmethod
    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The flat tensor one payload stands for (``ctx`` from :meth:`compress`)."""

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """Mean of all workers' decoded payloads (all-gather kind). Default: decode each."""
        out = self.decompress(payloads[0], ctx).clone()
        for p in payloads[1:]:
            out.add_(self.decompress(p, ctx))
        return out.div_(len(payloads))

    @abstractmethod
    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        """Analytic bytes of one worker's payload for a flat tensor of ``numel`` elements."""


def payload_spec(payload: Sequence[torch.Tensor]) -> PayloadSpec:
    """(dtype, numel) per part: all :func:`unpack_payload` needs, computable on every rank."""
    return [(t.dtype, t.numel()) for t in payload]


def pack_payload(payload: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the raw bytes of every part into one flat uint8 tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in payload]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unpack_payload(buf: torch.Tensor, spec: PayloadSpec) -> list[torch.Tensor]:
    """Inverse of :func:`pack_payload` for one worker's slice ``buf`` (uint8)."""
    out, offset = [], 0
    for dtype, numel in spec:
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * size
        part = buf[offset : offset + nbytes]
        if (part.storage_offset() % size) != 0:
            part = part.clone()  # parts are packed without padding; realign before viewing
        out.append(part.view(dtype))
        offset += nbytes
    if offset != buf.numel():
        raise ValueError(f"payload has {buf.numel()} bytes, spec describes {offset}")
    return out


def pack(parts: Sequence[torch.Tensor], finite: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.dtype, int]]]:
    """Poison the floating parts when ``finite`` is False, then pack all parts into one uint8
    tensor (one all-gather per buffer); returns it with the spec :func:`unpack` needs."""
    from lowcomm.compress.feedback import poison_  # feedback imports this module

    for t in parts:
        poison_(t, finite)
    return pack_payload(parts), payload_spec(parts)


def unpack(rows: torch.Tensor, spec: Sequence[tuple[torch.dtype, int]]) -> list[list[torch.Tensor]]:
    """Each worker's parts from the ``(world, nbytes)`` rows an all-gather received."""
    return [unpack_payload(row, list(spec)) for row in rows]

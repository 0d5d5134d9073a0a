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

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Sequence

import torch

PayloadSpec = list[tuple[torch.dtype, int]]

_SCRATCH = threading.local()

#: environment switch: ``LOWCOMM_CPU_FAST=0`` makes CPU tensors take the device (torch-only,
#: branch-free) paths too, which is how tests without a GPU check those paths
CPU_FAST_ENV = "LOWCOMM_CPU_FAST"


def cpu_fast(*ts: torch.Tensor) -> bool:
    """Whether the CPU fast paths may serve these tensors: all on the CPU (where reading a
    0-dim flag or viewing memory through numpy costs no device sync) and not switched off
    by ``LOWCOMM_CPU_FAST=0``. Device tensors always keep the torch paths."""
    return all(t.device.type == "cpu" for t in ts) and os.environ.get(CPU_FAST_ENV, "1") != "0"


@contextmanager
def device_paths() -> Iterator[None]:
    """Within it, CPU tensors take the device paths of every codec (torch only, branch-free, no
    host reads) instead of their CPU fast paths (``LOWCOMM_CPU_FAST=0`` for the duration; an
    environment variable, so processes started inside inherit it).

    Why: the CPU fast paths read values on the host (numpy, a CPU finite flag), which costs
    nothing on a CPU but is exactly what a test that counts host reads (tests/test_host_sync.py)
    must not see; with this, such a test still checks on a CPU-only machine the paths that
    CUDA tensors take. Not thread-safe against a concurrent step; meant for tests."""
    saved = os.environ.get(CPU_FAST_ENV)
    os.environ[CPU_FAST_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(CPU_FAST_ENV, None)
        else:
            os.environ[CPU_FAST_ENV] = saved


def scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU work buffer of ``numel`` elements, reused across calls (per thread and ``name``).

    Why: a fresh tensor of tens of MB is fresh pages from the OS, and faulting them in costs
    more than the arithmetic written into them (a new 45 MB tensor: ~5x a copy of it). For
    temporaries only: the contents are overwritten by the next call with the same ``name``
    on this thread, so nothing returned to a caller may be a scratch view."""
    pool: dict[tuple[str, torch.dtype], torch.Tensor] | None = getattr(_SCRATCH, "pool", None)
    if pool is None:
        pool = _SCRATCH.pool = {}
    buf = pool.get((name, dtype))
    if buf is None or buf.numel() < numel:
        buf = pool[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


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

    def aggregate_out(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor) -> None:
        """:meth:`aggregate` written into ``out`` (what a gathered codec's decode calls). A
        compressor may write there directly and save a full-size temporary and its copy."""
        out.copy_(self.aggregate(payloads, ctx))

    def residual(self, comp: torch.Tensor, payload: Sequence[torch.Tensor], ctx: Any,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``comp - decompress(payload, ctx)``: what error feedback keeps (into ``out`` when
        given). A compressor may fuse it (sign: no ±1 float tensor in between); the result
        must stay the same bit for bit."""
        return torch.sub(comp, self.decompress(payload, ctx), out=out)

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

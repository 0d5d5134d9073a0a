"""Stateful wrappers around any compressor: error feedback and momentum (BytePS style).

State is kept per *parameter name* (:class:`ParamStore`), not per DDP bucket index, because
DDP rebuilds its buckets after the first iteration and a resumed run starts with the initial
layout again: per-name state survives both. Internally each bucket layout keeps one flat
tensor (no copies in the hot path); it is split into per-name pieces only when the layout
changes or for :meth:`ParamStore.state_dict`.

NaN/Inf policy (documented in docs/compression.md): a non-finite input is never folded into
the memory. The wrapper leaves the memory/momentum of that bucket unchanged and warns; the
comm hook poisons the payload so the aggregated gradient is non-finite on *every* rank
(an AMP grad scaler or the trainer's check then skips the step) while the collective
sequence stays identical on all ranks (no hang).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from lowcomm.compress.base import Compressor


def all_finite(t: torch.Tensor) -> bool:
    """True iff every entry is finite. One read pass: NaN/Inf propagate into the sum; a sum
    that overflows float range also reads as non-finite, which errs on the safe side."""
    if t.numel() == 0:
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.float32) if t.is_floating_point() else t.sum()))


def warn_nonfinite(what: str) -> None:
    warnings.warn(
        f"non-finite gradient: {what} left unchanged this step; the aggregated gradient is "
        "non-finite on every rank so the step can be skipped",
        RuntimeWarning,
        stacklevel=3,
    )


class ParamStore:
    """Per-parameter tensors addressed through bucket layouts ``(names, sizes)``."""

    def __init__(self) -> None:
        self._flats: dict[tuple[str, ...], tuple[list[int], torch.Tensor]] = {}
        self._pieces: dict[str, torch.Tensor] = {}

    def get(self, names: Sequence[str], sizes: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """The persistent flat tensor for this layout (zeros for names never seen)."""
        key = tuple(names)
        hit = self._flats.get(key)
        if hit is not None and hit[1].dtype == like.dtype and hit[1].device == like.device:
            return hit[1]
        wanted = set(key)
        for other in [o for o in self._flats if wanted.intersection(o)]:
            self._split(other)
        parts = []
        for name, size in zip(key, sizes):
            piece = self._pieces.pop(name, None)
            if piece is None or piece.numel() != size:
                piece = torch.zeros(size, dtype=like.dtype, device=like.device)
            parts.append(piece.to(dtype=like.dtype, device=like.device).reshape(-1))
        flat = torch.cat(parts) if parts else like.new_zeros(0)
        self._flats[key] = (list(sizes), flat)
        return flat

    def _split(self, key: tuple[str, ...]) -> None:
        sizes, flat = self._flats.pop(key)
        for name, piece in zip(key, flat.split(sizes)):
            self._pieces[name] = piece.clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {n: t.detach().cpu().clone() for n, t in self._pieces.items()}
        for key, (sizes, flat) in self._flats.items():
            for name, piece in zip(key, flat.split(sizes)):
                out[name] = piece.detach().cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._flats.clear()
        self._pieces = {n: t.detach().clone() for n, t in state.items()}

    def names(self) -> set[str]:
        return set(self._pieces) | {n for key in self._flats for n in key}


class CompressorWrapper(Compressor):
    """Per-parameter memory around an inner compressor, whose payload format it keeps:
    decoding, aggregation and byte counts are the inner compressor's."""

    def __init__(self, inner: Compressor, *, store: ParamStore | None = None) -> None:
        self.inner = inner
        self.aggregation = inner.aggregation  # type: ignore[misc]
        self.memory = store if store is not None else ParamStore()

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        return self.inner.aggregate(payloads, ctx)

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        return self.inner.payload_bytes(numel, dtype, num_tensors)


class ErrorFeedback(CompressorWrapper):
    """Residual memory around any compressor: send ``C(g + e)``, keep ``e <- g + e - D(C(.))``.

    The memory update uses the *local* reconstruction, which is what EF-SignSGD and top-k
    with residuals prescribe. Methods whose memory depends on the aggregate (PowerSGD) use
    :attr:`memory` directly.
    """

    def compress(
        self,
        tensor: torch.Tensor,
        segments: Sequence[int] | None = None,
        *,
        names: Sequence[str] = ("_",),
    ) -> tuple[list[torch.Tensor], Any]:
        sizes = list(segments) if segments else [tensor.numel()]
        mem = self.memory.get(names, sizes, tensor)
        comp = tensor + mem
        payload, ctx = self.inner.compress(comp, segments)
        if all_finite(comp):
            mem.copy_(comp - self.inner.decompress(payload, ctx))
        else:
            warn_nonfinite("error-feedback memory")
        return payload, ctx


class Momentum(CompressorWrapper):
    """Compress the momentum ``m <- beta*m + (1-beta)*g`` instead of ``g`` (Signum)."""

    def __init__(self, inner: Compressor, *, beta: float, store: ParamStore | None = None) -> None:
        super().__init__(inner, store=store)
        self.beta = beta

    def compress(
        self,
        tensor: torch.Tensor,
        segments: Sequence[int] | None = None,
        *,
        names: Sequence[str] = ("_",),
    ) -> tuple[list[torch.Tensor], Any]:
        sizes = list(segments) if segments else [tensor.numel()]
        mom = self.memory.get(names, sizes, tensor)
        if all_finite(tensor):
            mom.mul_(self.beta).add_(tensor, alpha=1.0 - self.beta)
            return self.inner.compress(mom, segments)
        warn_nonfinite("momentum")
        return self.inner.compress(mom * self.beta + tensor * (1.0 - self.beta), segments)

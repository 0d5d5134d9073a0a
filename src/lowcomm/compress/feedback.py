"""Stateful wrappers around any compressor: error feedback and momentum (BytePS style).

State is kept per *parameter name* (:class:`ParamStore`), not per DDP bucket index, because
DDP rebuilds its buckets after the first iteration and a resumed run starts with the initial
layout again: per-name state survives both. Internally each bucket layout keeps one flat
tensor (no copies in the hot path); it is split into per-name pieces only when the layout
changes or for :meth:`ParamStore.state_dict`.

NaN/Inf policy (documented in docs/compression.md): a non-finite input is never folded into
the memory. The wrapper leaves the memory/momentum of that bucket unchanged; the comm hook
poisons the payload so the aggregated gradient is non-finite on *every* rank (an AMP grad
scaler or the trainer's check then skips the step) while the collective sequence stays
identical on all ranks (no hang).

No host synchronization: the decision "finite or not" is a 0-dim bool tensor on the
gradient's device (:func:`finite_flag`) and every state update is branch-free
(``torch.where``), because a ``bool(tensor)`` per bucket drains the CUDA stream in the middle
of backward and kills the overlap of communication with computation. The flag is read once
per step, after backward (:class:`StepFlags`, the trainer), where the warning is issued.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from lowcomm.compress.base import Compressor, cpu_fast
from lowcomm.compress.dgc import clip_factors, clip_segments_, clip_threshold
from lowcomm.compress.options import check_momentum
from lowcomm.errors import UsageError

if TYPE_CHECKING:  # (codec.py imports this module: the velocity lives in a ParamStore)
    from lowcomm.compress.codec import Layout


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor on ``t``'s device: True iff every entry of ``t`` is finite.

    Never synchronizes with the host (use it inside hooks). One read pass: NaN/Inf propagate
    into the sum; a sum that overflows the float range also reads as non-finite, which errs
    on the safe side (the step is skipped, the state kept). Half-precision tensors are summed
    in float32 so that ordinary values do not overflow.
    """
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.dtype in (torch.float16, torch.bfloat16):
        # min and max are finite iff every entry is (NaN propagates): one pass, and exact,
        # where a float32 sum of half values was 15x slower on the CPU
        lo, hi = torch.aminmax(t)
        return torch.isfinite(lo) & torch.isfinite(hi)
    if not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(t.sum())


def poison_(t: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Fill a floating tensor with NaN where the 0-dim flag ``finite`` is False (in place,
    branch-free); integer tensors (indices, packed sign bits) are left as they are."""
    if t.is_floating_point():
        if _on_cpu(t, finite) and finite.numel() == 1:  # reading a CPU flag costs no sync; skip the full masked pass
            if not bool(finite):
                t.fill_(float("nan"))
        else:
            t.masked_fill_(finite.logical_not(), float("nan"))
    return t


def _on_cpu(*ts: torch.Tensor) -> bool:
    """Whether every tensor is on the CPU, where a 0-dim flag may be read as a Python bool
    (no device to synchronize with): the fast paths branch there, device tensors stay
    branch-free."""
    return cpu_fast(*ts)


def keep_where_(dst: torch.Tensor, finite: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``dst <- new`` if ``finite`` else ``dst`` unchanged, without a host sync.

    ``torch.where`` and not ``dst*(1-f) + new*f``: ``NaN * 0`` is NaN, so multiplying a
    non-finite ``new`` by a zero flag would still poison ``dst``. On the CPU: a copy or
    nothing (one pass less; the same values)."""
    if _on_cpu(dst, finite, new) and finite.numel() == 1:
        if bool(finite) and new.data_ptr() != dst.data_ptr():
            dst.copy_(new)
        return dst
    return torch.where(finite, new, dst, out=dst)


def orthogonalize_if(x: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``orthogonalize(x)`` if the 0-dim flag ``finite`` holds, else ``x`` itself (non-finite,
    so the poison travels on). Branch-free: the QR always runs, on zeros when ``x`` is not
    finite, because what a LAPACK/cuSOLVER QR does with NaNs is not something to rely on."""
    from lowcomm.compress.lowrank import orthogonalize  # (lowrank imports this module)

    safe = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(finite, orthogonalize(safe), x)


def keep_where_all_(dsts: list[torch.Tensor], finite: torch.Tensor, new: torch.Tensor,
                    old: torch.Tensor | None = None) -> None:
    """:func:`keep_where_` for same-shape tensors at once: ``dsts[k] <- new[k]`` (``new``
    stacked) if ``finite``, else unchanged; ``old``: ``dsts`` already stacked (else stacked
    here). One select and one multi-tensor copy, not two ops per tensor (device paths)."""
    kept = torch.where(finite, new, torch.stack(dsts) if old is None else old)
    torch._foreach_copy_(dsts, list(kept.unbind(0)))


def warn_nonfinite(what: str) -> None:
    """The NaN policy's warning; issued once per skipped step by whoever reads the step's
    flag after backward (never from inside a hook: deciding to warn there needs a sync)."""
    warnings.warn(
        f"non-finite gradient: {what}; the aggregated gradient is non-finite on every rank "
        "so the optimizer step is skipped",
        RuntimeWarning,
        stacklevel=3,
    )


class StepFlags:
    """Device-side "was everything finite?" flags noted during one step, read once after it.

    Hooks note one flag per bucket (possibly from a communication thread: ``list.append`` is
    atomic, an in-place ``logical_or_`` on a shared tensor would race). :meth:`nonfinite`
    combines them on the device; only the caller that needs a Python bool pays the one
    host sync per step.
    """

    def __init__(self) -> None:
        self._finite: list[torch.Tensor] = []

    def clear(self) -> None:
        """Forget the flags of the previous step."""
        self._finite = []

    def note(self, finite: torch.Tensor) -> None:
        """Add one bucket's (or group's) flag."""
        self._finite.append(finite)

    def nonfinite(self) -> torch.Tensor | None:
        """0-dim bool tensor: some noted flag was False; None when nothing was noted."""
        flags = self._finite
        if not flags:
            return None
        return torch.stack(flags).all().logical_not()


class ParamStore:
    """Per-parameter tensors addressed through bucket layouts ``(names, sizes)``.

    Why per name: DDP rebuilds its buckets after the first step, the engine regroups, and a
    resume starts from the initial layout; state keyed by name survives all three."""

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

    def find(self, names: Sequence[str]) -> torch.Tensor | None:
        """The flat tensor of exactly this layout if one was made by :meth:`get`, else None."""
        hit = self._flats.get(tuple(names))
        return hit[1] if hit is not None else None

    def _split(self, key: tuple[str, ...]) -> None:
        sizes, flat = self._flats.pop(key)
        for name, piece in zip(key, flat.split(sizes)):
            self._pieces[name] = piece.clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One CPU tensor per parameter name (independent of any layout)."""
        out = {n: t.detach().cpu().clone() for n, t in self._pieces.items()}
        for key, (sizes, flat) in self._flats.items():
            for name, piece in zip(key, flat.split(sizes)):
                out[name] = piece.detach().cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`; the pieces are joined into flats on first use."""
        self._flats.clear()
        self._pieces = {n: t.detach().clone() for n, t in state.items()}

    def names(self) -> set[str]:
        """Every parameter name that has state."""
        return set(self._pieces) | {n for key in self._flats for n in key}


class Velocity:
    """Momentum correction (Lin et al., Deep Gradient Compression, ICLR'18), the part
    of :class:`~lowcomm.compress.codec.Codec` that keeps the optimizer's momentum.

    Why: with error feedback, a sparse or low-rank step delays most of the gradient; if the
    optimizer applies momentum to the *delivered* gradient, the delayed parts miss the
    momentum they would have had. Keeping the velocity ``u <- m*u + g`` in the codec and
    compressing ``u`` (error feedback on top) fixes that; the optimizer runs without momentum.
    A dense step's mean of ``u`` is exactly heavy-ball SGD (momentum is linear).
    """

    options: Any
    name: ClassVar[str]
    world: int

    def __init__(self) -> None:
        #: ``m`` of the velocity ``u <- m*u + g``; 0.0: no velocity stage. Set by the trainer or
        #: ``lowcomm.hooks.register(momentum=)`` through :meth:`set_momentum`
        self.momentum_factor = 0.0
        #: the velocity ``u`` per parameter name (checkpointed by the codec as ``velocity``)
        self.velocity = ParamStore()

    @property
    def supports_momentum(self) -> bool:
        """Whether this codec may keep the optimizer's momentum (its ``momentum_correction``
        option is on; codecs without the option never do)."""
        return bool(getattr(self.options, "momentum_correction", False))

    @property
    def clip_norm(self) -> float:
        """The ``clip`` option (DGC's local clipping), 0.0 for codecs without the option."""
        return float(getattr(self.options, "clip", 0.0) or 0.0)

    @property
    def accumulates(self) -> bool:
        """Whether :meth:`accumulate` does anything this run: a velocity, or clipping (on
        dense warm-up steps too). Transports skip the loss-scale division and the call when
        it is False."""
        return self.momentum_factor != 0.0 or self.clip_norm > 0

    def clip_(self, flat: torch.Tensor, layout: Layout) -> None:
        """DGC's local gradient clipping (option ``clip``): each tensor of ``flat`` scaled in
        place to the norm ``clip / sqrt(world)`` at most, before it is accumulated (Lin et
        al. 2018, sec. 3.2); no-op when the option is 0 or absent."""
        clip = self.clip_norm
        if clip > 0:
            clip_segments_(flat, layout.sizes, clip_threshold(clip, self.world))

    def clip_scales(self, flat: torch.Tensor, layout: Layout) -> list[float] | None:
        """The per-tensor factors :meth:`clip_` would scale ``flat``'s tensors by, read to the
        host (None when clipping is off): for a CPU encode that applies them in its own pass
        over the gradient. Host values: call it only where ``flat`` is on the CPU."""
        clip = self.clip_norm
        if clip <= 0:
            return None
        return clip_factors(flat, layout.sizes, clip_threshold(clip, self.world)).tolist()

    def set_momentum(self, m: float) -> None:
        """The optimizer's momentum ``m`` moved into the codec (trainer, engine, hooks API).

        ``m`` in [0, 1); 0 turns the velocity stage off. A codec whose momentum correction is
        off (or that has none) refuses ``m > 0``: the momentum must then stay in the optimizer."""
        check_momentum(m)
        if m > 0 and not self.supports_momentum:
            raise UsageError(
                f"compressor {self.name!r} does not keep the optimizer's momentum (momentum correction "
                "is off or not supported): keep the momentum in the optimizer and pass momentum=0")
        self.momentum_factor = float(m)

    def accumulate(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor) -> None:
        """In place: the clipping (:meth:`clip_`), then ``flat <- u = m*u + flat`` (``u``
        kept per name; a non-finite input leaves ``u`` unchanged, branch-free, and ``flat``
        non-finite); no-op when neither is on.

        Called by every transport (DDP hook, engine) on EVERY step, warm-up included, on
        UNSCALED gradients (AMP: divide by the loss scale first, multiply back after the
        mean), before :meth:`encode` / before the warm-up mean. Two elementwise passes per stage
        that is on (:meth:`~lowcomm.compress.codec.Codec.velocity_work` prices them)."""
        self.clip_(flat, layout)
        self.add_velocity(flat, layout, finite)

    def add_velocity(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor) -> None:
        """The velocity stage alone (:meth:`accumulate` without the clipping)."""
        m = self.momentum_factor
        if m == 0.0:
            return
        u = self.velocity.get(layout.names, layout.sizes, flat)
        flat.add_(u, alpha=m)
        keep_where_(u, finite, flat)

    def mask_velocity(self, layout: Layout, index: torch.Tensor, finite: torch.Tensor | None = None) -> None:
        """Momentum factor masking (DGC): ``u[index] = 0`` (flat positions in this buffer).

        No-op without velocity. ``finite`` (optional 0-dim flag): when False the velocity is
        left unchanged (branch-free), as the NaN policy wants for a non-finite step."""
        if self.momentum_factor == 0.0:
            return
        u = self.velocity.find(layout.names)
        if u is None:
            return
        idx = index.reshape(-1).long()
        if finite is None:
            u.index_fill_(0, idx, 0)
        else:
            u.index_copy_(0, idx, torch.where(finite, torch.zeros((), dtype=u.dtype, device=u.device), u[idx]))


class Direct:
    """No state: compress the input as it is (the wrappers' common interface, so a codec
    calls ``encoder.compress(flat, layout, finite)`` whichever of the three it holds)."""

    def __init__(self, inner: Compressor, *, store: ParamStore | None = None) -> None:
        self.inner = inner
        self.memory = store if store is not None else ParamStore()

    def compress(self, flat: torch.Tensor, layout: Layout,
                 finite: torch.Tensor | None = None) -> tuple[list[torch.Tensor], Any]:
        """The inner compressor's payload of ``flat`` (per tensor of ``layout``)."""
        return self.inner.compress(flat, layout.sizes)

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The payload format is the inner compressor's: so is its decode."""
        return self.inner.decompress(payload, ctx)


class ErrorFeedback(Direct):
    """Residual memory around any compressor: send ``C(g + e)``, keep ``e <- g + e - D(C(.))``.

    The memory update uses the *local* reconstruction, which is what EF-SignSGD and top-k
    with residuals prescribe. Codecs whose memory depends on the aggregate (PowerSGD,
    gTop-k) use a :class:`ParamStore` directly. A non-finite input leaves the memory
    unchanged (branch-free); the memory is finite by construction, so ``g + e`` is finite
    iff ``g`` is.
    """

    def _buffer(self, names: tuple[str, ...], like: torch.Tensor) -> torch.Tensor:
        """The compensated tensor's buffer for this layout (CPU), kept across steps: the
        message of one step is decoded before the next step encodes the same layout."""
        bufs: dict[tuple[str, ...], torch.Tensor] = self.__dict__.setdefault("_comp", {})
        buf = bufs.get(names)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = bufs[names] = torch.empty_like(like)
        return buf

    def compress(self, flat: torch.Tensor, layout: Layout,
                 finite: torch.Tensor | None = None) -> tuple[list[torch.Tensor], Any]:
        """``finite``: the caller's :func:`finite_flag` of ``flat`` (computed if None)."""
        mem = self.memory.get(layout.names, layout.sizes, flat)
        if _on_cpu(flat, mem):  # into a buffer kept per layout: no fresh pages every step
            comp = torch.add(flat, mem, out=self._buffer(layout.names, mem))
        else:
            comp = flat + mem
        if finite is None:
            finite = finite_flag(flat)
        payload, ctx = self.inner.compress(comp, layout.sizes)
        if _on_cpu(mem, finite, comp):  # the residual straight into the memory, or nothing
            if bool(finite):
                self.inner.residual(comp, payload, ctx, out=mem)
        else:
            keep_where_(mem, finite, self.inner.residual(comp, payload, ctx))
        return payload, ctx


class Momentum(Direct):
    """Compress the momentum ``m <- beta*m + (1-beta)*g`` instead of ``g`` (Signum).

    A non-finite ``g`` leaves ``m`` unchanged (branch-free); the payload is then built from
    the non-finite candidate, so it decodes non-finite as the NaN policy wants.
    """

    def __init__(self, inner: Compressor, *, beta: float, store: ParamStore | None = None) -> None:
        super().__init__(inner, store=store)
        self.beta = beta

    def compress(self, flat: torch.Tensor, layout: Layout,
                 finite: torch.Tensor | None = None) -> tuple[list[torch.Tensor], Any]:
        """``finite``: the caller's :func:`finite_flag` of ``flat`` (computed if None)."""
        mom = self.memory.get(layout.names, layout.sizes, flat)
        if finite is None:
            finite = finite_flag(flat)
        if _on_cpu(mom, finite, flat) and bool(finite):  # update the momentum in place
            mom.mul_(self.beta).add_(flat, alpha=1.0 - self.beta)
            return self.inner.compress(mom, layout.sizes)
        new = mom * self.beta
        new.add_(flat, alpha=1.0 - self.beta)
        keep_where_(mom, finite, new)
        return self.inner.compress(new, layout.sizes)

"""Low-rank payloads (ACP-SGD, PowerSGD) for the engine's fusion groups.

The engine decides *when* and *with which collective* a group travels; this module only turns
a group's flat gradient into the flat buffer to send and the summed buffer back into the
averaged gradient (tensor math from :mod:`lowcomm.compress.lowrank`, no collective here).
Per group and step:

* ``acpsgd`` (Zhang et al., ICDCS'23): one message. On P-steps every compressible matrix
  ``M = g + e`` (gradient plus local error-feedback memory) contributes ``P = M Q`` with
  ``Q = orth(last aggregated Q)``; on Q-steps ``Q = M^T P`` with ``P = orth(last aggregated
  P)``. The factors of all matrices of the group follow the group's 1-D / small tensors
  (uncompressed) in ONE buffer. Memory is local (``e <- M - P Q^T`` with the local factor), so
  the message is sum-compatible: it can be all-reduced or reduce-scattered + all-gathered.
* ``powersgd`` (Vogels et al. 2019): two dependent messages, ``[uncompressed, P]`` then
  ``Q``; the engine issues the first synchronously and the second asynchronously, both from
  the group's launch, so every rank issues them in the same order. Memory uses the
  aggregate (``e <- M - P̂ Q_sum^T / W``), so only an all-reduce schedule can carry it.

Initial factors are seeded per parameter (:func:`~lowcomm.compress.lowrank.factor_seed`,
keyed by the parameter's position in ``model.named_parameters()``): identical on every rank
without a broadcast, and the same as the DDP hooks'. Memory and factors are kept per
parameter *name* (:class:`~lowcomm.compress.feedback.ParamStore` and dicts), so regrouping
(MG-WFBP's plan, DeAR's tuning) and resuming keep them.

NaN/Inf without host syncs (see :mod:`lowcomm.compress.feedback`): finiteness is a device
flag, the message of a non-finite input is poisoned, and memory and factor updates are
``torch.where`` selections that keep the old state unless the input (and, for state that
depends on the aggregate, the summed message) is finite.

AMP: with a GradScaler attached (:meth:`LowRankCodec.attach_scaler`) the group's gradient is
divided by the loss scale before encoding, so memory and factors stay in unscaled units
across scale changes; :meth:`LowRankCodec.finish` multiplies the decoded gradient by the
scale that was divided out when the message asked for it (``allreduce`` mode: the trainer's
``scaler.unscale_`` follows), and leaves it unscaled otherwise (``dear``: the engine's own
AMP step treats the factor shards as already unscaled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lowcomm.comm.amp import current_scale
from lowcomm.compress.feedback import ParamStore, finite_flag, keep_where_, orthogonalize_if, poison_
from lowcomm.compress.lowrank import (
    effective_rank,
    factor_seed,
    matrix_shape,
    orthogonalize,
    seeded_normal,
    should_compress,
)
from lowcomm.runtime import timing
from lowcomm.sched.groups import Group

KINDS = ("acpsgd", "powersgd")


@dataclass
class Batch:
    """Same-shape matrices of one group (processed with one ``bmm``)."""

    n: int
    m: int
    r: int
    members: list[int] = field(default_factory=list)  # positions among the compressed params


@dataclass
class Layout:
    names: list[str]
    sizes: list[int]
    uncompressed: list[int]  # parameter positions in the group
    compressed: list[int]
    batches: list[Batch]


@dataclass
class Message:
    """One buffer to sum over ranks, plus what the local decode needs (never sent)."""

    buf: torch.Tensor
    name: str  # tag suffix: "P", "Q" or "unc"
    final: bool
    group: Group
    layout: Layout
    unc_numel: int
    mats: list[torch.Tensor] = field(default_factory=list)  # compensated M per batch (b, n, m)
    fixed: list[torch.Tensor] = field(default_factory=list)  # the factor not sent (ACP)
    sent: list[torch.Tensor] = field(default_factory=list)  # shapes of the sent factors
    p_step: bool = True
    finite: torch.Tensor | None = None  # device flag: this rank's input was finite
    scale: torch.Tensor | None = None  # loss scale to multiply the decoded gradient by
    unc_sum: torch.Tensor | None = None  # PowerSGD: kept from the first message
    shard: torch.Tensor | None = None  # DeAR: this rank's reduce-scattered slice of ``buf``


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        out.append(flat[off : off + t.numel()].view_as(t))
        off += t.numel()
    return out


class LowRankCodec:
    """Encode/decode of one group's gradient; state per parameter name (see module doc)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        kind: str,
        rank: int,
        start_iter: int,
        error_feedback: bool,
        min_compression_rate: float,
        seed: int,
        world: int,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown low-rank kind {kind!r}; valid: {', '.join(KINDS)}")
        self.kind = kind
        self.rank = rank
        self.start_iter = start_iter
        self.error_feedback = error_feedback
        self.min_rate = min_compression_rate
        self.seed = seed
        self.world = world
        self.param_index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self.step = 0  # completed synchronizations (warm-up included), drives P/Q alternation
        self.store = ParamStore()
        self.p: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._layouts: dict[tuple[str, ...], Layout] = {}
        #: optional ``torch.amp.GradScaler``: state is then kept in unscaled units
        self.scaler: Any = None

    def attach_scaler(self, scaler: Any) -> None:
        """Divide gradients by ``scaler``'s loss scale before encoding (None: no AMP)."""
        self.scaler = scaler

    @property
    def active(self) -> bool:
        return self.step >= self.start_iter

    # --- layout -----------------------------------------------------------------------------
    def layout(self, g: Group) -> Layout:
        key = tuple(g.names)
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        shapes = [p.shape for p in g.params]
        ok = [should_compress(s, self.rank, self.min_rate) for s in shapes]
        unc = [i for i, c in enumerate(ok) if not c]
        comp = [i for i, c in enumerate(ok) if c]
        batches: dict[tuple[int, int, int], Batch] = {}
        for j, i in enumerate(comp):
            n, m = matrix_shape(shapes[i])
            r = effective_rank(shapes[i], self.rank)
            batches.setdefault((n, m, r), Batch(n, m, r)).members.append(j)
        lay = Layout(list(g.names), [p.numel() for p in g.params], unc, comp, list(batches.values()))
        self._layouts[key] = lay
        return lay

    def message_numel(self, g: Group, p_step: bool) -> int:
        """Elements of the (last) message of a group: the analytic payload size."""
        lay = self.layout(g)
        unc = sum(lay.sizes[i] for i in lay.uncompressed)
        rows = sum(len(b.members) * (b.n if p_step else b.m) * b.r for b in lay.batches)
        return unc + rows

    def _factor(self, table: dict[str, torch.Tensor], name: str, rows: int, r: int, salt: int, like: torch.Tensor) -> torch.Tensor:
        t = table.get(name)
        if t is None or t.shape != (rows, r):
            seed = factor_seed(self.seed, self.param_index.get(name, 0), salt)
            t = seeded_normal((rows, r), seed, dtype=like.dtype, device=like.device)
        return t.to(dtype=like.dtype, device=like.device)

    # --- encode -----------------------------------------------------------------------------
    def _inputs(
        self, g: Group, lay: Layout, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """(uncompressed flat, per-matrix memory views, compensated matrices per batch, finite
        flag). ``scale``: the loss scale, divided out of ``g.flat`` in place first."""
        if scale is not None:
            g.flat[: g.numel].div_(scale)
        views = g.flat[: g.numel].split(lay.sizes)
        finite = finite_flag(g.flat[: g.numel])
        if lay.uncompressed:
            unc = torch.cat([views[i].reshape(-1) for i in lay.uncompressed])
        else:
            unc = g.flat.new_zeros(0)
        mem_views: list[torch.Tensor] = []
        if self.error_feedback and lay.compressed:
            csizes = [lay.sizes[i] for i in lay.compressed]
            mem = self.store.get([lay.names[i] for i in lay.compressed], csizes, g.flat)
            mem_views = list(mem.split(csizes))
        mats = []
        for b in lay.batches:
            ms = []
            for j in b.members:
                mat = views[lay.compressed[j]].view(b.n, b.m)
                ms.append(mat + mem_views[j].view(b.n, b.m) if mem_views else mat)
            mats.append(torch.stack(ms))
        return unc, mem_views, mats, finite

    def begin(self, g: Group, *, pad_to: int = 1, rescale: bool = True) -> Message:
        """First message of group ``g`` (its gradient is complete in ``g.flat``).

        ``rescale``: under AMP, :meth:`finish` multiplies the decoded gradient by the loss
        scale again, for a caller whose GradScaler unscales ``p.grad`` afterwards (False: it
        stays unscaled, for DeAR, which applies it itself after its own inf check).
        """
        with timing.measure("compress"):
            lay = self.layout(g)
            scale = current_scale(self.scaler, g.flat.device)
            unc, mem_views, mats, finite = self._inputs(g, lay, scale)
            if not lay.batches:
                msg = self._message(g, lay, unc, [], name="unc", final=True, finite=finite, pad_to=pad_to)
                msg.scale = scale if rescale else None
                return msg
            if self.kind == "powersgd":
                qs = [
                    torch.stack([self._factor(self.q, lay.names[lay.compressed[j]], b.m, b.r, 0, g.flat) for j in b.members])
                    for b in lay.batches
                ]
                ps = [torch.bmm(m, q) for m, q in zip(mats, qs)]
                msg = self._message(g, lay, unc, ps, name="P", final=False, finite=finite, pad_to=1)
                msg.mats = mats
                msg.scale = scale if rescale else None
                return msg
            p_step = (self.step - self.start_iter) % 2 == 0
            fixed, sent = [], []
            for b, m in zip(lay.batches, mats):
                names = [lay.names[lay.compressed[j]] for j in b.members]
                if p_step:
                    q = orthogonalize(torch.stack([self._factor(self.q, n, b.m, b.r, 0, g.flat) for n in names]))
                    fixed.append(q)
                    sent.append(torch.bmm(m, q))
                else:
                    p = orthogonalize(torch.stack([self._factor(self.p, n, b.n, b.r, 1, g.flat) for n in names]))
                    fixed.append(p)
                    sent.append(torch.bmm(m.transpose(1, 2), p))
            if mem_views:  # local error feedback: e <- M - P Q^T (local factors), if finite
                left, right = (sent, fixed) if p_step else (fixed, sent)
                for b, a, c, m in zip(lay.batches, left, right, mats):
                    for k, j in enumerate(b.members):
                        mem = mem_views[j].view(b.n, b.m)
                        keep_where_(mem, finite, torch.addmm(m[k], a[k], c[k].T, alpha=-1.0))
            msg = self._message(
                g, lay, unc, sent, name="P" if p_step else "Q", final=True, finite=finite, pad_to=pad_to
            )
            msg.fixed, msg.p_step = fixed, p_step
            msg.scale = scale if rescale else None
            return msg

    def _message(
        self,
        g: Group,
        lay: Layout,
        unc: torch.Tensor,
        factors: list[torch.Tensor],
        *,
        name: str,
        final: bool,
        finite: torch.Tensor,
        pad_to: int,
    ) -> Message:
        parts = [unc] + [f.reshape(-1) for f in factors]
        numel = sum(t.numel() for t in parts)
        padded = -(-numel // pad_to) * pad_to
        buf = g.flat.new_zeros(padded)
        if numel:
            torch.cat(parts, out=buf[:numel])
        poison_(buf, finite)  # every rank decodes non-finite: the step can be skipped
        return Message(buf, name, final, g, lay, unc.numel(), sent=factors, finite=finite)

    def advance(self, msg: Message) -> Message:
        """PowerSGD: from the summed ``[unc, P]`` message, the ``Q`` message."""
        with timing.measure("compress"):
            p_sum = _unflatten(msg.buf[msg.unc_numel :], msg.sent)
            p_ok = finite_flag(msg.buf)  # summed: the same on every rank
            p_hat = [orthogonalize_if(p, p_ok) for p in p_sum]
            qs = [torch.bmm(m.transpose(1, 2), p) for m, p in zip(msg.mats, p_hat)]
            nxt = Message(
                torch.cat([q.reshape(-1) for q in qs]),
                "Q",
                True,
                msg.group,
                msg.layout,
                0,
                mats=msg.mats,
                fixed=p_hat,
                sent=qs,
                finite=msg.finite,
                scale=msg.scale,
                unc_sum=msg.buf[: msg.unc_numel],
            )
            return nxt

    # --- decode -----------------------------------------------------------------------------
    def finish(self, msg: Message) -> None:
        """Write the averaged gradient of ``msg.group`` into its flat buffer from the summed
        (or gathered) last message; update warm-start factors (and PowerSGD's memory)."""
        with timing.measure("compress"):
            g, lay, w = msg.group, msg.layout, float(self.world)
            views = g.flat[: g.numel].split(lay.sizes)
            unc = msg.unc_sum if msg.unc_sum is not None else msg.buf[: msg.unc_numel]
            off = 0
            for i in lay.uncompressed:
                views[i].view(-1).copy_(unc[off : off + lay.sizes[i]]).div_(w)
                off += lay.sizes[i]
            if lay.batches:
                self._finish_matrices(msg, views)
            if msg.scale is not None:  # back to the units the trainer's scaler expects
                g.flat[: g.numel].mul_(msg.scale)

    def _finish_matrices(self, msg: Message, views: tuple[torch.Tensor, ...]) -> None:
        g, lay, w = msg.group, msg.layout, float(self.world)
        start = 0 if msg.unc_sum is not None else msg.unc_numel
        summed = _unflatten(msg.buf[start:], msg.sent)
        ok = finite_flag(msg.buf)  # summed over ranks: the same on every rank
        if msg.unc_sum is not None:
            ok = ok & finite_flag(msg.unc_sum)
        if self.kind == "powersgd":
            left, right = msg.fixed, summed
        else:
            left, right = (summed, msg.fixed) if msg.p_step else (msg.fixed, summed)
        mem_views: list[torch.Tensor] = []
        if self.kind == "powersgd" and self.error_feedback:
            csizes = [lay.sizes[i] for i in lay.compressed]
            mem = self.store.get([lay.names[i] for i in lay.compressed], csizes, g.flat)
            mem_views = list(mem.split(csizes))
        for b, a, c, m in zip(lay.batches, left, right, msg.mats or [None] * len(left)):
            a = a / w
            for k, j in enumerate(b.members):
                out = views[lay.compressed[j]].view(b.n, b.m)
                torch.mm(a[k], c[k].T, out=out)
                if mem_views and m is not None:  # PowerSGD: e <- M - P̂ Q_sum^T / W, if ok
                    keep_where_(mem_views[j].view(b.n, b.m), ok, m[k] - out)
        # warm start / last aggregated factor: the new one if ok, else the one this step used
        p_table = self.kind != "powersgd" and msg.p_step
        table = self.p if p_table else self.q
        for b, f in zip(lay.batches, summed):
            rows = b.n if p_table else b.m
            for k, j in enumerate(b.members):
                name = lay.names[lay.compressed[j]]
                old = self._factor(table, name, rows, b.r, 1 if p_table else 0, f)
                table[name] = torch.where(ok, f[k], old)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "memory": self.store.state_dict(),
            "p": {k: v.detach().cpu().clone() for k, v in self.p.items()},
            "q": {k: v.detach().cpu().clone() for k, v in self.q.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"low-rank state is for {state.get('kind')!r}, not {self.kind!r}")
        self.step = int(state.get("step", 0))
        self.store.load_state_dict(state.get("memory", {}))
        self.p = {k: v.clone() for k, v in state.get("p", {}).items()}
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}

    def describe(self) -> dict[str, Any]:
        return {"compress": self.kind, "rank": self.rank, "start_iter": self.start_iter, "compress_step": self.step}

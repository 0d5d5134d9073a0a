"""ACP-SGD (Zhang et al., 2023): Power-SGD's rank-r factors with the P- and Q-steps alternating
across iterations, so each step sends one factor in one all-reduce, and a local error memory.

Shares the low-rank machinery of :mod:`lowcomm.compress.lowrank` (plans, factors, messages,
masking); what is ACP-SGD's own is here: the alternation and the fused CPU encode
(clipping's scaling, velocity, compensation, product, residual and masked velocity per
cache-sized block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowcomm.compress.codec import CodecCost, Layout, Message, Work, register_codec
from lowcomm.compress.feedback import finite_flag, keep_where_, keep_where_all_
from lowcomm.compress.lowrank import LowRankCodec, LowRankOptions, _cpu_true, _Step
from lowcomm.compress.matrices import Plan, batched_mm, fused_step, orthogonalize_all, unflatten


@dataclass
class ACPSGDOptions(LowRankOptions):
    """acpsgd: the base's options and defaults, ``start_iter="min(1.5ep,10%)"`` included.

    ACP-SGD had a longer default warm-up, ``"20%"``, against the accuracy dip its one-step-
    stale basis has when compression starts at a high learning rate. With momentum
    correction, subspace masking and local clipping, which came later, the common warm-up is
    enough, and the dense steps run at S-SGD's speed, so on a slow link they were most of the
    time to accuracy. Measured on MNIST-1D cnn1d (256 channels, 4 workers; docs/compression.md,
    seventh round): 15 epochs, 3 seeds, 92.97 % against ssgd's 94.20 % with 24 dense steps
    (this default's and ``"10%"``'s there; ``"5%"``: 92.20 %); time to 99 % of ssgd's accuracy
    at 100 Mbit/s emulated 2.2-2.6x sooner than ssgd at 20 epochs with ``"10%"`` (seeds 0-2),
    against 1.71x with ``"20%"``."""


@dataclass
class _Pending:
    """What :meth:`ACPSGDCodec.accumulate` left to the fused encode: the buffer and its flag,
    whether the velocity stage is due, and the clipping factor per tensor (None: no clipping)."""

    flat: torch.Tensor
    finite: torch.Tensor
    stage: bool
    scales: list[float] | None


@register_codec
class ACPSGDCodec(LowRankCodec):
    """ACP-SGD: one message per step, P- and Q-steps alternating; local memory."""

    name = "acpsgd"
    step_cycle = 2  # a P-step, then a Q-step
    Options = ACPSGDOptions
    summary = "ACP-SGD: rank-r P or Q alternately, one all-reduce per step, error feedback"
    caveat = ("lossy like Power-SGD: needs error feedback and warm-up steps; alternating P/Q converges "
              "slightly differently, check the rank on your task.")

    def __init__(self, options: Any = None, *, world: int = 1, rank: int = 0) -> None:
        super().__init__(options, world=world, rank=rank)
        #: clipping and velocity stages deferred into the fused encode, per layout
        self._deferred: dict[tuple[str, ...], _Pending] = {}

    def _fusable(self, flat: torch.Tensor, finite: torch.Tensor) -> bool:
        """Whether :meth:`encode` takes the fused CPU form for this buffer and flag."""
        return bool(self.options.error_feedback) and flat.is_contiguous() and _cpu_true(finite, flat)

    def accumulate(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor) -> None:
        """The clipping and the velocity stage; on a compressed CPU step whose encode will be
        fused, deferred into that encode (:meth:`_encode_fused`: each tensor scaled by its
        clipping factor as it is read, ``u <- g + m u`` block by block with the rest, instead
        of the clipping's scaling pass and two full passes over ``g`` and ``u`` before it).
        The clipping's norms need the whole tensors, so they are taken here (one read).

        Why safe: every transport calls :meth:`encode` on the same buffer right after this
        on compressed steps (warm-up steps are not deferred), and what the fused encode
        leaves in the buffer's matrices (the raw gradient, not the clipped velocity) is read
        by no one before :meth:`decode` overwrites it with the mean."""
        stage = self.momentum_factor != 0.0
        if (stage or self.clip_norm > 0) and self.active and self._fusable(flat, finite):
            self._deferred[layout.names] = _Pending(flat, finite, stage, self.clip_scales(flat, layout))
            return
        super().accumulate(flat, layout, finite)

    def _undefer(self, flat: torch.Tensor, layout: Layout) -> _Pending | None:
        """What :meth:`accumulate` deferred for ``flat`` (None: nothing); one deferred for
        another buffer (no transport does that) is applied now, the plain way."""
        pending = self._deferred.pop(layout.names, None)
        if pending is None:
            return None
        if pending.flat.data_ptr() == flat.data_ptr() and pending.flat.numel() == flat.numel():
            return pending
        super().accumulate(pending.flat, layout, pending.finite)  # (that buffer is as it came)
        return None

    def encode_work(self, plan: Plan, dense: int, flops: float, p: bool) -> Work:
        """Orthogonalize the fixed factor, multiply, and the local residual (a second product)."""
        return Work(orthogonalize=plan.factor_numel(not p), matmul_flops=2 * flops, elementwise=2 * dense)

    def decode_work(self, dense: int, flops: float) -> Work:
        """Rebuild the matrices from the summed and the fixed factor."""
        return Work(matmul_flops=flops)

    def p_step(self, step: int) -> bool:
        """Whether ``step`` (the codec's step counter) sends P."""
        return (step - self.start_iter) % 2 == 0

    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *, pad_to: int = 1) -> Message:
        """P-step: ``[uncompressed, M orth(Q_last)]``; Q-step: ``[uncompressed, M^T orth(P_last)]``."""
        pending = self._undefer(flat, layout)  # (only ever for a buffer that is _fusable)
        if pending is not None or self._fusable(flat, finite):
            return self._encode_fused(flat, layout, finite, pad_to, pending)
        st = self.inputs(flat, layout, finite)
        if not st.plan.batches:
            return self.message(st, [], name="unc", final=True, pad_to=pad_to)
        p = st.p_step = self.p_step(self.step)
        fixed_table, sent_table = (self.q, self.p) if p else (self.p, self.q)
        st.fixed = orthogonalize_all([self.factors(fixed_table, layout, st.plan, b, not p, flat) for b in st.plan.batches])
        st.start = [self.factors(sent_table, layout, st.plan, b, p, flat) for b in st.plan.batches]
        sent = [batched_mm(m, f, transpose=not p) for m, f in zip(st.mats, st.fixed)]
        self.mask_sent(st, right=p, ok=finite)
        if st.mem:  # local error feedback: e <- M - P Q^T (local factors), if finite
            for b, s, f, ms in zip(st.plan.batches, sent, st.fixed, st.mats):
                left, right = (s, f) if p else (f, s)
                mem = [st.mem[j].view(b.n, b.m) for j in b.members]
                if isinstance(ms, torch.Tensor) and len(b.members) > 1:  # stacked: one product, one select
                    res = torch.baddbmm(ms, left, right.transpose(1, 2), alpha=-1.0)
                    keep_where_all_(mem, finite, res)
                    continue
                for k in range(len(b.members)):
                    keep_where_(mem[k], finite, torch.addmm(ms[k], left[k], right[k].T, alpha=-1.0))
        return self.message(st, sent, name="P" if p else "Q", final=True, pad_to=pad_to)

    def _encode_fused(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, pad_to: int,
                      pending: _Pending | None = None) -> Message:
        """:meth:`encode` on CPU with a finite input and error feedback: one pass per matrix.

        Why: a P-step's ``P = M F`` row ``i`` needs only row ``i`` of ``M = g + e`` and its
        residual ``e <- M - P F^T`` row ``i`` only that row of ``P``; a Q-step's ``Q = M^T F``
        and residual likewise split by columns. So, block by cache-sized block (:data:`~lowcomm.compress.matrices.BLOCK`
        elements), ``e += g``, the block's part of the factor, and the block's residual run
        while the block is in cache: ``g`` and ``e`` are read and ``e`` written once, where
        the unfused form reads ``M`` three times and writes it twice. ``M`` is formed in the
        memory (``flat`` is left as it came). The same values as :meth:`encode` up to float
        summation order (the factor is a sum over the matrix's other side). A loop over
        blocks, not elements: three BLAS/vector calls per block.

        ``pending``: :meth:`accumulate` was deferred here: the uncompressed tensors are clipped
        and get the velocity stage first (they are small), the matrices block by block (``g``
        scaled by its clipping factor as it is read, ``u <- g + m u``, then ``e += u``), so
        ``g`` and ``u`` are read once instead of three times."""
        plan = self.plan(layout)
        sizes = layout.sizes
        views = flat.split(sizes)
        velocity = pending is not None and pending.stage
        scales = pending.scales if pending is not None else None
        if scales is not None and plan.uncompressed:
            torch._foreach_mul_([views[i] for i in plan.uncompressed], [scales[i] for i in plan.uncompressed])
        mom = self.momentum_factor if velocity else None
        vel = self.velocity.get(layout.names, sizes, flat) if velocity else None
        if vel is not None:
            vviews = vel.split(sizes)
            for i in plan.uncompressed:  # (a few small tensors: 1-d, or not worth compressing)
                vviews[i].copy_(views[i].add_(vviews[i], alpha=self.momentum_factor))
        unc = torch.cat([views[i].reshape(-1) for i in plan.uncompressed]) if plan.uncompressed else flat.new_zeros(0)
        csizes = [sizes[i] for i in plan.compressed]
        mem = list(self.store.get([layout.names[i] for i in plan.compressed], csizes, flat).split(csizes)) \
            if plan.compressed else []
        st = _Step(layout, plan, unc, [], mem, finite)
        if not plan.batches:
            return self.message(st, [], name="unc", final=True, pad_to=pad_to)
        p = st.p_step = self.p_step(self.step)
        fixed_table, sent_table = (self.q, self.p) if p else (self.p, self.q)
        st.fixed = orthogonalize_all([self.factors(fixed_table, layout, plan, b, not p, flat) for b in plan.batches])
        st.start = [self.factors(sent_table, layout, plan, b, p, flat) for b in plan.batches]
        masking = self.momentum_factor != 0.0 and bool(self.options.momentum_masking)
        u = vel if vel is not None else self.velocity.find(layout.names) if masking else None
        uviews = u.split(sizes) if u is not None else None
        sent = []
        for b, fixed in zip(plan.batches, st.fixed):
            out = flat.new_empty(len(b.members), b.n if p else b.m, b.r)
            for k, j in enumerate(b.members):  # (matrices of one shape are not adjacent in flat)
                i = plan.compressed[j]
                um = uviews[i].view(b.n, b.m) if uviews is not None else None
                fused_step(views[i].view(b.n, b.m), mem[j].view(b.n, b.m), fixed[k], out[k], rows=p, velocity=um,
                           momentum=mom, mask=masking, scale=scales[i] if scales is not None else 1.0)
            sent.append(out)
        return self.message(st, sent, name="P" if p else "Q", final=True, pad_to=pad_to)

    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """``P_sum Q^T / W`` (or ``P Q_sum^T / W``); the summed factor kept where finite."""
        st: _Step = msg.ctx
        if not st.plan.batches:
            return self.decode_uncompressed(msg, received, out)
        unc = st.unc.numel()
        summed = unflatten(received[unc : msg.numel], st.sent)
        left, right = (summed, st.fixed) if st.p_step else (st.fixed, summed)
        self.write(out, st, received[:unc], left, right)
        self.store_factors(self.p if st.p_step else self.q, st, summed, finite_flag(received[: msg.numel]))

    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None) -> CodecCost:
        """``4 (U + sum n_i r_i)`` on P-steps, ``4 (U + sum m_i r_i)`` on Q-steps; ``step=None``:
        the mean of the two (bytes rounded down)."""
        if step is not None:
            return self.cost_of(shapes, [self.p_step(step)], dtype_bytes)
        p, q = self.cost_of(shapes, [True], dtype_bytes), self.cost_of(shapes, [False], dtype_bytes)
        for rp, rq in zip(p.rounds, q.rounds):
            rp.nbytes = (rp.nbytes + rq.nbytes) // 2
        return p


"""Low-rank codecs: ``powersgd`` (two all-reduces, P then Q) and ``acpsgd`` (one, alternating).

The one low-rank implementation, carried by the DDP hooks and the scheduling engine alike.
Per fused buffer (a DDP bucket or an engine group): tensors that :func:`should_compress`
accepts are viewed as ``n x m`` matrices and batched by ``(n, m, r)`` (same-shape matrices go
through one ``bmm``; groups of large matrices stay a list of views instead of being stacked,
so the gradient is not copied: the product is bandwidth-bound anyway); the rest (1-D tensors,
small matrices) travel uncompressed in the *same* message, ahead of the factors.
Error-feedback memory and factors are kept per parameter name
(:class:`~lowcomm.compress.feedback.ParamStore`, dicts), so DDP's bucket rebuild, the
engine's regrouping and a resume with another layout keep them. Initial factors are seeded
per parameter (:func:`factor_seed` of the parameter's position in
``model.named_parameters()``): identical on every rank without a broadcast.

* ``powersgd`` (Vogels et al. 2019): ``P = M Q`` summed (with the uncompressed tensors),
  orthogonalized, ``Q = M^T P`` summed; mean ``= P Q_sum^T / W``. Memory uses the aggregate
  (``e <- M - P Q_sum^T / W``, as the paper and PyTorch's hook). ``warm_start`` keeps the
  summed Q for the next step (off: a fresh seeded Q every step). Two dependent messages:
  ``multi_round``.
* ``acpsgd`` (Zhang et al., ICDCS'23): one message per step, alternating by
  ``(step - start_iter) % 2``. P-steps send ``P = M orth(Q_last)``, Q-steps
  ``Q = M^T orth(P_last)`` where ``*_last`` is the last aggregated factor (always a warm
  start). Memory is local (``e <- M - P Q^T`` with the local factor), so the message is
  sum-compatible and may be reduce-scattered (DeAR).

NaN/Inf without host syncs: the message of a non-finite input is poisoned, memory and
factor updates are ``torch.where`` selections, a non-finite aggregate is never
orthogonalized (:func:`~lowcomm.compress.feedback.orthogonalize_if`).

CPU paths (issue 18; a CPU flag is read on the host at no cost, device tensors keep the
branch-free forms above): products with a factor take the form that streams the matrix
once (:func:`~lowcomm.compress.matrices.batched_mm`); residuals and momentum masking are
written in place (one gemm each, no temporaries, no ``where`` pass); ACP-SGD's encode adds
``g`` into the memory, forms its factor, its residual and the masked velocity block by
block while the block is in cache (:meth:`ACPSGDCodec._encode_fused`). The results equal
the device paths' up to float summation order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm.compress.codec import Aggregation, Codec, CodecCost, Layout, Message, Round, Work, register_codec
from lowcomm.compress.feedback import ParamStore, finite_flag, keep_where_, keep_where_all_, poison_
from lowcomm.compress.matrices import (
    STACK_MAX_NUMEL,
    Batch,
    Batched,
    Plan,
    batched_mm,
    effective_rank,
    factor_seed,
    mask_,
    matrix_shape,
    orthogonalize,
    orthogonalize_all,
    outer_,
    rebuild_,
    seeded_normal,
    should_compress,
    unflatten,
)
from lowcomm.compress.options import Duration, check_clip, check_min_rate, check_rank, check_start
from lowcomm.compress.selection import cpu_fast

__all__ = [  # the tensor math is re-exported: callers import it from here
    "Batch", "Batched", "LowRankCodec", "LowRankOptions", "Plan", "PowerSGDCodec", "PowerSGDOptions", "STACK_MAX_NUMEL", "batched_mm", "effective_rank", "factor_seed",
    "matrix_shape", "orthogonalize", "orthogonalize_all", "seeded_normal", "should_compress", "unflatten",
]


def _cpu_true(flag: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``like`` is a CPU tensor and the CPU 0-dim ``flag`` holds. Reading a CPU flag
    costs no device synchronization, so the CPU paths branch on it (in-place updates, no
    ``torch.where`` pass); device tensors keep the branch-free forms."""
    return cpu_fast(like, flag) and bool(flag)


# --- options and plans -------------------------------------------------------------------------
@dataclass
class LowRankOptions:
    """The low-rank codecs' common options (acpsgd's and powersgd's add to them): rank, warm-up (a duration: steps, ``"2ep"``,
    ``"5%"``), memory, which tensors to compress (``min_compression_rate``), the seed of the
    initial factors, ``momentum_correction`` (the optimizer's momentum kept in the codec,
    :class:`~lowcomm.compress.feedback.Velocity`) and ``momentum_masking`` (the part of the
    velocity a step sent is removed from it: :meth:`LowRankCodec.mask_sent`) and ``clip``
    (Deep Gradient Compression's local clipping, as on topk: each worker clips every gradient
    tensor to the norm ``clip / sqrt(workers)`` before accumulating it; 0: off). Default 1.0:
    on MNIST-1D cnn1d (256 channels, 20 epochs, seeds 0-2) it ended Power-SGD 0.5-1.6 points
    higher (94.9 / 95.5 / 94.8 % against 94.4 / 94.5 / 93.2 %) and ACP-SGD 0.4-1.0 higher
    (its dip after compression starts stays: 10-17 points; docs/compression.md).

    ``start_iter`` defaults to ``"min(1.5ep,10%)"``: 10 % of a short run, at most 1.5 epochs
    of a long one. The dense steps run at S-SGD's speed, so a warm-up that grows with the run
    (the former ``"10%"``: 4 dense epochs of 40) was most of the time to accuracy on a slow
    link; the early transient it protects the error memory from does not grow with the run.
    Measured (MNIST-1D cnn1d 256 channels, 4 workers, 100 Mbit/s emulated; docs/compression.md,
    seventh round; the same steps as ``"10%"`` at 15 epochs, so those rows hold)."""

    rank: int = 4
    start_iter: Duration = "min(1.5ep,10%)"
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0
    momentum_correction: bool = True
    momentum_masking: bool = True
    clip: float = 1.0

    def __post_init__(self) -> None:
        check_rank(self.rank)
        self.start_iter = check_start(self.start_iter)
        check_min_rate(self.min_compression_rate)
        check_clip(self.clip)


@dataclass
class PowerSGDOptions(LowRankOptions):
    """powersgd adds ``warm_start`` (keep the summed Q for the next step)."""

    warm_start: bool = True


@dataclass
class _Step:
    """What the decode of one buffer's message needs (the messages' ``ctx``, never sent)."""

    layout: Layout
    plan: Plan
    unc: torch.Tensor  # this worker's uncompressed tensors, flat
    mats: list[Batched]  # compensated M per batch
    mem: list[torch.Tensor]  # per compressed tensor: memory views (empty without EF)
    finite: torch.Tensor
    sent: list[torch.Tensor] = field(default_factory=list)  # the factors sent (shapes)
    fixed: list[torch.Tensor] = field(default_factory=list)  # the factor not sent
    start: list[torch.Tensor] = field(default_factory=list)  # table factors this step began from
    p_step: bool = True
    unc_sum: torch.Tensor | None = None  # PowerSGD: kept from the P message
    p_ok: torch.Tensor | None = None


class LowRankCodec(Codec):
    """Shared plan, factor tables, inputs, writes and state of the two low-rank codecs."""

    compiled_kernels = ("lowrankjit",)

    Options = LowRankOptions
    aggregation = Aggregation.SUM
    stateful = True

    def __init__(self, options: Any = None, *, world: int = 1, rank: int = 0) -> None:
        super().__init__(options, world=world, rank=rank)
        self.store = ParamStore()
        self.p: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple[str, ...], Plan] = {}

    def plan(self, layout: Layout) -> Plan:
        """The (cached) plan of a buffer layout."""
        hit = self._plans.get(layout.names)
        if hit is None:
            hit = self._plans[layout.names] = Plan.of(layout.shapes, self.options.rank, self.options.min_compression_rate)
        return hit

    def factors(self, table: Mapping[str, torch.Tensor], layout: Layout, plan: Plan, b: Batch, p: bool,
                like: torch.Tensor, salt: int | None = None) -> torch.Tensor:
        """Stacked table factors of batch ``b`` (P: ``n x r``, Q: ``m x r``), seeded where missing."""
        rows, out = (b.n if p else b.m), []
        for j in b.members:
            i = plan.compressed[j]
            t = table.get(layout.names[i])
            if t is None or t.shape != (rows, b.r):
                s = factor_seed(self.options.seed, layout.index[i], int(p) if salt is None else salt)
                t = seeded_normal((rows, b.r), s, dtype=like.dtype, device=like.device)
            out.append(t.to(dtype=like.dtype, device=like.device))
        return torch.stack(out)

    def store_factors(self, table: dict[str, torch.Tensor], st: _Step, new: list[torch.Tensor],
                      ok: torch.Tensor) -> None:
        """``table[name] <- new`` where ``ok``, else the factor this step began from."""
        for b, f, old in zip(st.plan.batches, new, st.start):
            kept = torch.where(ok, f, old)  # one op per batch (entries are its rows, never written)
            for k, j in enumerate(b.members):
                table[st.layout.names[st.plan.compressed[j]]] = kept[k]

    def inputs(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor) -> _Step:
        """Compensate the matrices in place in ``flat`` (``M = g + e``); copy the rest."""
        plan = self.plan(layout)
        sizes = layout.sizes
        views = flat.split(sizes)
        unc = torch.cat([views[i].reshape(-1) for i in plan.uncompressed]) if plan.uncompressed else flat.new_zeros(0)
        mem: list[torch.Tensor] = []
        if self.options.error_feedback and plan.compressed:
            csizes = [sizes[i] for i in plan.compressed]
            mem = list(self.store.get([layout.names[i] for i in plan.compressed], csizes, flat).split(csizes))
            # one multi-tensor op, not one launch per matrix (a GPU's encode is launch-bound)
            torch._foreach_add_([views[i].view(-1) for i in plan.compressed], mem)
        mats: list[Batched] = []
        for b in plan.batches:
            ms = [views[plan.compressed[j]].view(b.n, b.m) for j in b.members]
            mats.append(ms[0].unsqueeze(0) if len(ms) == 1 else torch.stack(ms) if b.n * b.m <= STACK_MAX_NUMEL else ms)
        return _Step(layout, plan, unc, mats, mem, finite)

    def message(self, st: _Step, factors: list[torch.Tensor], *, name: str, final: bool, pad_to: int = 1,
                with_unc: bool = True) -> Message:
        """One buffer ``[uncompressed, factors...]`` (zero-padded to ``pad_to``), poisoned if
        this worker's input was not finite; ``st.sent`` becomes the factors."""
        parts = ([st.unc] if with_unc else []) + [f.reshape(-1) for f in factors]
        numel = sum(t.numel() for t in parts)
        buf = st.unc.new_zeros(-(-numel // pad_to) * pad_to)
        if numel:
            torch.cat(parts, out=buf[:numel])
        st.sent = factors
        return Message(poison_(buf, st.finite), "all_reduce", final=final, name=name, ctx=st, numel=numel)

    def write(self, out: torch.Tensor, st: _Step, unc_sum: torch.Tensor, left: list[torch.Tensor],
              right: list[torch.Tensor], memory: list[torch.Tensor] | None = None,
              ok: torch.Tensor | None = None) -> None:
        """``out`` <- the mean: uncompressed sums / W, matrices ``left @ right^T / W`` written
        in place (the 1/W goes on the small left factor). With ``memory`` (views per
        compressed tensor), first store the residual ``M - left @ right^T / W`` there, only
        where the 0-dim flag ``ok`` holds (None: always; ``M`` may alias ``out``, hence the
        order).

        Device paths: a batch of small same-shape matrices (stacked in :meth:`inputs`) is
        written with one ``bmm`` and multi-tensor copies instead of one product (and one
        residual and one select) per matrix: a GPU's decode is bound by kernel launches."""
        sizes = st.layout.sizes  # (a property that recomputes: once, not per tensor)
        views = out.split(sizes)
        blocked = memory is not None and ok is None and cpu_fast(out)  # one product per block for both
        for i, (b, a, c) in enumerate(zip(st.plan.batches, left, right)):
            a = a / self.world
            mats = st.mats[i] if st.mats else None  # (the fused CPU encode keeps none; no residual then)
            targets = [views[st.plan.compressed[j]].view(b.n, b.m) for j in b.members]
            if isinstance(mats, torch.Tensor) and len(b.members) > 1 and not cpu_fast(out):
                prod = torch.bmm(a, c.transpose(1, 2))
                if memory is not None:
                    mem = [memory[j].view(b.n, b.m) for j in b.members]
                    if ok is None:
                        torch._foreach_copy_(mem, list((mats - prod).unbind(0)))
                    else:
                        keep_where_all_(mem, ok, mats - prod)
                torch._foreach_copy_(targets, list(prod.unbind(0)))
                continue
            for k, j in enumerate(b.members):
                if memory is not None:
                    assert mats is not None  # (the residual needs the matrices)
                    res = memory[j].view(b.n, b.m)
                    if blocked:
                        rebuild_(targets[k], mats[k], a[k], c[k], res)
                        continue
                    if ok is None:
                        torch.addmm(mats[k], a[k], c[k].T, alpha=-1.0, out=res)
                    else:
                        keep_where_(res, ok, torch.addmm(mats[k], a[k], c[k].T, alpha=-1.0))
                outer_(targets[k], a[k], c[k])
        if st.plan.uncompressed:  # one division and one multi-tensor copy, not two ops per tensor
            usizes = [sizes[i] for i in st.plan.uncompressed]
            mean = (unc_sum[: sum(usizes)] / self.world).split(usizes)
            torch._foreach_copy_([views[i].view(-1) for i in st.plan.uncompressed], list(mean))

    def decode_uncompressed(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """A buffer without compressible matrices: the summed tensors / W."""
        self.write(out, msg.ctx, received[: msg.numel], [], [])

    def mask_sent(self, st: _Step, *, right: bool, ok: torch.Tensor) -> None:
        """Momentum factor masking for low rank (DGC's masking carried to subspaces).

        Why: with momentum correction the codec compresses the velocity ``u``; what a step
        sends of a matrix is its projection on the orthonormal basis ``F = st.fixed`` (right:
        ``u F F^T``, ACP-SGD's P-steps; left: ``F F^T u``, Power-SGD and ACP-SGD's Q-steps).
        Left in ``u``, that part would be sent again and again by the following steps (it is
        already in the update): DGC clears the sent coordinates of a sparse ``u`` for the
        same reason. Measured on MNIST-1D cnn1d (256 channels, 15 epochs): Power-SGD 91.6 %
        without momentum correction, 88.8 % with it unmasked, 94.5 % masked (docs/compression.md).
        Uncompressed tensors are sent whole every step and keep their velocity (heavy ball).
        Branch-free: where ``ok`` is False (a non-finite step) ``u`` is unchanged."""
        if self.momentum_factor == 0.0 or not self.options.momentum_masking:
            return
        u = self.velocity.find(st.layout.names)
        if u is None:
            return
        views = u.split(st.layout.sizes)
        inplace = _cpu_true(ok, u)  # ``u -= sent`` block by block in cache, no temporaries
        for b, basis in zip(st.plan.batches, st.fixed):
            if not inplace and len(b.members) > 1 and b.n * b.m <= STACK_MAX_NUMEL:
                # device paths: the batch's small matrices in one stacked product, one select
                # and one multi-tensor copy instead of four ops per matrix (launch-bound GPU)
                ums = [views[st.plan.compressed[j]].view(b.n, b.m) for j in b.members]
                stacked = torch.stack(ums)
                sent = (torch.bmm(torch.bmm(stacked, basis), basis.transpose(1, 2)) if right else
                        torch.bmm(basis, torch.bmm(basis.transpose(1, 2), stacked)))
                keep_where_all_(ums, ok, stacked - sent, old=stacked)
                continue
            for k, j in enumerate(b.members):
                um, f = views[st.plan.compressed[j]].view(b.n, b.m), basis[k]
                if inplace:
                    mask_(um, f, right=right)
                    continue
                sent = torch.mm(torch.mm(um, f), f.T) if right else torch.mm(f, torch.mm(f.T, um))
                keep_where_(um, ok, um - sent)

    def cost_of(self, shapes: Sequence[Sequence[int]], p_factors: Sequence[bool], dtype_bytes: int) -> CodecCost:
        """Bytes of messages carrying the uncompressed tensors, then the factors named (P:
        True); the work of :meth:`encode` (with the velocity's, when momentum correction is
        on, and the clipping's), of each :meth:`advance` and of :meth:`decode`."""
        plan = Plan.of(shapes, self.options.rank, self.options.min_compression_rate)
        unc = plan.unc_numel(shapes)
        velocity = self.velocity_work(shapes)  # (and the clipping's)
        if not plan.batches:
            return CodecCost(velocity, [Round("all_reduce", unc * dtype_bytes)])
        dense, flops = sum(math.prod(s) for s in shapes) - unc, plan.flops()
        if self.momentum_factor != 0.0 and self.options.momentum_masking:  # mask_sent: two products
            velocity = velocity + Work(matmul_flops=2 * flops, elementwise=dense)
        rounds = [Round("all_reduce", (plan.factor_numel(p) + (unc if i == 0 else 0)) * dtype_bytes,
                        Work(orthogonalize=plan.factor_numel(p), matmul_flops=flops), blocking=True)
                  for i, p in enumerate(p_factors)]
        rounds[-1].then, rounds[-1].blocking = self.decode_work(dense, flops), False
        return CodecCost(self.encode_work(plan, dense, flops, p_factors[0]) + velocity, rounds)

    def encode_work(self, plan: Plan, dense: int, flops: float, p: bool) -> Work:
        """Compensate the matrices and multiply by the starting factor."""
        return Work(elementwise=dense, matmul_flops=flops)

    def decode_work(self, dense: int, flops: float) -> Work:
        """Rebuild the matrices from the two factors."""
        return Work(matmul_flops=flops, elementwise=dense)

    def state_dict(self) -> dict[str, Any]:
        """Step, error-feedback ``memory`` and the factor tables ``p`` / ``q`` (per name)."""
        return {**super().state_dict(), "memory": self.store.state_dict(),
                "p": {k: v.detach().cpu().clone() for k, v in self.p.items()},
                "q": {k: v.detach().cpu().clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        super().load_state_dict(state)
        self.store.load_state_dict(dict(state.get("memory", {})))
        self.p = {k: v.clone() for k, v in state.get("p", {}).items()}
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}


@register_codec
class PowerSGDCodec(LowRankCodec):
    """PowerSGD: ``[uncompressed, P]`` summed, orthogonalized; ``Q`` summed; memory from the
    aggregate; warm start optional."""

    name = "powersgd"
    summary = "PowerSGD: rank-r P then Q, two dependent all-reduces, error feedback"
    caveat = ("lossy: needs error feedback (on by default) and a few full-precision warm-up steps "
              "(start_iter); too small a rank can cost accuracy.")
    Options = PowerSGDOptions
    multi_round = True

    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *, pad_to: int = 1) -> Message:
        """``[uncompressed, P = M Q]`` (final only when nothing is compressible)."""
        st = self.inputs(flat, layout, finite)
        if not st.plan.batches:
            return self.message(st, [], name="unc", final=True, pad_to=pad_to)
        warm = self.options.warm_start
        table = self.q if warm else {}
        salt = None if warm else 2 * (self.step + 1) * 1_000_003
        st.start = [self.factors(table, layout, st.plan, b, False, flat, salt) for b in st.plan.batches]
        return self.message(st, [batched_mm(m, q) for m, q in zip(st.mats, st.start)], name="P", final=False)

    def advance(self, msg: Message, received: torch.Tensor) -> Message:
        """From the summed P: ``Q = M^T orth(P)``."""
        st: _Step = msg.ctx
        unc = st.unc.numel()
        st.unc_sum, st.p_ok = received[:unc], finite_flag(received[: msg.numel])
        st.fixed = orthogonalize_all(unflatten(received[unc : msg.numel], st.sent), st.p_ok)
        qs = [batched_mm(m, p, transpose=True) for m, p in zip(st.mats, st.fixed)]
        self.mask_sent(st, right=False, ok=st.p_ok & st.finite)
        return self.message(st, qs, name="Q", final=True, with_unc=False)

    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """``P Q_sum^T / W``; memory ``M - that`` and the warm-start Q where all was finite."""
        st: _Step = msg.ctx
        if st.unc_sum is None:
            return self.decode_uncompressed(msg, received, out)
        q_sum = unflatten(received[: msg.numel], st.sent)
        ok = (st.p_ok if st.p_ok is not None else st.finite) & finite_flag(received[: msg.numel])
        if st.mem and _cpu_true(ok, out):  # the residual straight into the memory (no copy)
            self.write(out, st, st.unc_sum, st.fixed, q_sum, st.mem)
        else:  # the residual kept only where everything was finite, without a host read
            self.write(out, st, st.unc_sum, st.fixed, q_sum, st.mem or None, ok)
        if self.options.warm_start:
            self.store_factors(self.q, st, q_sum, ok)

    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None) -> CodecCost:
        """``4 (U + sum n_i r_i)`` then ``4 sum m_i r_i`` bytes (U: uncompressed elements)."""
        return self.cost_of(shapes, [True, False], dtype_bytes)

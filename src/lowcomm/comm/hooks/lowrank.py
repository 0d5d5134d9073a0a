"""Low-rank hooks: ``powersgd`` (two all-reduces, P then Q) and ``acpsgd`` (one, alternating).

Shared layout per bucket: tensors that :func:`~lowcomm.compress.lowrank.should_compress`
accepts are viewed as ``n x m`` matrices and batched by ``(n, m, r)`` (same-shape matrices go
through one ``bmm``); the rest (1-D tensors, small matrices) travel uncompressed in the
*same* all-reduce buffer, ahead of the factors. Error-feedback memory and factors are kept
per parameter name (:class:`~lowcomm.compress.feedback.ParamStore`, plain dicts), so DDP's
bucket rebuild and a resume with a different bucket layout keep them.

PowerSGD needs Q from the all-reduced P, so its hook waits for the P all-reduce *inside the
hook call* and then issues the Q all-reduce from the hook too (never from a callback; see
:mod:`lowcomm.comm.hooks.state`). ACP-SGD sends only one factor per step, so its hook never
waits: one all-reduce per bucket per step, decoded in the callback.

NaN/Inf and AMP (no host sync in the hook): finiteness is a device flag; memory and factor
updates are ``torch.where`` selections, a non-finite aggregate is never orthogonalized (its
QR runs on zeros and the result is discarded), and under a GradScaler the bucket is divided
by the loss scale first, so memory and factors are in unscaled units, and the decoded
gradient is multiplied by it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.comm.hooks.options import LowRankOptions, PowerSGDOptions
from lowcomm.comm.hooks.state import Future, HookState
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


@dataclass
class Group:
    """Same-shape matrices of one bucket, batched."""

    n: int
    m: int
    r: int
    members: list[int] = field(default_factory=list)  # positions in the compressed list


@dataclass
class Plan:
    names: list[str]
    sizes: list[int]
    uncompressed: list[int]  # parameter positions in the bucket
    compressed: list[int]
    groups: list[Group]


STACK_MAX_NUMEL = 1 << 16


def mm_right(ms: Any, f: torch.Tensor) -> torch.Tensor:
    """``M @ f`` for a batched group (stacked tensor or list of views) -> ``(b, n, r)``."""
    if isinstance(ms, torch.Tensor):
        return torch.bmm(ms, f)
    return torch.stack([m @ f[k] for k, m in enumerate(ms)])


def mm_left_t(ms: Any, f: torch.Tensor) -> torch.Tensor:
    """``M^T @ f`` for a batched group -> ``(b, m, r)``."""
    if isinstance(ms, torch.Tensor):
        return torch.bmm(ms.transpose(1, 2), f)
    return torch.stack([m.T @ f[k] for k, m in enumerate(ms)])


class LowRankHook(HookState):
    Options = LowRankOptions

    def __init__(self, ddp: Any, options: Any, *, process_group: Any = None) -> None:
        super().__init__(ddp, options, process_group=process_group)
        self.store = ParamStore()
        self.p: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple[str, ...], Plan] = {}

    # --- layout ---------------------------------------------------------------------------
    def plan(self, bucket: dist.GradBucket) -> Plan:
        names, sizes, shapes = self.layout(bucket)
        key = tuple(names)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        o = self.options
        unc = [i for i, s in enumerate(shapes) if not should_compress(s, o.rank, o.min_compression_rate)]
        comp = [i for i, s in enumerate(shapes) if should_compress(s, o.rank, o.min_compression_rate)]
        groups: dict[tuple[int, int, int], Group] = {}
        for j, i in enumerate(comp):
            n, m = matrix_shape(shapes[i])
            r = effective_rank(shapes[i], o.rank)
            groups.setdefault((n, m, r), Group(n, m, r)).members.append(j)
        plan = Plan(names, sizes, unc, comp, list(groups.values()))
        self._plans[key] = plan
        return plan

    def factor(self, table: dict[str, torch.Tensor], name: str, rows: int, r: int, salt: int, like: torch.Tensor) -> torch.Tensor:
        t = table.get(name)
        if t is None or t.shape != (rows, r):
            seed = factor_seed(self.options.seed, self.param_index.get(name, 0), salt)
            t = seeded_normal((rows, r), seed, dtype=like.dtype, device=like.device)
        return t.to(dtype=like.dtype, device=like.device)

    def split_inputs(
        self, buf: torch.Tensor, plan: Plan
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None, list[torch.Tensor]]:
        """Compensate the matrices in place in ``buf`` (``M = g + e``) and return
        (uncompressed flat copy, per-matrix memory views or None, batched matrices).

        Matrices stay views of the bucket buffer. Groups of several small same-shape
        matrices are stacked into one tensor (one ``bmm`` instead of many tiny launches);
        large ones stay a list of views (stacking would copy the whole gradient while the
        matmul is bandwidth-bound anyway). Factors are always batched per group.
        """
        views = buf.split(plan.sizes)
        unc = torch.cat([views[i] for i in plan.uncompressed]) if plan.uncompressed else buf.new_zeros(0)
        mem_views = None
        if self.options.error_feedback:
            cnames = [plan.names[i] for i in plan.compressed]
            csizes = [plan.sizes[i] for i in plan.compressed]
            mem = self.store.get(cnames, csizes, buf)
            mem_views = list(mem.split(csizes))
            for j, i in enumerate(plan.compressed):
                views[i].add_(mem_views[j])
        batched: list[Any] = []
        for g in plan.groups:
            mats = [views[plan.compressed[j]].view(g.n, g.m) for j in g.members]
            if len(mats) == 1:
                batched.append(mats[0].unsqueeze(0))
            elif g.n * g.m <= STACK_MAX_NUMEL:
                batched.append(torch.stack(mats))
            else:
                batched.append(mats)
        return unc, mem_views, batched

    def write_uncompressed(self, buf: torch.Tensor, plan: Plan, unc_mean: torch.Tensor) -> None:
        views = buf.split(plan.sizes)
        off = 0
        for i in plan.uncompressed:
            views[i].copy_(unc_mean[off : off + plan.sizes[i]])
            off += plan.sizes[i]

    def write_matrices(
        self,
        buf: torch.Tensor,
        plan: Plan,
        left: list[torch.Tensor],
        right: list[torch.Tensor],
        scale: float,
        *,
        residual_into: list[torch.Tensor] | None = None,
        inputs: list[torch.Tensor] | None = None,
    ) -> None:
        """``buf`` matrices <- ``scale * left @ right^T`` per group, written in place (no
        full-size temporaries: the scale goes on the small left factor). With
        ``residual_into``, first store ``inputs - scale * left @ right^T`` there (the EF
        memory update; ``inputs`` may alias ``buf``, hence the order)."""
        views = buf.split(plan.sizes)
        for g, a, b, m in zip(plan.groups, left, right, inputs or [None] * len(left)):
            a = a * scale if scale != 1.0 else a
            for k, j in enumerate(g.members):
                out = views[plan.compressed[j]].view(g.n, g.m)
                if residual_into is not None and m is not None:
                    torch.addmm(m[k], a[k], b[k].T, alpha=-1.0, out=residual_into[j].view(g.n, g.m))
                torch.mm(a[k], b[k].T, out=out)

    @staticmethod
    def factors_flat(factors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [f.reshape(-1) for f in factors]

    @staticmethod
    def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        out, off = [], 0
        for t in like:
            out.append(flat[off : off + t.numel()].view_as(t))
            off += t.numel()
        return out

    def store_factors(
        self,
        table: dict[str, torch.Tensor],
        plan: Plan,
        batched: list[torch.Tensor],
        finite: torch.Tensor,
        previous: list[torch.Tensor],
    ) -> None:
        """``table[name] <- batched`` where ``finite``, else ``previous`` (the factor this step
        started from, i.e. the table entry or its seeded initial value): branch-free."""
        for g, f, old in zip(plan.groups, batched, previous):
            for b, j in enumerate(g.members):
                table[plan.names[plan.compressed[j]]] = torch.where(finite, f[b], old[b])

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["memory"] = self.store.state_dict()
        out["p"] = {k: v.detach().cpu().clone() for k, v in self.p.items()}
        out["q"] = {k: v.detach().cpu().clone() for k, v in self.q.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.store.load_state_dict(state.get("memory", {}))
        self.p = {k: v.clone() for k, v in state.get("p", {}).items()}
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}


class PowerSGDHook(LowRankHook):
    """PowerSGD (Vogels et al. 2019): P = M Q, all-reduce, orthogonalize, Q = M^T P, all-reduce.

    Memory ``e <- M - P Q^T / W`` uses the aggregated approximation (as in the paper and in
    PyTorch's hook). Warm start keeps the all-reduced Q for the next step.
    """

    name = "powersgd"
    Options = PowerSGDOptions

    def compressed_hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        buf = bucket.buffer()
        plan = self.plan(bucket)
        if not plan.groups:
            return self.allreduce_mean(buf, tag=f"{self.name}.P")
        world, o = self.world, self.options
        scale = self.loss_scale
        with self.timed():
            if scale is not None:
                buf.div_(scale)
            finite = finite_flag(buf)
            unc, mem_views, ms = self.split_inputs(buf, plan)
            q_start = []
            for g in plan.groups:
                names = [plan.names[plan.compressed[j]] for j in g.members]
                table = self.q if o.warm_start else {}
                salt = 0 if o.warm_start else 2 * (self.step + 1) * 1_000_003
                q_start.append(torch.stack([self.factor(table, n, g.m, g.r, salt, buf) for n in names]))
            ps = [mm_right(m, q) for m, q in zip(ms, q_start)]
            send = poison_(torch.cat([unc] + self.factors_flat(ps)), finite)
        accounting.all_reduce(send, group=self.group, tag=f"{self.name}.P")
        with self.timed():
            unc_sum, p_flat = send[: unc.numel()], send[unc.numel() :]
            p_ok = finite_flag(send)  # identical on every rank: all-reduced
            p_sum = self.unflatten(p_flat, ps)
            p_hat = [orthogonalize_if(p, p_ok) for p in p_sum]
            qs = [mm_left_t(m, p) for m, p in zip(ms, p_hat)]
            send_q = torch.cat(self.factors_flat(qs))
        work = accounting.all_reduce(send_q, group=self.group, async_op=True, tag=f"{self.name}.Q")

        def decode(fut: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            fut.wait()
            q_sum = self.unflatten(send_q, qs)
            ok = p_ok & finite_flag(send_q)  # the same on every rank
            # memory e <- M - P^ Q_sum^T / W uses the aggregate: kept on every rank if not ok
            residual = None
            if mem_views is not None:
                residual = [torch.empty_like(v) for v in mem_views]
            self.write_matrices(buf, plan, p_hat, q_sum, 1.0 / world, residual_into=residual, inputs=ms)
            if residual is not None and mem_views is not None:
                for mem, new in zip(mem_views, residual):
                    keep_where_(mem, ok, new)
            self.write_uncompressed(buf, plan, unc_sum.div(world))
            if o.warm_start:
                self.store_factors(self.q, plan, q_sum, ok, q_start)
            self.note_aggregate(buf)
            if scale is not None:
                buf.mul_(scale)
            timing.add("compress", time.perf_counter() - t0)
            return buf

        return work.get_future().then(decode)


class ACPSGDHook(LowRankHook):
    """ACP-SGD (Zhang et al., ICDCS'23): alternate P- and Q-steps, one all-reduce each.

    P-step: ``Q = orth(last aggregated Q)``, ``P = M Q``, all-reduce P, grad ``= P_sum Q^T/W``.
    Q-step mirrors it with ``P = orth(last aggregated P)``. The memory is local:
    ``e <- M - P Q^T`` with the *local* factor (no communication needed for it). Initial
    factors come from a seeded generator keyed by parameter position, identical on all ranks.
    """

    name = "acpsgd"
    Options = LowRankOptions

    def compressed_hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        buf = bucket.buffer()
        plan = self.plan(bucket)
        if not plan.groups:
            return self.allreduce_mean(buf, tag=f"{self.name}.uncompressed")
        world = self.world
        p_step = (self.step - self.options.start_iter) % 2 == 0
        scale = self.loss_scale
        with self.timed():
            if scale is not None:
                buf.div_(scale)
            finite = finite_flag(buf)
            unc, mem_views, ms = self.split_inputs(buf, plan)
            fixed, sent, start = [], [], []
            for g, m in zip(plan.groups, ms):
                names = [plan.names[plan.compressed[j]] for j in g.members]
                if p_step:
                    q0 = torch.stack([self.factor(self.q, n, g.m, g.r, 0, buf) for n in names])
                    q = orthogonalize(q0)
                    fixed.append(q)
                    sent.append(mm_right(m, q))
                    start.append(torch.stack([self.factor(self.p, n, g.n, g.r, 1, buf) for n in names]))
                else:
                    p0 = torch.stack([self.factor(self.p, n, g.n, g.r, 1, buf) for n in names])
                    p = orthogonalize(p0)
                    fixed.append(p)
                    sent.append(mm_left_t(m, p))
                    start.append(torch.stack([self.factor(self.q, n, g.m, g.r, 0, buf) for n in names]))
            if mem_views is not None:  # local EF: e <- M - P Q^T (local factor), if finite
                left, right = (sent, fixed) if p_step else (fixed, sent)
                for g, a, b, m in zip(plan.groups, left, right, ms):
                    for k, j in enumerate(g.members):
                        mem = mem_views[j].view(g.n, g.m)
                        keep_where_(mem, finite, torch.addmm(m[k], a[k], b[k].T, alpha=-1.0))
            send = poison_(torch.cat([unc] + self.factors_flat(sent)), finite)
        tag = f"{self.name}.{'P' if p_step else 'Q'}"
        work = accounting.all_reduce(send, group=self.group, async_op=True, tag=tag)

        def decode(fut: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            fut.wait()
            summed = self.unflatten(send[unc.numel() :], sent)
            left, right = (summed, fixed) if p_step else (fixed, summed)
            self.write_matrices(buf, plan, left, right, 1.0 / world)
            self.write_uncompressed(buf, plan, send[: unc.numel()].div(world))
            ok = finite_flag(send)  # the same on every rank: all-reduced
            self.store_factors(self.p if p_step else self.q, plan, summed, ok, start)
            self.note_aggregate(buf)
            if scale is not None:
                buf.mul_(scale)
            timing.add("compress", time.perf_counter() - t0)
            return buf

        return work.get_future().then(decode)

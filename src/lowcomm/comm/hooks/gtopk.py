"""gTop-k (Shi et al., ICDCS'19): global top-k by recursive doubling of sparse vectors.

Every worker selects its local top-k of ``g + e`` per tensor (as :mod:`lowcomm.compress.topk`,
so the result does not depend on the bucket layout); merges are done per tensor too. In round ``j`` (``j = 0..log2(P)-1``)
worker ``i`` swaps its current k (value, index) pairs with worker ``i XOR 2^j``, sums the
two sparse vectors and keeps the top k again (:func:`~lowcomm.compress.topk.merge_sparse`,
lower rank's part listed first so both partners get bit-identical results). After
``log2 P`` rounds every worker holds the same global top-k of the summed gradient, at a
cost of ``log2(P) * k * (value + 4)`` bytes per worker instead of all-gather's
``(P-1) * k * (value + 4)``.

Non-power-of-two P (documented fallback): with ``P' = 2^floor(log2 P)``, each extra worker
``r >= P'`` first sends its top-k to ``r - P'``, which merges it in; the ``P'`` core workers
run recursive doubling; then core worker ``r < P - P'`` sends the result to ``r + P'``.

Residual memory: ``e <- g + e`` minus the local values whose indices made it into the
global selection (locally selected values dropped by the global merge stay in memory).

The rounds depend on each other, so this hook communicates synchronously inside the hook
call (always in bucket order, hence identical on every rank) and returns a completed future.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.comm.hooks.options import TopKOptions
from lowcomm.comm.hooks.state import Future, HookState, done_future
from lowcomm.compress.base import pack_payload, unpack_payload
from lowcomm.compress.feedback import ParamStore, finite_flag, keep_where_, poison_
from lowcomm.compress.topk import TopK, merge_sparse_segments, num_selected


def schedule(world: int) -> tuple[int, list[int]]:
    """(P', rounds): the power-of-two core size and partner distances."""
    core = 1 << (world.bit_length() - 1)
    return core, [1 << j for j in range(core.bit_length() - 1)]


class GTopKHook(HookState):
    name = "gtopk"
    aggregation = "p2p"
    Options = TopKOptions

    def __init__(self, ddp: Any, options: Any, *, process_group: Any = None) -> None:
        super().__init__(ddp, options, process_group=process_group)
        if process_group is not None and process_group is not dist.group.WORLD:
            # p2p peers are addressed by global rank below
            if dist.get_world_size(process_group) != dist.get_world_size():
                raise ValueError("gtopk supports only the default (world) process group")
        self.store = ParamStore()
        self.topk = TopK(options.density, fast_select=options.fast_select)

    def exchange(self, peer: int, send: torch.Tensor, *, sending: bool = True, receiving: bool = True) -> torch.Tensor:
        recv = torch.empty_like(send)
        # One batch (ncclGroupStart/End on NCCL): both partners send to each other first, and
        # unbatched sends of large messages can deadlock there waiting for their receives.
        ops = []
        if sending:
            ops.append(dist.P2POp(dist.isend, send, peer, self.group))
        if receiving:
            ops.append(dist.P2POp(dist.irecv, recv, peer, self.group))
        for w in accounting.batch_isend_irecv(ops, tag=self.name):
            w.wait()
        return recv

    def global_topk(self, vals: torch.Tensor, idx: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rank, world = self.rank, self.world
        k = sum(ks)
        spec = [(vals.dtype, k), (torch.int32, k)]
        core, rounds = schedule(world)
        if rank >= core:  # extra worker: hand in, then wait for the answer
            self.exchange(rank - core, pack_payload([vals, idx]), receiving=False)
            got = self.exchange(rank - core, pack_payload([vals, idx]), sending=False)
            v, i = unpack_payload(got, spec)
            return v.clone(), i.clone()
        if rank + core < world:
            got = self.exchange(rank + core, pack_payload([vals, idx]), sending=False)
            ov, oi = unpack_payload(got, spec)
            vals, idx = merge_sparse_segments([(vals, idx), (ov, oi)], ks)
        for d in rounds:
            peer = rank ^ d
            got = self.exchange(peer, pack_payload([vals, idx]))
            ov, oi = unpack_payload(got, spec)
            pair = [(ov, oi), (vals, idx)] if peer < rank else [(vals, idx), (ov, oi)]
            vals, idx = merge_sparse_segments(pair, ks)
        if rank + core < world:
            self.exchange(rank + core, pack_payload([vals, idx]), receiving=False)
        return vals, idx

    def compressed_hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        buf = bucket.buffer()
        names, sizes, _ = self.layout(bucket)
        o = self.options
        scale = self.loss_scale  # AMP: memory in unscaled units (lowcomm.comm.amp)
        with self.timed():
            if scale is not None:
                buf.div_(scale)
            finite = finite_flag(buf)  # device flag: no host sync inside backward
            comp = buf.clone()
            mem = None
            if o.error_feedback:
                mem = self.store.get(names, sizes, buf)
                comp.add_(mem)
            ks = [num_selected(n, o.density) for n in sizes]
            if o.fast_select:
                g = torch.Generator(device="cpu")
                g.manual_seed((o.seed * 1_000_003 + self.step * 10_007 + self.param_index.get(names[0], 0)) % (2**63))
                self.topk.generator = g
            idx = self.topk.select_segments(comp, sizes)
            vals = poison_(comp[idx], finite)
        gvals, gidx = self.global_topk(vals, idx.to(torch.int32), ks)
        with self.timed():
            gidx_l = gidx.long()
            if mem is not None:  # branch-free: kept unless this input and the result are finite
                chosen = torch.zeros(comp.numel(), dtype=torch.bool, device=comp.device)
                chosen[gidx_l] = True
                comp[idx] = torch.where(chosen[idx], torch.zeros((), dtype=comp.dtype, device=comp.device), comp[idx])
                keep_where_(mem, finite & finite_flag(gvals), comp)
            out = gvals.to(buf.dtype) / self.world
            self.note_aggregate(out)
            if scale is not None:
                out.mul_(scale)
            buf.zero_()
            buf[gidx_l] = out
        return done_future(buf)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["memory"] = self.store.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.store.load_state_dict(state.get("memory", {}))

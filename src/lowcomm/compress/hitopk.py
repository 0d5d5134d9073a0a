"""Hierarchical top-k (Shi et al., MLSys'21, HiTopKComm): sparse only where the link is slow.

On a cluster of nodes with ``G`` workers each (``N`` nodes, ``P = N * G`` workers), top-k's
all-gather sends ``(P - 1) * k`` pairs per worker, and each node's network card carries the
pairs of all its ``G`` workers. HiTopKComm sends dense data inside the node, where links are
fast, and sparse data only across nodes, in three messages per fused buffer:

1. ``reduce_scatter`` inside the node (scope ``intra``, dense): local rank ``l`` receives the
   node's sum of shard ``l`` of ``g + e``;
2. per-shard top-k with error feedback, then an ``all_gather`` of the (value, int32 index)
   pairs among the ``N`` workers with the same local rank (scope ``inter``): each node's
   shard ``l`` leaves the node once, ``1/G`` of the buffer at the topk density;
3. the ``N`` sparse shards are scatter-added into the dense shard of the mean (divided by
   ``P``), which an ``all_gather`` inside the node (scope ``intra``, final) hands to every
   worker; decode writes the mean gradient.

Inter-node bytes per worker: ``(N - 1) * K * (value + 4)`` with ``K ~ density * n / G``, against
topk's ``(P - 1) * k * (value + 4) / G`` under the accounting layer's ring model (``k ~ density * n``),
a ratio of ``(N - 1) / (P - 1) <= 1/G``.

**Shards are cut per tensor**, not per buffer: tensor ``i`` (``n_i`` elements, padded with
zeros to ``G * c_i``, ``c_i = ceil(n_i / G)``) gives chunk ``l`` to local rank ``l``, and shard
``l`` is the concatenation of the chunks ``l`` of the buffer's tensors. So who owns an
element, and which elements compete in a selection (``k = max(1, ceil(density * c_i))`` per
chunk, exactly topk's rule on the chunk), depend only on the tensor, never on how DDP or the
engine fuses tensors into buffers (bucket rebuilds, regrouping, a resume with the initial
layout). With ``G = 1`` the chunks are the tensors and hitopk is exactly topk.

**Error feedback on the shard, stored so that no layout can lose it**: the residual of node
shard ``l`` is a node-level quantity (it was selected from the node's sum). Each worker keeps
a full-size residual per parameter name (:class:`~lowcomm.compress.feedback.ParamStore`, as
topk does) and adds it to its gradient *before* the reduce-scatter; after a step the owner of
a chunk holds the chunk's residual and the other workers of the node hold zeros there. The
reduce-scatter then sums the node's residual into its shard whoever holds it, so a changed
layout or topology still feeds every unsent value back (the sum over all workers of the
residuals is kept exactly).

Momentum correction and momentum factor masking (DGC; topk's options, gtopk's defaults, see
:class:`HiTopKOptions`): each worker's velocity is compressed (the reduce-scatter sums them).
Masking zeroes the velocity, on every worker of the node, where *the node* sent a value;
only the shard's owner knows those positions, so with ``momentum_masking`` on the final
intra-node message also carries the owner's int32 indices (``4 * K`` bytes more, intra only).
Sparsity warm-up, ``start_iter``, fast selection (seeded like topk's: same sample on every
rank and after a resume) and local clipping are topk's.

One node, or one worker per node: the transport runs a scoped message on the world group
when the topology is not hierarchical (flat fallback). The codec knows its node size
(:meth:`HiTopKCodec.set_topology`, else torchrun's ``LOCAL_WORLD_SIZE`` as
:meth:`~lowcomm.comm.topology.Topology.from_env` reads it) and turns a message over a group
of one worker into ``none``. **On one node hitopk is topk**, explicitly: with no inter-node
link to spare, a dense reduce-scatter and all-gather inside the node would send more than
topk's sparse all-gather (and more than ``ssgd``), so a single node is treated as ``P``
nodes of one worker (``G = 1``): every message but the all-gather of the pairs is ``none``,
and that one has scope ``world``: topk's exact math and bytes.

CPU, one worker per node (hitopk is topk): selected in encode as topk does; decode scatters
the pairs straight into the output and hands ``g + e`` to the memory by a storage swap.

NaN policy: a non-finite input poisons one element of every shard before the reduce-scatter,
so every owner's shard is non-finite, its payload is poisoned and every rank decodes NaN;
the residual and the velocity mask are updated only where the decoded result is finite,
which every rank sees alike (branch-free, no host sync).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lowcomm.comm.topology import Topology
from lowcomm.compress.base import PayloadSpec, cpu_fast, pack_payload, payload_spec, unpack_payload
from lowcomm.compress.codec import Aggregation, CodecCost, Layout, Message, Round, Work, register_codec
from lowcomm.compress.feedback import finite_flag, keep_where_, poison_
from lowcomm.compress.selection import fast_path
from lowcomm.compress.sparse_kernels import Spares
from lowcomm.compress.gtopk import GTopKOptions
from lowcomm.compress.topk import TopKCodec, num_selected
from lowcomm.errors import UsageError


def chunk_sizes(sizes: Sequence[int], parts: int) -> list[int]:
    """``c_i = ceil(n_i / parts)``: the elements of each tensor in one shard."""
    return [-(-int(n) // parts) for n in sizes]


def to_shards(flat: torch.Tensor, sizes: Sequence[int], parts: int) -> torch.Tensor:
    """``(parts, S)``: row ``l`` is shard ``l``, the chunks ``l`` of every tensor of ``flat``
    (each tensor zero-padded to ``parts * c_i``). Always a new tensor."""
    pieces = []
    for t, c in zip(flat.split(list(sizes)), chunk_sizes(sizes, parts)):
        pad = parts * c - t.numel()
        pieces.append((F.pad(t, (0, pad)) if pad else t).view(parts, c))
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].clone()


def from_shards(rows: torch.Tensor, sizes: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_shards` into ``out`` (the padding is dropped); returns ``out``."""
    parts = rows.shape[0]
    col = pos = 0
    for n, c in zip(sizes, chunk_sizes(sizes, parts)):
        out[pos : pos + n].copy_(rows[:, col : col + c].reshape(-1)[:n])
        col += c
        pos += n
    return out


@dataclass
class _Step:
    """Where one buffer's three messages stand (the messages' ``ctx``)."""

    layout: Layout
    parts: int  # G
    nodes: int  # N
    chunks: list[int]
    shard: torch.Tensor | None = None  # node sum of this worker's shard of g + e
    idx: torch.Tensor | None = None  # the owner's selection in the shard (int64)
    spec_inter: PayloadSpec | None = None
    spec_intra: PayloadSpec | None = None
    masks: bool = False
    payload: list[torch.Tensor] | None = None  # one worker per node on the CPU: selected in encode
    gathered: torch.Tensor | None = None  # ... and the pairs' rows, scattered by decode into ``out``


@dataclass
class HiTopKOptions(GTopKOptions):
    """hitopk: topk's options (``density`` 0.01, warm-up, error feedback, fast selection,
    DGC's momentum correction, masking, sparsity warm-up and clipping), applied per shard,
    with gtopk's defaults (:class:`~lowcomm.compress.gtopk.GTopKOptions`: a longer sparsity
    warm-up, ``"6ep"``, momentum factor masking off, topk's former ``start_iter="10%"`` and
    first density 0.25) and local clipping off.

    Why: like gtopk, hitopk selects from a sum (the node's), not from one worker's gradient.
    Measured on MNIST-1D cnn1d, 2 nodes x 2 workers, 15 epochs, 3 seeds
    (benchmarks/hitopk_accuracy.py, docs/hierarchical.md): 83.1 % with topk's defaults,
    85.4 % with masking off, 84.6 % with ``sparsity_warmup="6ep"``, 88.5 % with both
    (topk 84.9 %, gtopk 87.0 %, ssgd 91.9 %). Masking off also leaves the owner's indices out
    of the final intra-node message. Clipping stays off (not re-measured with it)."""

    clip: float = 0.0


@register_codec
class HiTopKCodec(TopKCodec):
    """Hierarchical top-k: dense intra-node reduce-scatter, sparse inter-node all-gather,
    intra-node all-gather (see the module docstring)."""

    name = "hitopk"
    summary = ("Hierarchical top-k: dense intra-node reduce-scatter, per-shard top-k pairs all-gathered "
               "across nodes, intra-node all-gather")
    caveat = ("sparse: needs error feedback; keeps k per shard of each node's sum; inter-node traffic "
              "~1/G of topk's, intra-node traffic dense.")
    aggregation = Aggregation.GATHER
    multi_round = True
    Options = HiTopKOptions

    def __init__(self, options: Any = None, *, world: int = 1, rank: int = 0) -> None:
        super().__init__(options, world=world, rank=rank)
        #: workers per node when there are several nodes; None: one node (then hitopk is topk)
        self.local_size: int | None = _env_local_size(self.world, self.rank)
        #: second buffer per layout for ``g + e`` (one worker per node, CPU: :meth:`_encode_flat`)
        self.spares = Spares()

    # --- topology -----------------------------------------------------------------------
    def set_topology(self, topology: Topology | None) -> None:
        """Use the node size of ``topology`` (a :class:`~lowcomm.comm.topology.Topology` of this
        codec's world; None: one node). The carriers call it with the topology they hand to the
        transport, so both agree on which groups the scoped messages run on."""
        if topology is not None and int(topology.world) != self.world:
            raise ValueError(f"hitopk: topology of {topology.world} workers for a codec of {self.world}")
        self.local_size = None if topology is None or topology.nodes == 1 else int(topology.local_size)

    def levels(self, world: int | None = None, local_size: int | None = None) -> tuple[int, int]:
        """``(G, N)``: workers per node and nodes, for ``world`` workers (default: this codec's)
        in nodes of ``local_size`` (default: this codec's). One node (``local_size`` None or
        ``world``) gives ``(1, world)``: topk (see the module docstring)."""
        p = self.world if world is None else int(world)
        g = local_size if local_size is not None else (self.local_size or 1)
        if g < 1 or p % g:
            valid = ", ".join(str(d) for d in range(1, p + 1) if p % d == 0)
            raise UsageError(f"hitopk: {g} workers per node do not divide {p} workers; valid workers per node: {valid}")
        if g == p:
            g = 1
        return g, p // g

    @property
    def carries_indices(self) -> bool:
        """The final message also carries the owner's int32 indices (option
        ``momentum_masking``): every worker of the node then zeroes its velocity where the node
        sent. Decided by the option alone, not by whether a velocity exists this run, so that
        the bytes follow from the options (a cost query and the run agree); without a velocity
        the indices cost ``4 * K`` intra-node bytes (about ``density`` of the dense shard's)
        and are not used."""
        return bool(self.options.momentum_masking)

    # --- messages -----------------------------------------------------------------------
    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *,
               pad_to: int = 1) -> Message:
        """``g + e`` cut into shards; the reduce-scatter inside the node (``none`` for G = 1)."""
        self.prepare(layout)
        parts, nodes = self.levels()
        if parts == 1 and fast_path(flat) and cpu_fast(finite) and bool(finite):  # a CPU flag: no sync
            return self._encode_flat(flat.reshape(-1), layout, nodes)
        comp = flat + self.memory.get(layout.names, layout.sizes, flat) if self.options.error_feedback else flat
        rows = to_shards(comp, layout.sizes, parts)
        poison_(rows[:, 0], finite)  # one NaN per shard: every owner sees the poison (NaN policy)
        st = _Step(layout, parts, nodes, chunk_sizes(layout.sizes, parts), masks=self.carries_indices)
        return Message(rows.reshape(-1), "reduce_scatter" if parts > 1 else "none", final=False, name="rs",
                       scope="intra", ctx=st)

    def _encode_flat(self, flat: torch.Tensor, layout: Layout, nodes: int) -> Message:
        """One worker per node, CPU, finite input: the shard is this worker's ``g + e``, selected
        here as topk does, fused with the add into the layout's spare (the general path's
        selection and payload after its ``none`` reduce-scatter)."""
        st = _Step(layout, 1, nodes, list(layout.sizes), masks=self.carries_indices)
        if self.options.error_feedback:
            mem = self.memory.get(layout.names, layout.sizes, flat)
            comp = self.spares.get(tuple(layout.names), flat)
            idx = self.topk.accumulate_select(mem, flat, layout.sizes, into=comp)
        else:
            comp = flat
            idx = self.topk.select_segments(comp, layout.sizes)
        st.shard, st.idx = comp, idx
        st.payload = [poison_(comp[idx], finite_flag(comp)), idx.to(torch.int32)]
        st.spec_inter = payload_spec(st.payload)
        return Message(comp, "none", final=False, name="rs", scope="intra", ctx=st)

    def advance(self, msg: Message, received: torch.Tensor) -> Message:
        """After the reduce-scatter: select and all-gather across nodes; after that: the dense
        shard of the mean, all-gathered inside the node."""
        st: _Step = msg.ctx
        if msg.name == "rs":
            return self._select(st, received)
        rows = _rows(msg, received, st.nodes, "inter-node all-gather")
        if st.payload is not None and cpu_fast(rows):  # one worker per node: decode scatters
            st.gathered = rows
            return Message(rows.new_empty(0), "none", final=True, name="intra", scope="intra", ctx=st)
        dtype = st.shard.dtype if st.shard is not None else torch.float32
        vals, idx = [], []
        for row in rows:
            v, i = unpack_payload(row, st.spec_inter or [])
            vals.append(v)
            idx.append(i)
        s = sum(st.chunks)
        dense = torch.zeros(s, dtype=dtype, device=rows.device)
        dense.index_add_(0, torch.cat(idx).long(), torch.cat(vals).to(dtype)).div_(self.world)
        parts: list[torch.Tensor] = [dense]
        if st.masks and st.idx is not None:
            parts.append(st.idx.to(torch.int32))
        st.spec_intra = payload_spec(parts)
        return Message(pack_payload(parts), "all_gather" if st.parts > 1 else "none", final=True, name="intra",
                       scope="intra", ctx=st)

    def _select(self, st: _Step, shard: torch.Tensor) -> Message:
        """Per-chunk top-k of the node's shard; its (values, int32 indices) go across nodes."""
        s = sum(st.chunks)
        if shard.numel() != s:
            raise RuntimeError(
                f"hitopk: the intra-node reduce-scatter returned {shard.numel()} elements, expected {s} "
                f"(nodes of {st.parts} workers): the transport's topology disagrees with the codec's; "
                "pass the same Topology to both (codec.set_topology and transport topology=)")
        if st.payload is not None:  # selected in encode (one worker per node, CPU)
            payload = st.payload
        else:
            st.shard = shard
            idx = self.topk.select_segments(shard, st.chunks)
            vals = poison_(shard[idx], finite_flag(shard))
            st.idx = idx
            payload = [vals, idx.to(torch.int32)]
            st.spec_inter = payload_spec(payload)
        return Message(pack_payload(payload), "all_gather" if st.nodes > 1 else "none", final=False, name="inter",
                       scope=_inter_scope(st.parts), ctx=st)

    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """The mean gradient from the node's dense shards; residual and velocity mask where
        the result is finite (the same on every rank)."""
        st: _Step = msg.ctx
        if st.gathered is not None:
            self._decode_flat(st, out)
            return
        rows = _rows(msg, received, st.parts, "intra-node all-gather")
        parts = [unpack_payload(row, st.spec_intra or []) for row in rows]
        dense = torch.stack([p[0] for p in parts])
        sizes = st.layout.sizes
        from_shards(dense, sizes, out)
        ok = finite_flag(dense)
        local = self.rank % st.parts
        if self.options.error_feedback and st.shard is not None and st.idx is not None:
            residual = torch.zeros_like(dense)
            residual[local] = st.shard
            residual[local, st.idx] = 0
            mem = self.memory.get(st.layout.names, sizes, out)
            keep_where_(mem, ok, from_shards(residual, sizes, torch.empty_like(mem)))
        if st.masks:
            u = self.velocity.find(st.layout.names)
            if u is not None:
                sent = torch.zeros(dense.shape, dtype=torch.bool, device=dense.device)
                for g, p in enumerate(parts):
                    sent[g, p[1].long()] = True
                hit = from_shards(sent, sizes, torch.empty(u.numel(), dtype=torch.bool, device=u.device))
                u.masked_fill_(hit & ok, 0)

    def _decode_flat(self, st: _Step, out: torch.Tensor) -> None:
        """:meth:`decode` after :meth:`_encode_flat`, the same values: the pairs scatter-added
        into ``out`` (:meth:`~lowcomm.compress.topk.TopK.aggregate_into`, bit for bit); a finite
        result hands ``g + e`` minus the sent values to the memory by a storage swap."""
        assert st.gathered is not None and st.shard is not None and st.idx is not None
        pairs = [unpack_payload(row, st.spec_inter or []) for row in st.gathered]
        n, dtype = st.shard.numel(), st.shard.dtype
        direct = out.dtype == dtype and out.is_contiguous() and out.numel() == n
        dense = self.topk.aggregate_into(out.view(-1) if direct else torch.empty(n, dtype=dtype), pairs)
        if not direct:
            out.copy_(dense.view(out.shape))
        if not bool(finite_flag(dense)):  # a CPU flag: the state stays as it was
            return
        names = st.layout.names
        if self.options.error_feedback:
            st.shard.numpy()[st.idx.numpy()] = 0
            self.spares.keep(tuple(names), self.memory.get(names, st.layout.sizes, st.shard), st.shard)
        if st.masks and (u := self.velocity.find(names)) is not None:
            u.view(-1).numpy()[st.idx.numpy()] = 0

    # --- cost -----------------------------------------------------------------------------
    def shard_ks(self, shapes: Sequence[Sequence[int]], parts: int, *, density: float | None = None) -> list[int]:
        """k of every chunk of one shard: ``max(1, ceil(density * c_i))``."""
        d = self.density if density is None else density
        return [num_selected(c, d) for c in chunk_sizes([math.prod(s) for s in shapes], parts)]

    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None, local_size: int | None = None) -> CodecCost:
        """Per worker, nodes of ``G`` workers (``local_size``, default this codec's), ``S = sum_i
        c_i``, ``K = sum_i max(1, ceil(density * c_i))`` at step ``step``'s density:
        reduce-scatter ``G * S * value`` bytes (intra), all-gather ``K * (value + 4)`` (inter),
        all-gather ``S * value`` (+ ``4 * K`` with masking; intra). Rounds over one worker are
        left out: ``G = 1`` (one node included) leaves topk's all-gather."""
        parts, nodes = self.levels(world, local_size)
        d = self.density_at(step)
        sizes = [math.prod(s) for s in shapes]
        n, s = sum(sizes), sum(chunk_sizes(sizes, parts))
        k = sum(self.shard_ks(shapes, parts, density=d))
        encode = Work(elementwise=2 * n) + self.velocity_work(shapes)  # g + e, cut into shards
        rounds: list[Round] = []

        def then(work: Work) -> None:  # compute after the last round so far (or in encode)
            nonlocal encode
            if rounds:
                rounds[-1].then = rounds[-1].then + work
            else:
                encode = encode + work

        if parts > 1:
            rounds.append(Round("reduce_scatter", parts * s * dtype_bytes, blocking=True, scope="intra"))
        then(Work(topk=s, elementwise=s))  # select, gather the values
        if nodes > 1:
            rounds.append(Round("all_gather", k * (dtype_bytes + 4), blocking=True, scope=_inter_scope(parts)))
        then(Work(scatter=nodes * k, elementwise=s))  # scatter-add the sparse shards, divide
        if parts > 1:
            extra = 4 * k if self.carries_indices else 0
            rounds.append(Round("all_gather", s * dtype_bytes + extra, scope="intra"))
        then(Work(elementwise=(4 if self.options.error_feedback else 2) * n))  # unshard, flag, residual
        if rounds:
            rounds[-1].blocking = False
        return CodecCost(encode, rounds)

    def describe(self) -> dict[str, Any]:
        """topk's record plus the node size used (1: one node, topk)."""
        return {**super().describe(), "local_size": self.levels()[0]}


def _inter_scope(parts: int) -> str:
    """The pairs' all-gather runs among the same-local-rank workers; with one worker per node
    (one node included) those are all workers: ``world``, topk's all-gather, on any topology."""
    return "inter" if parts > 1 else "world"


def _rows(msg: Message, received: torch.Tensor, expected: int, what: str) -> torch.Tensor:
    """The ``(group, nbytes)`` rows an all-gather received (a ``none`` message: its own buffer)."""
    rows = received.reshape(1, -1) if msg.collective == "none" else received
    if rows.shape[0] != expected:
        raise RuntimeError(f"hitopk: the {what} returned {rows.shape[0]} rows, expected {expected}: the "
                           "transport's topology disagrees with the codec's (pass the same Topology to both)")
    return rows


def _env_local_size(world: int, rank: int) -> int | None:
    """torchrun's node size if it describes several nodes of ``world`` workers (else None: one
    node; a ``LOCAL_WORLD_SIZE`` that does not divide ``world`` belongs to another process group,
    e.g. a codec priced in a single process)."""
    try:
        topo = Topology.from_env(world=world, rank=rank)
    except UsageError:
        return None
    return topo.local_size if topo.nodes > 1 else None

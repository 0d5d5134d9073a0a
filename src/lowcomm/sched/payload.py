"""Carry any :class:`~lowcomm.compress.codec.Codec` in the engine's fusion groups.

Why a module of its own: the engine (:mod:`lowcomm.sched.engine`) decides *when* a group
travels; this module decides *how* a compressed group travels in each mode, from the
codec's declarations only (the pairs that cannot work are refused earlier, by
:mod:`lowcomm.sched.pairing`). Every collective goes through :mod:`lowcomm.comm.transport`
or :mod:`lowcomm.comm.accounting`; the codec itself never communicates.

Per group and step, once the codec is active (``start_iter`` steps of plain averaging
first; with momentum correction those average the codec's velocity, :meth:`Carrier.accumulate`),
at the group's launch inside backward: divide an AMP loss scale out when the codec
keeps state (its state must stay in unscaled units), accumulate the velocity (momentum
correction, :meth:`~lowcomm.compress.codec.Codec.accumulate`), encode, complete the codec's
non-final rounds synchronously (PowerSGD's P, gTop-k's recursive doubling), then start the
final message asynchronously:

=================  ====================================  ==========================================
mode               ``SUM`` payload                       ``GATHER`` payload
=================  ====================================  ==========================================
allreduce          all-reduce; decode in ``finish_sync``  all-gather / p2p; decode in ``finish_sync``
dear               reduce-scatter in backward; all-       exchange in backward; decode the full
                   gather before the forward, decode      mean in ``finish_sync`` (no all-gather
                   (:meth:`Carrier.gather`)                before the forward: it is complete)
shard (lee18)      reduce-scatter; decode only this       exchange; decode the full mean, keep
                   rank's slice (elementwise codecs)      this rank's slice
=================  ====================================  ==========================================

With a ``reducer`` (the ``hier`` schedule, allreduce mode) every ``all_reduce`` message, non-final
ones included, goes through it (hierarchically or flat), in launch order.

AMP: a decoded gradient that ``finish_sync`` hands on is in the units the user's GradScaler
expects (scaled: a stateful codec's result is multiplied by the scale it divided out). DeAR's
``SUM`` message shards are the exception: they stay undecoded until the next forward, so the
engine's scaler view treats them as already unscaled and only checks them
(:mod:`lowcomm.sched.shardview`); their decode divides out the scale a stateless codec's
message still carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting, transport
from lowcomm.comm.amp import current_scale
from lowcomm.compress.codec import Aggregation, Codec, Layout, Message
from lowcomm.compress.feedback import finite_flag
from lowcomm.runtime import timing
from lowcomm.sched.groups import Group
from lowcomm.sched.pairing import Mode


@dataclass
class InFlight:
    """A group's compressed message between encode and decode."""

    msg: Message
    #: the started final exchange (all-reduce / all-gather / p2p) when nothing is sharded
    pending: transport.Pending | None = None
    #: this rank's reduce-scattered slice of ``msg.buf`` (``SUM`` payloads in dear / lee18)
    shard: torch.Tensor | None = None
    #: the reduce-scatter (backward) or all-gather (before the forward) in flight
    work: Any = None
    #: loss scale divided out before encoding (stateful codecs), multiplied back after decode
    divided: torch.Tensor | None = None
    #: loss scale the message still carries (stateless codecs)
    carried: torch.Tensor | None = None


class Carrier:
    """Encode, exchange and decode of one codec's payloads for one engine (see module doc)."""

    def __init__(self, codec: Codec, *, mode: Mode, group: dist.ProcessGroup | None, world: int, rank: int,
                 distributed: bool, tag: str, param_index: dict[str, int], reducer: Any = None) -> None:
        self.codec = codec
        self.mode = mode
        self.pg = group
        self.world = world
        self.rank = rank
        self.distributed = distributed and world > 1
        self.tag = f"{tag}.{codec.name}"
        self.param_index = param_index
        #: SUM payloads of the sharded modes are reduce-scattered, not exchanged whole
        self.scatters = mode is not Mode.ALLREDUCE and codec.aggregation is Aggregation.SUM
        self.scaler: torch.amp.GradScaler | None = None
        self._layouts: dict[tuple[str, ...], Layout] = {}
        #: sums all-reduce messages instead of the plain all-reduce (see module docstring)
        self.reducer = reducer if self.distributed else None
        #: the node layout scoped messages (hitopk's intra/inter) run on; None on a subgroup
        self.topology = accounting.topology() if group is None else None
        if hasattr(codec, "set_topology"):
            codec.set_topology(self.topology)

    def layout(self, g: Group) -> Layout:
        """The codec's view of group ``g`` (cached per parameter list: regrouping makes new ones)."""
        key = tuple(g.names)
        hit = self._layouts.get(key)
        if hit is None:
            hit = Layout.of(g.names, [p.shape for p in g.params], self.param_index)
            self._layouts[key] = hit
        return hit

    # --- backward ---------------------------------------------------------------------------
    def launch(self, g: Group) -> None:
        """Encode group ``g`` (its gradient is complete in ``g.flat``) and start sending it."""
        flat = g.flat[: g.numel]
        scale = current_scale(self.scaler, flat.device)
        divided = scale if scale is not None and self.codec.stateful else None
        with timing.measure("compress"):
            if divided is not None:
                flat.div_(divided)
            finite = finite_flag(flat)
            layout = self.layout(g)
            self.codec.accumulate(flat, layout, finite)  # flat <- velocity (no-op without one)
            pad_to = self.world if self.scatters else self.reducer.pad_to if self.reducer is not None else 1
            msg = self.codec.encode(flat, layout, finite, pad_to=pad_to)
        msg = transport.run_rounds(self.codec, msg, group=self.pg, tag=self.tag, topology=self.topology,
                                   reducer=self.reducer)
        f = InFlight(msg, divided=divided, carried=scale if divided is None else None)
        if self.scatters:
            if self.distributed:
                f.shard = msg.buf.new_empty(msg.buf.numel() // self.world)
                f.work = accounting.reduce_scatter_tensor(
                    f.shard, msg.buf, group=self.pg, async_op=True,
                    tag=f"{transport.message_tag(self.tag, msg)}.rs")
            else:
                f.shard = msg.buf
        else:
            f.pending = transport.start(msg, group=self.pg, tag=self.tag, async_op=True, topology=self.topology,
                                        reducer=self.reducer)
        g.msg = f

    def accumulate(self, g: Group) -> None:
        """A dense (warm-up) step of group ``g``: its gradient becomes the codec's velocity
        (momentum correction) in unscaled units, before the plain averaging. The loss scale is
        divided out and multiplied back at once (powers of two: exact)."""
        flat = g.flat[: g.numel]
        scale = current_scale(self.scaler, flat.device)
        with timing.measure("compress"):
            if scale is not None:
                flat.div_(scale)
            self.codec.accumulate(flat, self.layout(g), finite_flag(flat))
            if scale is not None:
                flat.mul_(scale)

    def settle(self, g: Group) -> torch.Tensor:
        """``finish_sync`` for a compressed group: wait for its backward exchange and leave
        the mean gradient where the mode expects it; returns the tensor whose finiteness is
        this group's (the same on every rank).

        allreduce: ``g.flat``; dear ``GATHER``: ``g.flat`` (``g.full`` set: no all-gather
        before the forward); dear ``SUM``: the message shard stays in ``g.msg`` until
        :meth:`gather`; lee18: ``g.shard``.
        """
        f: InFlight = g.msg  # type: ignore[assignment]
        if f.work is not None:
            f.work.wait()
            f.work = None
        if self.scatters and self.mode is Mode.DEAR:
            assert f.shard is not None
            return f.shard
        g.msg = None
        if self.scatters:  # lee18: an elementwise codec decodes this rank's slice only
            assert f.shard is not None
            self._decode(f, f.shard, g.shard)
            return g.shard
        assert f.pending is not None
        out = g.flat[: g.numel]
        self._decode(f, f.pending.wait(), out)
        if self.mode is Mode.SHARD:
            lo = self.rank * g.shard.numel()
            g.shard.copy_(g.flat[lo : lo + g.shard.numel()])
            return g.shard
        g.full = self.mode is Mode.DEAR
        return out

    def _decode(self, f: InFlight, received: torch.Tensor, out: torch.Tensor) -> None:
        with timing.measure("compress"):
            self.codec.decode(f.msg, received, out)
            if f.divided is not None:  # back to the units the user's GradScaler expects
                out.mul_(f.divided)

    # --- dear: before the forward -----------------------------------------------------------
    def start_gather(self, g: Group) -> Any:
        """Start the all-gather of the summed message shards (True when nothing is sent)."""
        f: InFlight = g.msg  # type: ignore[assignment]
        if not self.distributed:
            return True
        assert f.shard is not None
        tag = f"{transport.message_tag(self.tag, f.msg)}.ag"
        return accounting.all_gather_into_tensor(f.msg.buf, f.shard, group=self.pg, async_op=True, tag=tag)

    def gather(self, g: Group) -> None:
        """Decode the all-gathered summed message into ``g.flat`` in unscaled units (DeAR
        applies it itself after its own inf check)."""
        f: InFlight = g.msg  # type: ignore[assignment]
        g.msg = None
        out = g.flat[: g.numel]
        with timing.measure("compress"):
            self.codec.decode(f.msg, f.msg.buf, out)
            if f.carried is not None:
                out.div_(f.carried)


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[bool, int, int]:
    """(distributed, world size, rank) of ``group`` (one process without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False, 1, 0
    return True, dist.get_world_size(group), dist.get_rank(group)

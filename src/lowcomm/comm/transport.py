"""Carry a codec's messages over ``torch.distributed``: the one place codecs meet collectives.

The DDP comm hooks (:mod:`lowcomm.comm.hooks`) and the scheduling engine
(:mod:`lowcomm.sched.engine`) both drive a :class:`~lowcomm.compress.codec.Codec` through
:func:`run_rounds` (every non-final message, synchronously, in the caller's thread: the
collective sequence is then the same on every rank) and :func:`start` (the final message,
asynchronously). Every collective goes through :mod:`lowcomm.comm.accounting`, so bytes are
counted where they are sent, under the tag ``<tag>.<message name>``.

Without an initialized process group (one process), the collectives are identities.

Scopes. A message's ``scope`` (``world``, ``intra``, ``inter``) picks the process group its
collective runs on, from the ``topology`` the caller passes (:mod:`lowcomm.comm.topology`;
the scoped groups are subgroups of the world, so the caller's ``group`` must then be the
world group). Without a hierarchical topology every scope runs on ``group`` (flat fallback).
The accounting layer counts a scoped collective under its link class.

Reducer. ``reducer`` (the ``hier`` schedule and ``lowcomm.hooks.register(...,
hierarchical=True)``; :class:`lowcomm.comm.hierarchical.HierarchicalReducer`) sums every
world-scope ``all_reduce`` message instead of the plain all-reduce, non-final ones included.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting, buffers
from lowcomm.comm.topology import Topology, node_groups
from lowcomm.compress.codec import Codec, Message

Future = torch.futures.Future


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def message_tag(tag: str, msg: Message) -> str:
    """The accounting tag of one message: ``<tag>.<name>`` (``<tag>`` for unnamed ones)."""
    return f"{tag}.{msg.name}" if msg.name else tag


@dataclass
class Pending:
    """A started collective: :meth:`wait` returns what the message received."""

    received: torch.Tensor
    work: Any = None

    def wait(self) -> torch.Tensor:
        """Block until the collective completed; return what was received."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.received

    def future(self) -> Future[torch.Tensor]:
        """A future of what was received (completed already for synchronous exchanges)."""
        if self.work is not None and hasattr(self.work, "get_future"):
            received = self.received
            return self.work.get_future().then(lambda _f: received)
        fut: Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(self.wait())
        return fut


def scope_group(scope: str, group: dist.ProcessGroup | None,
                topology: Topology | None) -> tuple[dist.ProcessGroup | None, str | None]:
    """The process group and accounting link of a message ``scope`` (see module docstring)."""
    if scope == "world" or topology is None or not topology.hierarchical:
        return group, None
    if group is not None and dist.get_world_size(group) != topology.world:
        raise ValueError(f"a {scope!r} message needs the world group; got a group of "
                         f"{dist.get_world_size(group)} of {topology.world} workers")
    return node_groups(topology).of(scope), scope


def start(msg: Message, *, group: dist.ProcessGroup | None = None, tag: str, async_op: bool = True,
          topology: Topology | None = None, reducer: Any = None) -> Pending:
    """Issue ``msg``'s collective (see :class:`~lowcomm.compress.codec.Message`) on the group
    of its scope (``topology``, ``reducer``: see module docstring)."""
    t = message_tag(tag, msg)
    link: str | None = None
    if reducer is not None and msg.collective == "all_reduce" and msg.scope == "world" and _distributed(group):
        work = reducer.start(msg.buf, tag=t)
        if not async_op:
            work.wait()
            return Pending(msg.buf)
        return Pending(msg.buf, work)
    if msg.collective != "none" and _distributed(group):
        group, link = scope_group(msg.scope, group, topology)
    if msg.collective == "none" or not _distributed(group):
        if msg.collective == "all_gather":
            return Pending(msg.buf.reshape(1, -1))
        return Pending(msg.buf)  # a reduce-scatter over one worker: the whole buffer is its chunk
    if msg.collective == "all_reduce":
        work = accounting.all_reduce(msg.buf, group=group, async_op=async_op, tag=t, link=link)
        return Pending(msg.buf, work)
    if msg.collective == "all_gather":
        world = dist.get_world_size(group)
        recv = buffers.POOL.take(world * msg.buf.numel(), msg.buf)
        work = accounting.all_gather_into_tensor(recv, msg.buf, group=group, async_op=async_op, tag=t, link=link)
        return Pending(recv.view(world, -1), work)
    if msg.collective == "reduce_scatter":
        world = dist.get_world_size(group)
        if msg.buf.numel() % world:
            raise ValueError(f"reduce_scatter message {t!r}: {msg.buf.numel()} elements are not divisible "
                             f"by the group size {world} (encode with pad_to)")
        recv = buffers.POOL.take(msg.buf.numel() // world, msg.buf)
        work = accounting.reduce_scatter_tensor(recv, msg.buf, group=group, async_op=async_op, tag=t, link=link)
        return Pending(recv, work)
    return _exchange(msg, group, t, link)


def _exchange(msg: Message, group: dist.ProcessGroup | None, tag: str, link: str | None = None) -> Pending:
    """``p2p``: send to and/or receive from ``msg.peer`` in one batch (NCCL needs the batch:
    two partners that both send first can deadlock on large unbatched messages)."""
    if msg.peer is None:
        raise ValueError("a p2p message needs a peer")
    peer = dist.get_global_rank(group, msg.peer) if group is not None else msg.peer
    recv = torch.empty_like(msg.buf)
    ops = []
    if msg.send:
        ops.append(dist.P2POp(dist.isend, msg.buf, peer, group))
    if msg.recv:
        ops.append(dist.P2POp(dist.irecv, recv, peer, group))
    for w in accounting.batch_isend_irecv(ops, tag=tag, link=link):
        w.wait()
    return Pending(recv)


def run_rounds(codec: Codec, msg: Message, *, group: dist.ProcessGroup | None = None, tag: str,
               topology: Topology | None = None, reducer: Any = None,
               guard: AbstractContextManager[Any] | None = None) -> Message:
    """Complete every non-final message synchronously; return the final one (not started).
    ``guard``: held around each :meth:`~lowcomm.compress.codec.Codec.advance` (not around the
    waits), when another thread uses the codec meanwhile (:mod:`lowcomm.comm.hooks.state`)."""
    while not msg.final:
        received = start(msg, group=group, tag=tag, async_op=False, topology=topology, reducer=reducer).wait()
        with guard or nullcontext():
            msg = codec.advance(msg, received)
    return msg

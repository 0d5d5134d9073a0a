"""The sharded modes' other half: all-gathers a window ahead of the forward, and the update.

Why apart from :mod:`lowcomm.sched.engine`: the engine's backward side is the same for every
mode; only ``dear`` and ``lee18`` defer work to the next forward. After the user's step
(:meth:`Deferred.step`) every group is *pending*; a forward pre-hook on each layer calls
:meth:`Deferred.ensure_ready`, which waits for that group's all-gather, starts the next
pending groups' after it until :data:`AHEAD_BYTES` are in flight ahead of it (so they
overlap this group's forward; see there why a window and not one group or all) and

* ``dear``: decodes a compressed group's summed message if it has one, then runs the user's
  optimizer on this group's parameters only (:func:`lowcomm.optim.sharded.step_subset`, with
  the hyperparameters recorded at the step);
* ``lee18``: copies the all-gathered updated parameters into the model (the update already
  ran on this rank's shards, :class:`lowcomm.optim.sharded.ShardedOptimizer`: in
  :meth:`Deferred.step`, or group by group during backward with ``update=layer``,
  :mod:`lowcomm.sched.layer_update`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowcomm.comm import accounting
from lowcomm.comm.backends import device_backend
from lowcomm.optim.sharded import FlatShard, ShardedOptimizer, hyperparameters, step_subset
from lowcomm.runtime import timing
from lowcomm.sched.groups import Group
from lowcomm.sched.pairing import Mode

if TYPE_CHECKING:
    from lowcomm.sched.engine import Engine


#: After group g's all-gather is waited for, the pending groups after it are started until this
#: many bytes are in flight ahead of g (at least one group). One group ahead exposes each
#: all-gather's latency whenever groups are small (``lee18``'s one group per layer: 107 on
#: ResNet-50, each a few milliseconds of gloo latency that a layer's forward does not cover);
#: all groups at once at ``step()`` makes gloo's worker threads run the first groups
#: concurrently, so group 0, which the forward needs first, arrives later. Measured on 4
#: emulated workers at 1 Gbit/s, ResNet-50 (docs/benchmarks.md): ``lee18`` 1.65 s -> 1.41 s per
#: iteration, ``dear`` unchanged at its 25 MB groups; all at once: ``dear`` 1.31 -> 1.54 s.
#: On NCCL the gathers run in order on one stream either way.
AHEAD_BYTES = 32 << 20

#: On gloo, a group's all-gather larger than this travels as all-gathers of pieces this size
#: (gathered bytes; each rank sends this over the world size), queued in forward order. Why:
#: gloo runs two collectives at once, so two large groups in the window share the link and
#: group g+1, which the forward needs first, arrives as late as g+2; and one large gloo
#: all-gather alone fills 88 % of the link. In pieces, the two running at once are the head of
#: the queue. Traced on 4 emulated workers at 1 Gbit/s, ResNet-50, ``dear``'s 27 and 30 MB
#: groups (docs/benchmarks.md, "dear's large groups, traced"). NCCL runs its gathers in order
#: on one stream: not split.
AG_PIECE_BYTES = 8 << 20


class Deferred:
    """Deferred all-gathers and updates of one sharded engine (see module doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.optimizer: torch.optim.Optimizer | None = None
        self.hyper: list[dict[str, Any]] = []
        #: lee18's sharded copy of the user's optimizer (built at the first step)
        self.sharded: ShardedOptimizer | None = None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Record (DeAR) or run (lee18) the update; start the all-gather of group 0."""
        e = self.engine
        self.optimizer = optimizer
        if e.mode is Mode.DEAR:
            self.hyper = hyperparameters(optimizer)
        else:
            if self.sharded is None:
                self.sharded = ShardedOptimizer(optimizer, [
                    FlatShard(g.params, g.offsets, g.shard, e.rank * g.shard.numel()) for g in e.groups
                ])
            if not e.layer.confirm(optimizer):  # update=layer: ran group by group in backward
                self.sharded.step(optimizer)
        for g in e.groups:
            g.pending = True
        self._launch(e.groups[0])

    def _launch(self, g: Group) -> None:
        e = self.engine
        if not g.pending or g.ag_work is not None:
            return
        if g.msg is not None:  # DeAR + a summed payload: gather the summed message shards
            assert e.carrier is not None
            g.ag_work = e.carrier.start_gather(g)
            return
        if g.full:  # DeAR + a gathered payload: every rank holds the whole mean already
            g.ag_work = True
            return
        if e.mode is Mode.DEAR:
            src = g.shard
        else:
            assert self.sharded is not None
            src = self.sharded.param_shards[g.index]
        if not e.distributed:
            g.flat.copy_(src)
            g.ag_work = True
            return
        g.ag_work = self._gather(g, src)

    def _gather(self, g: Group, src: torch.Tensor) -> Any:
        """Start all-gathering every rank's ``src`` into ``g.flat``: in pieces of
        :data:`AG_PIECE_BYTES` on gloo, in one collective otherwise."""
        e = self.engine
        n, tag = src.numel(), f"{e.tag}.ag"
        world = g.flat.numel() // n
        piece = max(1, AG_PIECE_BYTES // (world * src.element_size()))  # elements per rank
        if n <= piece or src.device.type != "cpu" or device_backend(e.pg, src.device) != "gloo":
            return accounting.all_gather_into_tensor(g.flat, src, group=e.pg, async_op=True, tag=tag)
        works = [accounting.all_gather([g.flat[r * n + a:r * n + min(a + piece, n)] for r in range(world)],
                                       src[a:a + piece], group=e.pg, async_op=True, tag=tag)
                 for a in range(0, n, piece)]
        return torch.futures.collect_all([w.get_future() for w in works])  # waits for every piece

    def ensure_ready(self, gi: int) -> None:
        """Make group ``gi``'s parameters current; start the pending all-gathers after it, up to
        :data:`AHEAD_BYTES` ahead."""
        e = self.engine
        g = e.groups[gi]
        if not g.pending:
            return
        self._launch(g)
        if g.ag_work is not True:
            with timing.measure("comm_wait"):  # exposed all-gather wait inside forward
                g.ag_work.wait()  # type: ignore[attr-defined]
            timing.stream_waited()  # this group's layers compute only now (emulated compute waits)
        g.ag_work = None
        g.pending = False
        ahead = 0
        for nxt in e.groups[gi + 1 :]:
            if ahead >= AHEAD_BYTES:
                break
            if nxt.pending:
                self._launch(nxt)
                ahead += nxt.flat.nbytes
        if g.msg is not None:
            assert e.carrier is not None
            e.carrier.gather(g)  # averaged gradient -> g.flat (its decode is timed as compress)
        g.full = False
        # the update is device work on a GPU, queued before this layer's forward kernels: reported
        # as such, so emulated compute waits for it instead of hiding it (lowcomm.runtime.timing)
        with timing.measure("optimizer"):
            if e.mode is Mode.DEAR:
                assert self.optimizer is not None
                grads = [g.slice_of(i).view_as(p) for i, p in enumerate(g.params)]
                step_subset(self.optimizer, g.params, grads, self.hyper)
            else:
                with torch.no_grad():
                    for i, p in enumerate(g.params):
                        p.copy_(g.slice_of(i).view_as(p))

    def flush(self) -> None:
        """Complete all pending all-gathers/updates; lee18: consolidate the optimizer state."""
        for g in self.engine.groups:
            self.ensure_ready(g.index)
        if self.sharded is not None and self.sharded.dirty and self.optimizer is not None:
            self.sharded.consolidate(self.optimizer, self._gather_state)

    def _gather_state(self, k: int, local: torch.Tensor) -> torch.Tensor:
        e = self.engine
        full = torch.empty_like(e.groups[k].flat)
        if e.distributed:
            accounting.all_gather_into_tensor(full, local, group=e.pg, tag=f"{e.tag}.state")
        else:
            full.copy_(local)
        return full

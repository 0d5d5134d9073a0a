"""lee18's schedule in the simulator: reduce-scatter per group in backward, shard update, the
parameters all-gathered a window ahead in the next forward.

Why its own module: the per-layer update (``update=layer``) and its snapshot copies are
lee18's alone; the reduce-scatter/all-gather machinery it shares with DeAR stays in
:mod:`.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.sched.cost import SMALL_TENSOR_ELEMS
from lowcomm.sched.pairing import Mode
from lowcomm.sim.schedules.base import MIB, Sim
from lowcomm.sim.schedules.engine import TuneOptions, _ShardedSchedule, forward_groups
from lowcomm.sim.timeline import Task


@dataclass
class Lee18Options(TuneOptions):
    """The options the simulator reads when the method registry has no ``lee18``."""

    update: str = "layer"
    threshold_mb: float = 25.0
    merge_below: int = SMALL_TENSOR_ELEMS


class Lee18(_ShardedSchedule):
    """Sharded update (Lee et al. 2018): each worker updates 1/P of the model, then gathers.

    ``update=step``: one update of this rank's shard (``optimizer_s / P``) after backward's
    exchanges. ``update=layer`` (:mod:`lowcomm.sched.layer_update`): whenever a group's
    exchange is issued, every group whose exchange has arrived by then (in launch order) is
    decoded (a codec's slice) and updated (its share of ``optimizer_s / P``) on the compute
    stream, ahead of the remaining backward; after backward each remaining group is updated
    as soon as its own exchange has arrived, overlapping the exchanges still in flight. Each
    per-layer update first copies what a skipped step would restore (:meth:`snapshot_s`). The
    first all-gather starts after the last update either way, the rest a window ahead in the
    next forward (:data:`~lowcomm.sched.deferred.AHEAD_BYTES`, as the engine).
    """

    name = "lee18"
    Options = Lee18Options
    mode = Mode.SHARD
    caveat = "same updates as ssgd; optimizer state is sharded across workers."
    exact = True
    summary = "reduce-scatter per fused group, shard update, all-gather of parameters in next forward"

    def setup(self, sim: Sim) -> None:
        """Groups, and whether each group is updated as its exchange arrives."""
        super().setup(sim)
        self.per_layer = str(self.opt("update", "layer")) == "layer"
        self.inflight: list[tuple[int, Task]] = []
        self.updated: list[int] = []

    def group_plan(self, sim: Sim) -> list[list[int]]:
        """Layers fused in forward order into groups of ``threshold_mb`` (tuned with
        ``tune=true``, as DeAR's), or one group per layer with parameters (``threshold_mb=0``,
        the paper), layers under ``merge_below`` elements riding with their neighbour."""
        return forward_groups(sim, self.threshold_mb * MIB, int(self.opt("merge_below", SMALL_TENSOR_ELEMS)),
                              self.first_group_bytes())

    def update_s(self, sim: Sim, g: int) -> float:
        """Seconds of group ``g``'s shard update: its share of ``optimizer_s / P``."""
        share = sum(sim.profile.layers[i].numel for i in self.groups[g]) / max(sim.profile.numel, 1)
        return sim.optimizer_s * share / sim.p

    def snapshot_s(self, sim: Sim, g: int) -> float:
        """Seconds of the copy ``update=layer`` keeps to undo a skipped step: group ``g``'s
        slice of the weights and of one optimizer-state tensor (SGD's momentum; Adam keeps
        two), one elementwise pass each."""
        numel = sum(sim.profile.layers[i].numel for i in self.groups[g])
        return 2 * numel / sim.p * sim.c.elementwise_s_per_elem

    def after_launch(self, sim: Sim, it: int, g: int, exchange: Task, ready: Task) -> None:
        """``update=layer``: update, in launch order, the groups whose exchange has arrived."""
        if not self.per_layer:
            return
        self.inflight.append((g, exchange))
        while self.inflight and self.inflight[0][1].end <= ready.end:
            self._update(sim, it, *self.inflight.pop(0), ready)

    def _update(self, sim: Sim, it: int, k: int, exchange: Task, after: Task | None) -> Task:
        """Decode (a codec's) and update group ``k`` once ``exchange`` and ``after`` ended."""
        last = exchange
        arrived = [a for a in self.arrivals if a[0] == k]
        if arrived and self.codec is not None:  # a gathered payload: decode the full mean now
            self.arrivals.remove(arrived[0])
            last = self.codec.deferred_decode(sim, it, self.buckets[k], arrived[0][1], exchange)
        elif k in self.message:  # a summed message: decode this rank's slice now
            last = sim.compute(f"dec.g{k}", self.message.pop(k)[1] / sim.p, it, after=[exchange])
        self.updated.append(k)
        snap = sim.compute(f"snap.g{k}", self.snapshot_s(sim, k), it, kind="optimizer", after=[last, after])
        return sim.compute(f"upd.g{k}", self.update_s(sim, k), it, kind="optimizer", after=[snap])

    def finish_sync(self, sim: Sim, it: int, rs: list[Task]) -> Task:
        """``update=layer``: each group backward did not update, as soon as it arrives."""
        done = [self._update(sim, it, k, task, None) for k, task in self.inflight]
        self.inflight = []
        return super().finish_sync(sim, it, rs + done)

    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        """Update this rank's shard (what backward did not), all-gather the parameters."""
        # what backward did not update (layers outside the groups, e.g. model-parallel, too)
        seconds = sim.optimizer_s / sim.p - sum(self.update_s(sim, g) for g in self.updated)
        self.inflight, self.updated = [], []
        upd = sim.compute("upd.shard", seconds, it + 1, kind="optimizer", after=[sync])
        if self.groups:  # the rest are issued a window ahead in the forward
            self.pending_ag[0] = self.all_gather(sim, it + 1, 0, upd)

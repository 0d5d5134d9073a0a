"""The scheduling engine's methods: ``wfbp``, ``mgwfbp``, ``dear`` and the sharded base that
``lee18`` (:mod:`.lee18`) shares with DeAR, each with an optional ``compress=<codec>``.

Why here and not in :mod:`.ddp`: the engine fuses by layer groups, and DeAR/Lee'18 split a
step into a reduce-scatter during backward and all-gathers the next forward waits for. The
payload comes from the codec's declared cost (:class:`~.codec.CodecPlan`), paired by the
engine's rules (:func:`~.codec.pairing_refusal`):

* ``wfbp``/``mgwfbp`` carry any codec exactly like a DDP hook, per fused group;
* ``dear``/``lee18`` with a sum-compatible codec reduce-scatter the codec's message in
  backward; DeAR all-gathers the summed message shards before each group's forward and
  decodes there, Lee'18 decodes its own shard after backward (elementwise codecs only);
* with a gathered codec (top-k, sign, ...) the payload is exchanged and decoded in backward
  (as in a hook); the shard is taken from the decoded mean, so the all-gathers stay as
  without a codec.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from lowcomm.compress.codec import CodecCost
from lowcomm.sched.deferred import AHEAD_BYTES
from lowcomm.sched.groups import fuse_sizes
from lowcomm.sched.pairing import Mode

from lowcomm.sim.schedules.base import MIB, Schedule, Sim, groups_of, layer_buckets
from lowcomm.sim.schedules.codec import CodecPlan
from lowcomm.sim.schedules.ddp import BucketSchedule
from lowcomm.sim.timeline import Task


class WFBP(BucketSchedule):
    """Wait-free backpropagation: each layer's communication starts when its gradient is ready."""

    name = "wfbp"
    summary = "one all-reduce per layer, as soon as its gradient is ready"
    decode_after_backward = True
    caveat = "same updates as ssgd (scheduling only)."
    exact = True

    def setup(self, sim: Sim) -> None:
        """One bucket per layer with parameters."""
        layers = [i for i in reversed(range(len(sim.profile.layers)))
                  if sim.profile.layers[i].numel > 0]
        self.buckets = layer_buckets(sim, [[i] for i in layers])


def mgwfbp_groups(sim: Sim, alpha: float | None = None, beta: float | None = None) -> list[list[int]]:
    """The engine's own MG-WFBP planner (:func:`lowcomm.sched.cost.plan_mgwfbp`) on the
    profiled ready times; α, β of one all-reduce come from the network model unless given
    (the engine probes them at start-up). Returns layer groups in backward order."""
    from lowcomm.sched.cost import AlphaBeta, plan_mgwfbp

    prof = sim.profile
    layers = [i for i in range(len(prof.layers)) if prof.layers[i].numel > 0]
    if not layers:
        return []
    ready, t = {}, 0.0
    for i in reversed(range(len(prof.layers))):
        t += prof.layers[i].backward_s
        ready[i] = t
    if alpha is None or beta is None:
        alpha = sim.net.all_reduce(0.0, sim.p)
        probe = 4 * MIB
        beta = (sim.net.all_reduce(probe, sim.p) - alpha) / probe
    return groups_of(sim, plan_mgwfbp([ready[i] for i in layers], [sim.layer_bytes(i) for i in layers],
                                      [prof.layers[i].numel for i in layers], AlphaBeta(alpha, beta)))


@dataclass
class MGWFBPOptions:
    """The options the simulator reads when the method registry has no ``mgwfbp``."""

    alpha: float | None = None
    beta: float | None = None


class MGWFBP(BucketSchedule):
    """WFBP with small layers merged, so per-message latency does not dominate."""

    name = "mgwfbp"
    Options = MGWFBPOptions
    decode_after_backward = True
    caveat = "same updates as ssgd (scheduling only)."
    exact = True
    summary = "WFBP with layers merged by the alpha-beta rule"
    #: a plan a run made (layers per group, forward order) to replay instead of planning
    #: (:func:`lowcomm.sim.predict.simulate`'s ``plan``): the engine plans from timings it
    #: measures online, which a profile reproduces only approximately
    replay: list[int] | None = None

    def setup(self, sim: Sim) -> None:
        """Groups from the engine's planner, or the replayed plan."""
        self.groups = (groups_of(sim, self.replay) if self.replay is not None
                       else mgwfbp_groups(sim, self.opt("alpha", None), self.opt("beta", None)))
        self.buckets = layer_buckets(sim, self.groups)


def forward_groups(sim: Sim, threshold_bytes: float, min_numel: int = 0, first_bytes: float = 0.0) -> list[list[int]]:
    """Consecutive layers with parameters in forward order, grouped as the engine groups them
    (:func:`lowcomm.sched.groups.fuse_sizes`)."""
    layers = [i for i, layer in enumerate(sim.profile.layers) if layer.numel > 0]
    sizes = fuse_sizes([sim.layer_bytes(i) for i in layers], [sim.profile.layers[i].numel for i in layers],
                       threshold_bytes, min_numel, first_bytes)
    return [g[::-1] for g in groups_of(sim, sizes)[::-1]]  # groups_of gives backward order


class _ShardedSchedule(Schedule):
    """Reduce-scatter during backward; all-gathers that the next forward waits for."""

    mode: ClassVar[Mode]

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, codec)
        if self.codec is not None:
            self.codec.check_pairing(self.mode, self.name)

    @abstractmethod
    def group_plan(self, sim: Sim) -> list[list[int]]:
        """Layer groups in forward order."""

    #: ``threshold_mb`` when the options do not give one (``dear``'s and ``lee18``'s default)
    default_threshold_mb = 25.0
    #: thresholds (fractions of the model's gradient bytes) an ideal tuner chooses from
    TUNE_GRID = 24

    def setup(self, sim: Sim) -> None:
        """The fusion threshold (tuned with ``tune``), groups, and the bucket of each (its
        tensors, for the codec)."""
        self.threshold_mb = float(self.opt("threshold_mb", self.default_threshold_mb))
        if self.opt("tune", False):
            self.threshold_mb = self.tuned_threshold(sim)
        self.groups = self.group_plan(sim)
        self.group_of = {i: g for g, layers in enumerate(self.groups) for i in layers}
        self.first_of = {layers[0]: g for g, layers in enumerate(self.groups)}
        self.buckets = layer_buckets(sim, self.groups)
        self.pending_ag: dict[int, Task] = {}
        self.carried: dict[int, tuple[int, float]] = {}
        #: (group, cost, final collective) of gathered payloads, decoded in finish_sync
        self.arrivals: list[tuple[int, CodecCost, Task]] = []
        #: per group: (bytes of the summed message, decode seconds) of this step's codec
        self.message: dict[int, tuple[int, float]] = {}

    def tuned_threshold(self, sim: Sim) -> float:
        """What Bayesian optimization converges to at best (``tune=true``, the engine's
        :mod:`lowcomm.methods.fusion_tuning`): the fastest threshold on a log grid over the
        engine's search range, [min(tune_min_mb, hi/64), hi], hi = min(tune_max_mb, model MB),
        every other option as given."""
        total = sim.profile.numel * sim.bpe / MIB
        hi = min(float(self.opt("tune_max_mb", 256.0)), max(total, 1e-6))
        lo = min(float(self.opt("tune_min_mb", 1.0)), hi / 64)
        best = (math.inf, hi)
        for j in range(self.TUNE_GRID + 1):
            mb = lo * (hi / lo) ** (j / self.TUNE_GRID)
            trial = Sim(sim.profile, sim.p, sim.net, optimizer_s=sim.optimizer_s)
            probe = type(self)(_Fixed(self.options, mb), self.codec)
            probe.setup(trial)
            for it in range(1, 5):
                probe.iteration(trial, it)
            t = (trial.tl.end_of(4) - trial.tl.end_of(2)) / 2
            best = min(best, (t, mb))
        return best[1]

    def first_group_bytes(self) -> float:
        """Where the forward-order first group closes (``first_group_mb``; 0: at the threshold)."""
        return float(self.opt("first_group_mb", TuneOptions.first_group_mb)) * MIB

    def group_bytes(self, sim: Sim, g: int) -> int:
        """Gradient bytes of group ``g``."""
        return sum(sim.layer_bytes(i) for i in self.groups[g])

    def before_group(self, sim: Sim, it: int, g: int) -> Task | None:
        """Forward pre-hook of group g: wait for its all-gather, start the window after it."""
        ag = self.pending_ag.get(g)
        if ag is not None:
            self.launch_ahead(sim, it, g, ag)
        return ag

    def launch_ahead(self, sim: Sim, it: int, g: int, ag: Task) -> None:
        """Once ``g``'s all-gather arrived, start those after it until :data:`AHEAD_BYTES` are
        ahead (as :meth:`lowcomm.sched.deferred.Deferred.ensure_ready`); they queue on the link."""
        ahead = 0
        for j in range(g + 1, len(self.groups)):
            if ahead >= AHEAD_BYTES:
                break
            if j not in self.pending_ag:
                self.pending_ag[j] = self.all_gather(sim, it, j, ag)
            ahead += self.group_bytes(sim, j)

    def all_gather(self, sim: Sim, it: int, g: int, after: Task) -> Task:
        """Group ``g``'s all-gather before the forward, issued once ``after`` ended."""
        return sim.collective(f"ag.g{g}", "all_gather", math.ceil(self.group_bytes(sim, g) / sim.p), it,
                              after=[after])

    def after_launch(self, sim: Sim, it: int, g: int, exchange: Task, ready: Task) -> None:
        """Hook: group ``g``'s backward exchange (``exchange``, last task) was issued when
        backward task ``ready`` ended (lee18 ``update=layer`` updates arrived groups here)."""

    @abstractmethod
    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        """What ``step()`` issues once backward's reduce-scatters are done."""

    def reduce(self, sim: Sim, it: int, g: int, ready: Task) -> Task:
        """Group ``g``'s backward communication; returns its last task in backward."""
        if self.codec is None:
            return sim.collective(f"rs.g{g}", "reduce_scatter", self.group_bytes(sim, g), it,
                                  after=[ready])
        b = self.buckets[g]
        if self.codec.gathered:  # exchanged in backward, decoded to the full mean in finish_sync
            task, cost = self.codec.hook(sim, it, b, ready, defer=True)
            self.arrivals.append((g, cost, task))
            return task
        task, cost = self.codec.hook(sim, it, b, ready, last_as="reduce_scatter")
        if cost.rounds:
            last = cost.rounds[-1]
            self.message[g] = (last.nbytes, self.codec.decode_s(sim, b, last))
        return task

    def finish_sync(self, sim: Sim, it: int, rs: list[Task]) -> Task:
        """Wait for backward's exchanges; decode the gathered payloads (full mean) and, in
        Lee'18, this rank's slice of each summed message."""
        done: list[Task] = list(rs)
        if self.codec is not None:
            for g, cost, task in self.arrivals:
                done.append(self.codec.deferred_decode(sim, it, self.buckets[g], cost, task))
            if self.mode is Mode.SHARD and self.message:
                done.append(sim.compute("dec.shard", sum(s for _, s in self.message.values()) / sim.p,
                                        it, after=rs))
        return sim.tl.add("sync", "compute", 0.0, kind="sync", iteration=it, after=done)

    def iteration(self, sim: Sim, it: int) -> None:
        """Forward (waiting for pending all-gathers), backward with reduce-scatters, step."""
        for i in range(len(sim.profile.layers)):
            after: list[Task | None] = []
            if i in self.first_of:
                after.append(self.before_group(sim, it, self.first_of[i]))
            sim.forward_layer(i, it, after=after)
        self.pending_ag = {}
        self.message = {}
        self.arrivals = []
        rs: list[Task] = []
        for i in reversed(range(len(sim.profile.layers))):
            done = sim.backward_layer(i, it)
            g = self.group_of.get(i)
            if g is not None and self.groups[g][0] == i:
                rs.append(self.reduce(sim, it, g, done))
                self.after_launch(sim, it, g, rs[-1], done)
        self.after_reduce_scatter(sim, it, self.finish_sync(sim, it, rs))


@dataclass
class TuneOptions:
    """The fusion options the simulator reads: the first group's size
    (:meth:`_ShardedSchedule.first_group_bytes`) and the tuner's
    (:meth:`_ShardedSchedule.tuned_threshold`)."""

    first_group_mb: float = 1.0
    tune: bool = False
    tune_min_mb: float = 1.0
    tune_max_mb: float = 256.0


@dataclass
class DeAROptions(TuneOptions):
    """The options the simulator reads when the method registry has no ``dear``."""

    threshold_mb: float = 25.0


class DeAR(_ShardedSchedule):
    """Decoupled all-reduce: the all-gather half hides behind the next forward."""

    name = "dear"
    Options = DeAROptions
    caveat = ("same updates as ssgd (scheduling only); the update is applied in the next "
              "forward, so evaluation/checkpoints need a flush.")
    exact = True
    mode = Mode.DEAR
    summary = "reduce-scatter in backward, all-gather overlapped with the next forward"

    def group_plan(self, sim: Sim) -> list[list[int]]:
        """Groups of ``threshold_mb`` in forward order, the first of ``first_group_mb``."""
        return forward_groups(sim, self.threshold_mb * MIB, first_bytes=self.first_group_bytes())

    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        """step(): launch the all-gather of group 0; the rest are issued a window ahead."""
        self.carried = dict(self.message)
        if self.groups:
            self.pending_ag[0] = self.all_gather(sim, it + 1, 0, sync)

    def all_gather(self, sim: Sim, it: int, g: int, after: Task) -> Task:
        """A codec's summed message or the averaged gradient (nothing if gathered in backward)."""
        if self.codec is not None and self.codec.gathered:
            return after  # decoded to the full mean in finish_sync: nothing to gather
        nbytes = self.carried[g][0] if g in self.carried else self.group_bytes(sim, g)
        return sim.collective(f"ag.g{g}", "all_gather", math.ceil(nbytes / sim.p), it, after=[after])

    def before_group(self, sim: Sim, it: int, g: int) -> Task | None:
        """Wait for group g's all-gather, start the window after it, decode, apply g's update."""
        ag = self.pending_ag.get(g)
        if ag is None:  # first iteration: weights are whole already
            return None
        self.launch_ahead(sim, it, g, ag)
        last: Task = ag
        if g in self.carried:
            last = sim.compute(f"dec.g{g}", self.carried[g][1], it, after=[ag])
        share = sum(sim.profile.layers[i].numel for i in self.groups[g]) / max(sim.profile.numel, 1)
        return sim.compute(f"upd.g{g}", sim.optimizer_s * share, it, kind="optimizer",
                           after=[last])


class _Fixed:
    """``options`` with ``threshold_mb`` fixed and no tuning: one trial of the tuner."""

    def __init__(self, options: Any, threshold_mb: float) -> None:
        self._options, self.threshold_mb, self.tune = options, threshold_mb, False

    def __getattr__(self, key: str) -> Any:
        return getattr(self._options, key)

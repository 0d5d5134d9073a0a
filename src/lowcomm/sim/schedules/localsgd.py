"""Semi-synchronous schedules: ``localsgd``, ``diloco`` and ``streaming_diloco``.

Why a period-averaged iteration: these methods communicate once every ``sync_every`` (H)
steps, while the simulator prices a few back-to-back iterations; so each simulated iteration
carries ``1/H`` of a period's communication, as one task on the comm stream that the next
iteration's forward waits for (its *exposed* part) and whose ``wire_bytes`` are a period's
bytes divided by H: the trainer's ``bytes_sent_per_worker / steps``.

* ``localsgd`` / ``diloco``: one blocking all-reduce of every parameter per period (DiLoCo's
  pseudo-gradient has the parameters' size), or, with ``compress=``, the codec's declared
  rounds (:meth:`~lowcomm.compress.codec.Codec.cost`) on the whole model as one buffer, its
  encode/decode priced on the compute stream.
* ``streaming_diloco``: the model's layers in ``fragments`` (F) contiguous groups of about
  equal size (the training method's rule, :func:`lowcomm.methods.outer_sync.contiguous_groups`);
  each fragment's sync runs while ``delay`` (tau) inner steps compute, so only
  ``max(0, T_f - tau * t_step)`` of it is exposed, ``T_f`` its collective time and ``t_step``
  the compute of one step.

``inner=SPEC`` (replicas of several GPUs; needs ``--nodes`` and ``--gpus-per-node``): each
iteration is SPEC's own on a node's G workers over the intra link, then ``1/H`` of the outer
sync: the nodes' leaders' collectives over the N nodes on the inter link (one flow per node),
then a broadcast of the result inside the node; bytes per worker are the node's mean (the
leader sends, the other G-1 ranks receive).

The time model is a steady-state average; the accuracy cost (H local steps) is the caveat.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from lowcomm.compress.codec import codec_class
from lowcomm.errors import UsageError
from lowcomm.methods.outer_sync import check_fragments, contiguous_groups, parse_compress
from lowcomm.methods.replicas_inner import inner_spec
from lowcomm.sim.schedules.base import MIB, Schedule, Sim
from lowcomm.sim.schedules.codec import CodecPlan
from lowcomm.sim.timeline import Task


class LocalSGDSchedule(Schedule):
    """Compute only, plus ``1/H`` of a period's (partly hidden) syncs per iteration."""

    name = "localsgd"
    summary = "local steps; parameters averaged every sync_every steps"
    caveat = (
        "changes the optimization (sync_every local steps between averages): check the final "
        "loss against ssgd at the same steps; larger sync_every sends less and may lose more."
    )
    #: not in the advisor's default ranking of synchronous methods (a separate branch)
    semi_synchronous: ClassVar[bool] = True
    #: ``compress=`` is this method's own option (a nested codec spec), not an engine payload
    parses_compress: ClassVar[bool] = True

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, codec)
        compress = parse_compress(str(self.opt("compress", "none")), self.name)
        self.plan = None if compress is None else CodecPlan(compress[0], compress[1])
        self.sync_task: Task | None = None
        spec = inner_spec(str(self.opt("inner", "none")), self.name)
        self.inner: Schedule | None = None
        self.inner_sim: Sim | None = None
        if spec is not None:
            from lowcomm.sim.schedules import make_schedule

            self.inner = make_schedule(spec)

    def setup(self, sim: Sim) -> None:
        """The fragments (layer groups) and each one's exposed seconds and wire bytes."""
        frags = int(self.opt("fragments", 1))
        tau = int(self.opt("delay", 0))
        h = int(self.opt("sync_every", 20))
        layers = sim.profile.layers
        check_fragments(frags, len(layers))
        groups = contiguous_groups([layer.numel for layer in layers], frags)
        outer, per_worker = self._inner_setup(sim)
        exposed = compute = wire = inter = 0.0
        for g in groups:
            shapes = [tuple(s) for i in g for s in layers[i].param_shapes]
            seconds, nbytes, inter_b, work = self._sync_cost(outer, shapes)
            if outer is not sim:  # the leader broadcasts the result inside its node
                full = sum(_prod(s) for s in shapes) * sim.bpe
                assert self.inner_sim is not None
                seconds += self.inner_sim.net.broadcast(full, self.inner_sim.p)
                nbytes += sim.net.wire_bytes_of("broadcast", full, self.inner_sim.p)
            nbytes, inter_b = nbytes * per_worker, inter_b * per_worker
            exposed += max(0.0, seconds - tau * sim.profile.compute_s)
            compute += work
            wire += nbytes
            inter += inter_b
        self.exposed_s, self.compress_s = exposed / h, compute / h
        self.wire_per_step, self.inter_per_step = wire / h, inter / h
        self.sync_task = None

    def _inner_setup(self, sim: Sim) -> tuple[Sim, float]:
        """With ``inner=``: the inner schedule set up on one node (G workers, intra link), and
        the leaders' simulation (N workers, the inter link, one flow per node) with the share
        of their bytes per worker (1/G); without it, ``(sim, 1)``."""
        if self.inner is None:
            return sim, 1.0
        levels = sim.net.levels(sim.p)
        if levels is None:
            raise UsageError(
                f"{self.name}: inner= needs a two-level topology: give --nodes N "
                "and --gpus-per-node G >= 2"
            )
        nodes, g = levels
        assert sim.net.intra is not None
        intra = dataclasses.replace(
            sim.net,
            inter=sim.net.intra,
            algorithm="ring",
            collective_alpha={},
            collective_beta_scale={},
        )
        inner_profile = self.inner.profile_for(sim.profile)
        self.inner_sim = Sim(
            inner_profile,
            g,
            intra,
            bucket_mb=sim.bucket_bytes / MIB,
            first_bucket_mb=sim.first_bucket_bytes / MIB,
            optimizer_s=self.inner.optimizer_s(inner_profile, g),
        )
        self.inner_sim.tl = sim.tl  # one timeline: the outer sync follows the inner step
        self.inner.setup(self.inner_sim)
        leaders = dataclasses.replace(sim.net, intra=None, gpus_per_node=1, algorithm="ring")
        return Sim(sim.profile, nodes, leaders), 1.0 / g

    def _sync_cost(
        self, sim: Sim, shapes: list[tuple[int, ...]]
    ) -> tuple[float, float, float, float]:
        """(collective seconds, wire bytes, inter-node bytes, codec compute seconds) of one sync."""
        numel = sum(_prod(s) for s in shapes)
        rounds: list[tuple[str, int]] = [("all_reduce", numel * sim.bpe)]
        work = 0.0
        if self.plan is not None:
            codec = codec_class(self.plan.name)(self.plan.options, world=sim.p)
            cost = codec.cost(shapes, world=sim.p, dtype_bytes=sim.bpe)
            rounds = [(r.collective, r.nbytes) for r in cost.rounds]
            work = sim.price(cost.encode) + sum(sim.price(r.then) for r in cost.rounds)
        seconds = wire = inter = 0.0
        for collective, nbytes in rounds:
            seconds += _seconds(sim, collective, nbytes)
            wire += sim.net.wire_bytes_of(collective, nbytes, sim.p)
            inter += sim.net.inter_bytes(collective, nbytes, sim.p)
        return seconds, wire, inter, work

    def iteration(self, sim: Sim, it: int) -> None:
        """Forward (after the previous sync's exposed part), backward, step, this step's share."""
        if self.inner is not None and self.inner_sim is not None:
            self.inner.iteration(self.inner_sim, it)  # the node's synchronous step
            sync = sim.tl.add(
                "outer.sync",
                "comm",
                self.exposed_s,
                kind="comm",
                iteration=it,
                after=sim.tl.of_iteration(it),
                wire_bytes=self.wire_per_step,  # type: ignore[arg-type]
                inter_bytes=self.inter_per_step,
            )
            sim.tl.add("outer.wait", "compute", 0.0, kind="comm", iteration=it, after=[sync])
            return
        for i in range(len(sim.profile.layers)):
            sim.forward_layer(i, it, after=[self.sync_task] if i == 0 else ())
        for i in reversed(range(len(sim.profile.layers))):
            sim.backward_layer(i, it)
        opt = sim.tl.add("opt", "compute", sim.optimizer_s, kind="optimizer", iteration=it)
        if self.compress_s:
            sim.compute("outer.compress", self.compress_s, it, after=[opt])
        self.sync_task = sim.tl.add(
            "outer.sync",
            "comm",
            self.exposed_s,
            kind="comm",
            iteration=it,
            after=[opt],
            wire_bytes=self.wire_per_step,  # type: ignore[arg-type]
            inter_bytes=self.inter_per_step,
        )


class DiLoCoSchedule(LocalSGDSchedule):
    """DiLoCo: the same traffic as Local SGD (pseudo-gradients have the parameters' size),
    or a codec's, every H steps."""

    name = "diloco"
    summary = (
        "local steps; outer Nesterov step on the averaged pseudo-gradient every sync_every steps"
    )


class StreamingDiLoCoSchedule(LocalSGDSchedule):
    """Streaming DiLoCo: F fragment syncs per period, each overlapped with ``delay`` steps."""

    name = "streaming_diloco"
    summary = "DiLoCo with fragment syncs staggered over the period, overlapped with inner steps"


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _seconds(sim: Sim, collective: str, nbytes: float) -> float:
    """The network model's time of one collective over all ``sim.p`` workers."""
    if sim.p == 1 or collective == "none":
        return 0.0
    if collective == "all_reduce":
        return sim.net.all_reduce(nbytes, sim.p)
    if collective == "all_gather":
        return sim.net.all_gather(nbytes, sim.p)
    if collective == "reduce_scatter":
        return sim.net.reduce_scatter(nbytes, sim.p)
    return sim.net.point_to_point(nbytes)

"""What every schedule shares: the model's gradient tensors, the simulation state and the
priced kernels, and the :class:`Schedule` interface.

Why a separate module: the DDP-bucket schedules (:mod:`.ddp`), the engine schedules
(:mod:`.engine`) and the codec emission (:mod:`.codec`) all issue tasks through :class:`Sim`
and plan over :class:`Bucket` s; none of them should depend on another for that.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lowcomm.compress.codec import Work
from lowcomm.errors import check_positive
from lowcomm.methods.base import DDP_BUCKET_MB, DDP_FIRST_BUCKET_MB
from lowcomm.sim.network import NetworkModel
from lowcomm.sim.profile import Profile
from lowcomm.sim.timeline import Task, Timeline

if TYPE_CHECKING:
    from lowcomm.sim.schedules.codec import CodecPlan

MIB = 1024 * 1024


@dataclass(frozen=True)
class GradTensor:
    """One parameter's gradient: the layer producing it and its shape (codecs cost by shape)."""

    layer: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the gradient."""
        return math.prod(self.shape)


@dataclass
class Bucket:
    """Gradients fused into one buffer (a DDP bucket or an engine group), in backward order."""

    index: int
    tensors: list[GradTensor]

    @property
    def numel(self) -> int:
        """Elements of the fused buffer."""
        return sum(t.numel for t in self.tensors)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes a codec's :meth:`~lowcomm.compress.codec.Codec.cost` is asked about."""
        return [t.shape for t in self.tensors]

    @property
    def ready_layer(self) -> int:
        """The layer whose backward completes the bucket (lowest index: backward runs last→first)."""
        return min(t.layer for t in self.tensors)


#: the compute-stream work that is host CPU work under emulated compute (the layers are waits)
HOST_KINDS = frozenset({"compress", "optimizer", "contention"})

#: an SGD step's time without its momentum, as a share of the step with it (bytes moved per
#: parameter with weight decay, 24 of 44: :meth:`Schedule.optimizer_s`)
STEP_WITHOUT_MOMENTUM = 24 / 44


class Sim:
    """Shared state of one simulation run: the profile, P, network, timeline, priced kernels."""

    def __init__(self, profile: Profile, workers: int, network: NetworkModel, *,
                 bucket_mb: float = DDP_BUCKET_MB, first_bucket_mb: float = DDP_FIRST_BUCKET_MB, optimizer_s: float | None = None,
                 rounds_beside: bool = False) -> None:
        check_positive("bucket_mb", bucket_mb)
        check_positive("first_bucket_mb", first_bucket_mb)
        self.bucket_bytes = bucket_mb * MIB
        self.first_bucket_bytes = first_bucket_mb * MIB
        self.profile = profile
        self.p = workers
        self.net = network
        self.net_queued = network.queued()  # collectives that wait for the link (None: same α)
        self.net_beside = network.beside()  # ... beside a transfer (None: not measured)
        self.tl = Timeline()
        if network.contention_on == "host" and network.contention_s(1.0) > 0:
            self.tl.host_kinds = HOST_KINDS
        self.bpe = profile.bytes_per_elem
        self.c = profile.costs
        #: seconds of one optimizer step: the schedule's :meth:`Schedule.optimizer_s` (``simulate``
        #: passes it), else the profile's
        self.optimizer_s = profile.optimizer_s if optimizer_s is None else optimizer_s
        #: the DDP hooks run a codec's rounds on a thread of their own (:mod:`.codec`)
        self.rounds_beside = rounds_beside

    # -- model ---------------------------------------------------------------------------
    def tensors_backward(self) -> list[GradTensor]:
        """Gradient tensors in the order backward produces them (last layer first)."""
        out = []
        for i in reversed(range(len(self.profile.layers))):
            for s in reversed(self.profile.layers[i].param_shapes):
                out.append(GradTensor(i, tuple(s)))
        return [t for t in out if t.numel > 0]

    def layer_bytes(self, i: int) -> int:
        """Gradient bytes of layer ``i``."""
        return self.profile.layers[i].numel * self.bpe

    # -- kernels (seconds) ----------------------------------------------------------------
    def price(self, work: Work) -> float:
        """Seconds of a codec phase's kernels at the profile's measured per-unit costs."""
        c = self.c
        return (work.elementwise * c.elementwise_s_per_elem + work.matmul_flops * c.matmul_s_per_flop
                + work.orthogonalize * c.orthogonalize_s_per_elem + work.topk * c.topk_s_per_elem
                + work.scatter * c.scatter_s_per_elem)

    # -- tasks ---------------------------------------------------------------------------
    def compute(self, name: str, seconds: float, it: int, *, kind: str = "compress",
                after: Iterable[Task | None] = ()) -> Task:
        """Work on the compute stream (it delays whatever compute is issued after it)."""
        return self.tl.add(name, "compute", seconds, kind=kind, iteration=it, after=after)

    def comm_side(self, name: str, seconds: float, it: int, after: Iterable[Task | None] = ()) -> Task:
        """Compression work done in a collective's callback, on the comm chain.

        The same seconds are taken from compute (kind ``contention``) from when the callback
        runs (:meth:`Timeline.add_when_ready`): on shared cores it is CPU work of the same
        process, as a collective's is; on a GPU its kernels run on the device between
        backward's, and emulated compute waits for it as for any device work. Left out,
        Power-SGD's orthogonalization, Q product and decode ran for free beside backward: its
        real-compute rows came out 13-18 % fast (ResNet-18, 4 workers on two cores) and its
        emulated ones 10.5 % (ResNet-50; docs/simulator.md 5.2, 5.3)."""
        task = self.tl.add(name, "comm", seconds, kind="compress", iteration=it, after=after)
        if seconds > 0:
            self.tl.add_when_ready(f"cpu.{name}", "compute", seconds, kind="contention", iteration=it,
                                   ready=task.start)
        return task

    def collective(self, name: str, collective: str, payload: int, it: int,
                   after: Iterable[Task | None] = (), *, timed_bytes: int | None = None,
                   scope: str = "world", algorithm: str | None = None) -> Task:
        """One collective of ``payload`` bytes per worker (the accounting layer's convention).

        ``timed_bytes``: bytes that set its duration when they differ from what this worker
        sends (a receive-only point-to-point round). ``scope``: the codec round's process
        group (``world``, ``intra``, ``inter``; :meth:`NetworkModel.scoped`). ``algorithm``:
        an all-reduce's algorithm when the method picks it (``flat``, ``hierarchical``,
        ``hybrid``; the ``hier`` method), else the network model's."""
        nbytes = payload if timed_bytes is None else timed_bytes
        t = self._seconds(self.net, collective, nbytes, scope, algorithm)
        queued_net = self.net_queued
        queued = beside = None
        if queued_net is not None and collective in self.net.queued_overlap:
            # two at a time: the queued latency overlaps the transfer before (Timeline.add)
            wire_s = t - self._seconds(self.net, collective, 0, scope, algorithm)
            latency_s = self._seconds(queued_net, collective, 0, scope, algorithm)
            if self.net_beside is None:  # a probe without the measurement: the older rule
                queued = max(wire_s, latency_s)
            else:
                beside = (wire_s, latency_s, self._seconds(self.net_beside, collective, 0, scope, algorithm))
        elif queued_net is not None:
            queued = self._seconds(queued_net, collective, nbytes, scope, algorithm)
        p = self.p
        if algorithm is None:
            algorithm = self.net.algorithm if self.net.algorithm in ("hierarchical", "hybrid") else "flat"
        wire = self.net.wire_bytes_of(collective, payload, p, scope, algorithm)
        inter = self.net.inter_bytes(collective, payload, p, scope, algorithm)
        cpu = self.net.contention_s(wire)
        # Emulated compute: the layers wait, so the CPU the library's threads take slows only
        # the host work that runs beside the transfer (Timeline.host_seconds).
        on_host = cpu if self.net.contention_on == "host" else 0.0
        task = self.tl.add(name, "comm", t, kind="comm", iteration=it, after=after, wire_bytes=wire,
                           inter_bytes=inter, queued_duration=queued, beside=beside, cpu_s=on_host)
        if cpu > 0 and not on_host:
            # Real compute sharing cores with the library's threads: the CPU they take is
            # charged to the compute stream when the collective is issued (not to the comm
            # stream: the wire time is the probe's, which already includes those threads).
            self.tl.add(f"cpu.{name}", "compute", cpu, kind="contention", iteration=it)
        return task

    def _seconds(self, net: NetworkModel, collective: str, nbytes: int, scope: str, algorithm: str | None) -> float:
        """One collective's seconds on ``net`` (see :meth:`collective`)."""
        if collective == "all_reduce" and algorithm is not None and scope == "world":
            return net.all_reduce_with(algorithm, nbytes, self.p)
        return net.scoped(collective, nbytes, self.p, scope)  # "world": the flat collective

    def forward_layer(self, i: int, it: int, after: Iterable[Task | None] = ()) -> Task:
        """Layer ``i``'s forward on the compute stream."""
        return self.tl.add(f"fwd.{i}", "compute", self.profile.layers[i].forward_s,
                           kind="forward", iteration=it, after=after)

    def backward_layer(self, i: int, it: int) -> Task:
        """Layer ``i``'s backward on the compute stream (its gradients are ready at its end)."""
        return self.tl.add(f"bwd.{i}", "compute", self.profile.layers[i].backward_s,
                           kind="backward", iteration=it)


@dataclass
class NoOptions:
    """Schedules without options of their own."""


class Schedule(ABC):
    """Which tasks one iteration issues, in program order.

    ``options`` is the method's own options object (``lowcomm.methods``), so a spec that
    trains also simulates; schedules read the fields they need with :meth:`opt`. ``codec``
    (a :class:`~lowcomm.sim.schedules.codec.CodecPlan`) is the payload, when there is one.
    """

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    summary: ClassVar[str] = ""
    #: under which conditions it keeps accuracy (the advisor prints it)
    caveat: ClassVar[str] = ""
    #: same updates as synchronous SGD (scheduling only), when it carries no codec
    exact: ClassVar[bool] = False
    #: a training method the advisor compares (not a measurement baseline)
    advised: ClassVar[bool] = True

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.codec = codec

    def opt(self, key: str, default: Any) -> Any:
        """The option ``key`` if the options object has it (and it is set), else ``default``."""
        value = getattr(self.options, key, None)
        return default if value is None else value

    def profile_for(self, profile: Profile) -> Profile:
        """The profile whose model this method trains (Pufferfish: the factorized one)."""
        return profile

    def carries_momentum(self, workers: int) -> bool:
        """Its codec keeps SGD's momentum (momentum correction, on by default where a codec
        has it), so the optimizer steps without one."""
        return self.codec is not None and self.codec.codec(workers).momentum_factor != 0.0

    def optimizer_s(self, profile: Profile, workers: int) -> float:
        """Seconds of the optimizer step on ``profile`` (the model as trained).

        With a codec that carries the momentum, SGD has no momentum buffer to update: of the
        44 bytes per parameter torch's SGD step moves with momentum and weight decay (the decay
        12, the buffer's scale and add 8 + 12, the update 12) it moves 24, so the step costs
        :data:`STEP_WITHOUT_MOMENTUM` of its measured time (memory-bound). The codec's velocity
        does that work instead, and its measured price includes it: keeping it in the optimizer
        too counted it twice (emulated ResNet-50, 4 workers: gTop-k's optimizer phase 53-58 ms
        against 100-105 ms for ``nocomm``; docs/simulator.md 5.3)."""
        if not self.carries_momentum(workers):
            return profile.optimizer_s
        step = profile.optimizer_s if profile.optimizer_step_s is None else profile.optimizer_step_s
        return max(0.0, profile.optimizer_s - (1.0 - STEP_WITHOUT_MOMENTUM) * step)

    def setup(self, sim: Sim) -> None:  # noqa: B027 - optional hook, not abstract
        """Plan buckets/groups once per run (nothing to plan by default)."""

    @abstractmethod
    def iteration(self, sim: Sim, it: int) -> None:
        """Add iteration ``it``'s tasks to ``sim.tl``."""


def ddp_buckets(tensors: list[GradTensor], bpe: int, cap_bytes: float,
                first_cap_bytes: float) -> list[Bucket]:
    """DDP's assignment: fill in backward order, close a bucket once it reaches its cap."""
    buckets: list[Bucket] = []
    cur: list[GradTensor] = []
    size = 0
    for t in tensors:
        cur.append(t)
        size += t.numel * bpe
        limit = first_cap_bytes if not buckets else cap_bytes
        if size >= limit:
            buckets.append(Bucket(len(buckets), cur))
            cur, size = [], 0
    if cur:
        buckets.append(Bucket(len(buckets), cur))
    return buckets


def layer_buckets(sim: Sim, groups: list[list[int]]) -> list[Bucket]:
    """One bucket per group of layers (the engine's fusion groups), tensors in backward order."""
    by_layer: dict[int, list[GradTensor]] = {}
    for t in sim.tensors_backward():
        by_layer.setdefault(t.layer, []).append(t)
    return [Bucket(k, [t for i in g for t in by_layer.get(i, [])]) for k, g in enumerate(groups)]


def groups_of(sim: Sim, sizes: list[int]) -> list[list[int]]:
    """Layer groups in backward order from the engine's plan: layer counts per group in forward
    order (``group_sizes_units`` in a run's summary), over the layers with parameters."""
    from lowcomm.errors import UsageError

    layers = [i for i, layer in enumerate(sim.profile.layers) if layer.numel > 0]
    if sum(sizes) != len(layers) or min(sizes, default=1) < 1:
        raise UsageError(f"a plan of {sum(sizes)} layers in groups {sizes} does not fit the profile's "
                         f"{len(layers)} layers with parameters")
    groups, start = [], 0
    for n in sizes:
        groups.append(layers[start:start + n])
        start += n
    return [list(reversed(g)) for g in reversed(groups)]

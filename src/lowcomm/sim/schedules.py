"""One schedule per ``--method`` name: which tasks one training iteration issues, and when.

Each schedule adds the iteration's tasks to a :class:`~lowcomm.sim.timeline.Timeline` in the
order the training code issues them, with the same overlap rules as the code:

* DDP-style methods (``ssgd``, ``fp16``, ``bf16``, the compressors, ``pufferfish``): gradient
  buckets of ``bucket_mb`` (first bucket 1 MiB) in reverse parameter order; a bucket's hook
  runs on the compute stream as soon as its last gradient is ready, its collectives run on
  the comm stream while backward continues; the optimizer waits for every bucket.
* ``wfbp``: one all-reduce per layer as soon as its gradient is ready.
* ``mgwfbp``: layers merged by the α-β rule (merge when the group's all-reduce could not
  start before the next layer's gradient is ready anyway, or the wait is shorter than α;
  layers under 8192 elements always merged).
* ``dear``: reduce-scatter per fused group during backward; the all-gather of group 0 starts
  at ``step()``, the all-gather of group g+1 is issued in group g's forward pre-hook, and
  each group's forward waits for its all-gather (and applies the update) first.
* ``lee18``: reduce-scatter per layer during backward, update of one's own 1/P shard, then
  all-gather of the updated parameters per layer, each layer's next forward waiting on it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from lowcomm.errors import UsageError, check_positive
from lowcomm.sim.network import NetworkModel, collective_wire_bytes
from lowcomm.sim.profile import Profile
from lowcomm.sim.timeline import Task, Timeline

MIB = 1024 * 1024


@dataclass(frozen=True)
class GradTensor:
    layer: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def matrix(self) -> tuple[int, int] | None:
        """(m, n) view used by low-rank compressors, or None for 1-D tensors."""
        if len(self.shape) < 2:
            return None
        return self.shape[0], math.prod(self.shape[1:])


@dataclass
class Bucket:
    index: int
    tensors: list[GradTensor]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def ready_layer(self) -> int:
        """The layer whose backward completes the bucket (lowest index: backward runs last→first)."""
        return min(t.layer for t in self.tensors)


class Sim:
    """Shared state of one simulation run: the profile, P, network, timeline, cost helpers."""

    def __init__(self, profile: Profile, workers: int, network: NetworkModel, *,
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0) -> None:
        check_positive("bucket_mb", bucket_mb)
        check_positive("first_bucket_mb", first_bucket_mb)
        self.bucket_bytes = bucket_mb * MIB
        self.first_bucket_bytes = first_bucket_mb * MIB
        self.profile = profile
        self.p = workers
        self.net = network
        self.tl = Timeline()
        self.bpe = profile.bytes_per_elem
        self.c = profile.costs

    # -- model ---------------------------------------------------------------------------
    def tensors_backward(self) -> list[GradTensor]:
        """Gradient tensors in the order backward produces them (last layer first)."""
        out = []
        for i in reversed(range(len(self.profile.layers))):
            for s in reversed(self.profile.layers[i].param_shapes):
                out.append(GradTensor(i, tuple(s)))
        return [t for t in out if t.numel > 0]

    def layer_bytes(self, i: int) -> int:
        return self.profile.layers[i].numel * self.bpe

    # -- kernels (seconds) ----------------------------------------------------------------
    def elementwise(self, n: float) -> float:
        return n * self.c.elementwise_s_per_elem

    def matmul(self, m: int, n: int, r: int) -> float:
        return 2.0 * m * n * r * self.c.matmul_s_per_flop

    def orthogonalize(self, m: int, r: int) -> float:
        return m * r * self.c.orthogonalize_s_per_elem

    def topk(self, n: float) -> float:
        return n * self.c.topk_s_per_elem

    def scatter(self, n: float) -> float:
        return n * self.c.scatter_s_per_elem

    def codec(self, name: str, n: float) -> tuple[float, float] | None:
        """(encode, decode) seconds of ``n`` elements from the profile's measured compressor."""
        c = self.profile.compressors.get(name)
        if not c:
            return None
        return n * c.get("encode_s_per_elem", 0.0), n * c.get("decode_s_per_elem", 0.0)

    # -- tasks ---------------------------------------------------------------------------
    def compute(self, name: str, seconds: float, it: int, *, kind: str = "compress",
                after: Any = ()) -> Task:
        return self.tl.add(name, "compute", seconds, kind=kind, iteration=it, after=after)

    def comm_side(self, name: str, seconds: float, it: int, after: Any = ()) -> Task:
        """Compression work done in a collective's callback, on the comm chain."""
        return self.tl.add(name, "comm", seconds, kind="compress", iteration=it, after=after)

    def collective(self, name: str, collective: str, payload: int, it: int,
                   after: Any = ()) -> Task:
        """One collective of ``payload`` bytes per worker (the accounting layer's convention)."""
        p = self.p
        if collective == "all_reduce":
            t = self.net.all_reduce(payload, p)
        elif collective == "reduce_scatter":
            t = self.net.reduce_scatter(payload, p)
        elif collective == "all_gather":
            t = self.net.all_gather(payload, p)
        elif collective == "broadcast":
            t = self.net.broadcast(payload, p)
        else:
            raise ValueError(collective)
        return self.tl.add(name, "comm", t, kind="comm", iteration=it, after=after,
                           wire_bytes=collective_wire_bytes(collective, payload, p))

    def forward_layer(self, i: int, it: int, after: Any = ()) -> Task:
        return self.tl.add(f"fwd.{i}", "compute", self.profile.layers[i].forward_s,
                           kind="forward", iteration=it, after=after)

    def backward_layer(self, i: int, it: int) -> Task:
        return self.tl.add(f"bwd.{i}", "compute", self.profile.layers[i].backward_s,
                           kind="backward", iteration=it)


# ---------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------
@dataclass
class NoOptions:
    pass


class Schedule(ABC):
    """``options`` is the method's own options object (``lowcomm.methods``), so a spec that
    trains also simulates; schedules read the fields they need with :meth:`opt`."""

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    summary: ClassVar[str] = ""

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    def opt(self, key: str, default: Any) -> Any:
        value = getattr(self.options, key, None)
        return default if value is None else value

    def profile_for(self, profile: Profile) -> Profile:
        """The profile whose model this method trains (Pufferfish: the factorized one)."""
        return profile

    def setup(self, sim: Sim) -> None:
        """Plan buckets/groups once per run."""

    @abstractmethod
    def iteration(self, sim: Sim, it: int) -> None:
        """Implemented by each schedule."""


SCHEDULES: dict[str, type[Schedule]] = {}


def _register(cls: type[Schedule]) -> type[Schedule]:
    SCHEDULES[cls.name] = cls
    return cls


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
    by_layer: dict[int, list[GradTensor]] = {}
    for t in sim.tensors_backward():
        by_layer.setdefault(t.layer, []).append(t)
    return [Bucket(k, [t for i in g for t in by_layer.get(i, [])]) for k, g in enumerate(groups)]


class BucketSchedule(Schedule):
    """DDP-style: forward, backward with per-bucket hooks, wait for all buckets, step."""

    def setup(self, sim: Sim) -> None:
        self.buckets = ddp_buckets(sim.tensors_backward(), sim.bpe, sim.bucket_bytes,
                                   sim.first_bucket_bytes)

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        """Issue bucket ``b``'s communication; return the task the optimizer must wait for."""
        return sim.collective(f"ar.b{b.index}", "all_reduce", b.numel * sim.bpe, it,
                              after=[ready])

    def iteration(self, sim: Sim, it: int) -> None:
        for i in range(len(sim.profile.layers)):
            sim.forward_layer(i, it)
        by_ready: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            by_ready.setdefault(b.ready_layer, []).append(b)
        pending: list[Task | None] = []
        for i in reversed(range(len(sim.profile.layers))):
            done = sim.backward_layer(i, it)
            for b in by_ready.get(i, []):
                pending.append(self.hook(sim, it, b, done))
        sim.tl.add("opt", "compute", sim.profile.optimizer_s, kind="optimizer", iteration=it,
                   after=pending)


@_register
class SSGD(BucketSchedule):
    name = "ssgd"
    summary = "DDP bucketed all-reduce overlapped with backward"


@_register
class NoComm(BucketSchedule):
    name = "nocomm"
    summary = "no communication (compute lower bound)"

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        return None


class _HalfPrecision(BucketSchedule):
    """Cast to 16 bits, all-reduce, cast back: half the bytes plus two elementwise passes."""

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        enc_s, dec_s = sim.codec(self.name, b.numel) or (sim.elementwise(b.numel),) * 2
        enc = sim.compute(f"enc.b{b.index}", enc_s, it, after=[ready])
        ar = sim.collective(f"ar.b{b.index}", "all_reduce", b.numel * 2, it, after=[enc])
        return sim.comm_side(f"dec.b{b.index}", dec_s, it, after=[ar])


@_register
class FP16(_HalfPrecision):
    name = "fp16"
    summary = "fp16 all-reduce"


@_register
class BF16(_HalfPrecision):
    name = "bf16"
    summary = "bf16 all-reduce"


@_register
class WFBP(BucketSchedule):
    name = "wfbp"
    summary = "one all-reduce per layer, as soon as its gradient is ready"

    def setup(self, sim: Sim) -> None:
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
    sizes = plan_mgwfbp([ready[i] for i in layers], [sim.layer_bytes(i) for i in layers],
                        [prof.layers[i].numel for i in layers], AlphaBeta(alpha, beta))
    groups, start = [], 0
    for n in sizes:
        groups.append(layers[start:start + n])
        start += n
    return [list(reversed(g)) for g in reversed(groups)]


@_register
class MGWFBP(BucketSchedule):
    name = "mgwfbp"
    summary = "WFBP with layers merged by the alpha-beta rule"

    def setup(self, sim: Sim) -> None:
        self.groups = mgwfbp_groups(sim, self.opt("alpha", None), self.opt("beta", None))
        self.buckets = layer_buckets(sim, self.groups)


@_register
class Pufferfish(SSGD):
    name = "pufferfish"
    summary = "DDP all-reduce of the low-rank factorized model"

    @dataclass
    class Options:  # type: ignore[no-redef]
        rank_ratio: float = 0.25

    def profile_for(self, profile: Profile) -> Profile:
        if profile.factorized is None:
            raise UsageError("method 'pufferfish' needs the profile of the factorized model "
                             "(key 'factorized'); re-run 'lowcomm profile' where lowcomm.lowrank "
                             "is available or add it by hand")
        return profile.factorized


# -- compressors -------------------------------------------------------------------------
def split_lowrank(b: Bucket, rank: int, mcr: float) -> tuple[list[tuple[int, int, int]], int]:
    """Matrices compressed at ``rank`` as (m, n, r) and the numel sent uncompressed.

    A tensor is compressed iff (m + n)·r·min_compression_rate < m·n (PyTorch's rule).
    """
    mats, plain = [], 0
    for t in b.tensors:
        mn = t.matrix()
        if mn is not None:
            m, n = mn
            r = min(rank, m, n)
            if (m + n) * r * mcr < m * n:
                mats.append((m, n, r))
                continue
        plain += t.numel
    return mats, plain


@_register
class PowerSGD(BucketSchedule):
    name = "powersgd"
    summary = "rank-r Power-SGD: two dependent all-reduces per bucket (P, then Q)"

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        """As in ``comm/hooks/lowrank.py``: the P all-reduce is blocking inside the hook, so
        backward stalls until it returns; orthogonalization and Q = MᵀP run in the hook too;
        the Q all-reduce is asynchronous and decoding runs in its callback."""
        mats, plain = split_lowrank(b, self.opt("rank", 4), self.opt("min_compression_rate", 2.0))
        k = b.index
        if not mats:  # nothing compressible: one plain all-reduce
            return sim.collective(f"ar1.b{k}", "all_reduce", b.numel * sim.bpe, it, after=[ready])
        dense = sum(m * n for m, n, _ in mats)
        enc = sim.compute(f"enc.b{k}", sim.elementwise(dense)
                          + sum(sim.matmul(m, n, r) for m, n, r in mats), it, after=[ready])
        ar1 = sim.collective(f"ar1.b{k}", "all_reduce",
                             (sum(m * r for m, _, r in mats) + plain) * sim.bpe, it, after=[enc])
        mid = sim.compute(f"orth.b{k}", sum(sim.orthogonalize(m, r) + sim.matmul(m, n, r)
                                            for m, n, r in mats), it, after=[ar1])
        ar2 = sim.collective(f"ar2.b{k}", "all_reduce", sum(n * r for _, n, r in mats) * sim.bpe,
                             it, after=[mid])
        return sim.comm_side(f"dec.b{k}", sum(sim.matmul(m, n, r) for m, n, r in mats)
                             + sim.elementwise(dense), it, after=[ar2])


@_register
class ACPSGD(BucketSchedule):
    name = "acpsgd"
    summary = "ACP-SGD: alternate P and Q, one all-reduce per bucket"

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        mats, plain = split_lowrank(b, self.opt("rank", 4), self.opt("min_compression_rate", 2.0))
        k = b.index
        p_step = it % 2 == 1
        dense = sum(m * n for m, n, _ in mats)
        # orthogonalize the previous factor, one projection, local error-feedback residual
        enc = sim.compute(
            f"enc.b{k}",
            sum(sim.orthogonalize(n if p_step else m, r) + 2 * sim.matmul(m, n, r)
                for m, n, r in mats) + 2 * sim.elementwise(dense), it, after=[ready])
        factor = sum((m if p_step else n) * r for m, n, r in mats)
        ar = sim.collective(f"ar.b{k}", "all_reduce", (factor + plain) * sim.bpe, it, after=[enc])
        if not mats:
            return ar
        return sim.comm_side(f"dec.b{k}", sum(sim.matmul(m, n, r) for m, n, r in mats), it,
                             after=[ar])


@_register
class SignSGD(BucketSchedule):
    name = "signsgd"
    summary = "EF scaled sign, 1 bit/element all-gathered (grows with P)"
    extra_passes = 0

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        n = b.numel
        # measured codec (or: |.|_1 scale + sign/pack ~ 2 passes, unpack+scale ~ 1 pass per
        # worker), plus error feedback / momentum passes
        enc_s, dec_s = sim.codec(self.name, n) or (sim.elementwise(2 * n), sim.elementwise(n))
        enc = sim.compute(f"enc.b{b.index}", enc_s + sim.elementwise((2 + self.extra_passes) * n),
                          it, after=[ready])
        payload = (n + 7) // 8 + 4 * len(b.tensors)
        ag = sim.collective(f"ag.b{b.index}", "all_gather", payload, it, after=[enc])
        # decode every worker's payload and add it up
        return sim.comm_side(f"dec.b{b.index}", sim.p * dec_s + sim.elementwise(sim.p * n), it,
                             after=[ag])


@_register
class Signum(SignSGD):
    name = "signum"
    summary = "momentum + sign, majority vote of all-gathered signs"
    extra_passes = 1


@_register
class TopK(BucketSchedule):
    name = "topk"
    summary = "top-k values + int32 indices all-gathered (grows with P)"

    def k_of(self, b: Bucket) -> int:
        return max(1, min(b.numel, math.ceil(self.opt("density", 0.01) * b.numel)))

    def encode(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task:
        n = b.numel
        codec = sim.codec("topk", n)
        select = codec[0] if codec else sim.topk(n)
        # error-feedback add and residual update around the selection
        return sim.compute(f"enc.b{b.index}", sim.elementwise(2 * n) + select, it,
                           after=[ready])

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        k = self.k_of(b)
        enc = self.encode(sim, it, b, ready)
        ag = sim.collective(f"ag.b{b.index}", "all_gather", k * (sim.bpe + 4), it, after=[enc])
        return sim.comm_side(f"dec.b{b.index}", sim.scatter(sim.p * k)
                             + sim.elementwise(b.numel), it, after=[ag])


def gtopk_rounds(p: int) -> tuple[int, int]:
    """(recursive-doubling rounds, extra exchanges): a non-power-of-two world folds the
    workers beyond the largest power of two P' in (one exchange in) and out (one exchange
    back), as ``comm/hooks/gtopk.py`` does."""
    if p <= 1:
        return 0, 0
    core = 1 << (p.bit_length() - 1)
    return core.bit_length() - 1, (2 if core != p else 0)


@_register
class GTopK(TopK):
    name = "gtopk"
    summary = "global top-k by recursive doubling: log2 P rounds of k pairs"

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        """Blocking inside the hook (``comm/hooks/gtopk.py``): every exchange and merge stalls
        backward; decoding is done in the hook too."""
        k = self.k_of(b)
        last: Task = self.encode(sim, it, b, ready)
        rounds, extra = gtopk_rounds(sim.p)
        nbytes = k * (sim.bpe + 4)
        names = ["in"] * (extra // 2) + [f"x{r}" for r in range(rounds)] + ["out"] * (extra // 2)
        for name in names:
            # the folded-in worker's exchange carries no merge on the way back
            x = sim.tl.add(f"{name}.b{b.index}", "comm", sim.net.point_to_point(nbytes),
                           kind="comm", iteration=it, after=[last],
                           wire_bytes=collective_wire_bytes("p2p", nbytes, sim.p))
            merge = sim.topk(2 * k) if name != "out" else 0.0
            last = sim.compute(f"merge.{name}.b{b.index}", merge, it, after=[x])
        return sim.compute(f"dec.b{b.index}", sim.scatter(k) + sim.elementwise(b.numel), it,
                           after=[last])


# -- engines with reduce-scatter / all-gather ----------------------------------------------
def forward_groups(sim: Sim, threshold_bytes: float) -> list[list[int]]:
    """Consecutive layers in forward order, a group closed once it reaches the threshold."""
    groups: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, layer in enumerate(sim.profile.layers):
        if layer.numel == 0:
            continue
        cur.append(i)
        size += sim.layer_bytes(i)
        if size >= threshold_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


class _ShardedSchedule(Schedule):
    """Reduce-scatter during backward; all-gathers that the next forward waits for."""

    @abstractmethod
    def group_plan(self, sim: Sim) -> list[list[int]]:
        """Implemented by each schedule."""

    def setup(self, sim: Sim) -> None:
        self.groups = self.group_plan(sim)
        self.group_of = {i: g for g, layers in enumerate(self.groups) for i in layers}
        self.first_of = {layers[0]: g for g, layers in enumerate(self.groups)}
        self.pending_ag: dict[int, Task] = {}

    def group_bytes(self, sim: Sim, g: int) -> int:
        return sum(sim.layer_bytes(i) for i in self.groups[g])

    def before_group(self, sim: Sim, it: int, g: int) -> Task | None:
        """Forward pre-hook of group g: wait for its all-gather (if pending); return last task."""
        return self.pending_ag.get(g)

    @abstractmethod
    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        """Implemented by each schedule."""

    def iteration(self, sim: Sim, it: int) -> None:
        for i in range(len(sim.profile.layers)):
            after: list[Task | None] = []
            if i in self.first_of:
                after.append(self.before_group(sim, it, self.first_of[i]))
            sim.forward_layer(i, it, after=after)
        self.pending_ag = {}
        rs: list[Task] = []
        for i in reversed(range(len(sim.profile.layers))):
            done = sim.backward_layer(i, it)
            g = self.group_of.get(i)
            if g is not None and self.groups[g][0] == i:
                rs.append(sim.collective(f"rs.g{g}", "reduce_scatter", self.group_bytes(sim, g),
                                         it, after=[done]))
        sync = sim.tl.add("sync", "compute", 0.0, kind="sync", iteration=it, after=rs)
        self.after_reduce_scatter(sim, it, sync)


@_register
class DeAR(_ShardedSchedule):
    name = "dear"
    summary = "reduce-scatter in backward, all-gather overlapped with the next forward"
    #: thresholds (fractions of the model's gradient bytes) an ideal tuner chooses from
    TUNE_GRID = 24

    def group_plan(self, sim: Sim) -> list[list[int]]:
        return forward_groups(sim, self.threshold_mb * MIB)

    def setup(self, sim: Sim) -> None:
        self.threshold_mb = float(self.opt("threshold_mb", 25.0))
        if self.opt("tune", False):
            self.threshold_mb = self.tuned_threshold(sim)
        super().setup(sim)

    def tuned_threshold(self, sim: Sim) -> float:
        """What Bayesian optimization converges to at best: the fastest threshold on a log grid
        over the engine's search range, [min(tune_min_mb, hi/64), hi], hi = min(tune_max_mb,
        model MB)."""
        total = sim.profile.numel * sim.bpe / MIB
        hi = min(float(self.opt("tune_max_mb", 256.0)), max(total, 1e-6))
        lo = min(float(self.opt("tune_min_mb", 1.0)), hi / 64)
        best = (math.inf, hi)
        for j in range(self.TUNE_GRID + 1):
            mb = lo * (hi / lo) ** (j / self.TUNE_GRID)
            trial = Sim(sim.profile, sim.p, sim.net)
            probe = DeAR(_Fixed(mb))
            probe.setup(trial)
            for it in range(1, 5):
                probe.iteration(trial, it)
            t = (trial.tl.end_of(4) - trial.tl.end_of(2)) / 2
            best = min(best, (t, mb))
        return best[1]

    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        # step(): launch the all-gather of group 0; the rest are issued one group ahead.
        self.ag_issue = sync
        self.next_it = it + 1
        if self.groups:
            self.pending_ag[0] = self._all_gather(sim, it + 1, 0, sync)

    def _all_gather(self, sim: Sim, it: int, g: int, after: Task) -> Task:
        return sim.collective(f"ag.g{g}", "all_gather", math.ceil(self.group_bytes(sim, g) / sim.p),
                              it, after=[after])

    def before_group(self, sim: Sim, it: int, g: int) -> Task | None:
        ag = self.pending_ag.get(g)
        if ag is None:  # first iteration: weights are whole already
            return None
        if g + 1 < len(self.groups):
            self.pending_ag[g + 1] = self._all_gather(sim, it, g + 1, ag)
        share = sum(sim.profile.layers[i].numel for i in self.groups[g]) / max(sim.profile.numel, 1)
        return sim.compute(f"upd.g{g}", sim.profile.optimizer_s * share, it, kind="optimizer",
                           after=[ag])


@_register
class Lee18(_ShardedSchedule):
    name = "lee18"
    summary = "per-layer reduce-scatter, shard update, all-gather of parameters in next forward"

    def group_plan(self, sim: Sim) -> list[list[int]]:
        return [[i] for i, l in enumerate(sim.profile.layers) if l.numel > 0]

    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        upd = sim.compute("upd.shard", sim.profile.optimizer_s / sim.p, it + 1, kind="optimizer",
                          after=[sync])
        for g in range(len(self.groups)):
            self.pending_ag[g] = sim.collective(
                f"ag.g{g}", "all_gather", math.ceil(self.group_bytes(sim, g) / sim.p), it + 1,
                after=[upd])


@dataclass
class _Fixed:
    threshold_mb: float


def method_names() -> list[str]:
    return sorted(SCHEDULES)

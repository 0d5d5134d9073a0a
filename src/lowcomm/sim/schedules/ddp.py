"""DDP-style schedules: ``ssgd``, ``nocomm``, ``pufferfish`` and every registered codec.

Why one class for all of them: a DDP comm hook runs the same way whatever it carries (the
bucket's hook starts on the compute stream once the bucket's last gradient is ready, its
collectives overlap the rest of backward, the optimizer waits for every bucket); only the
payload differs, and a codec declares its payload (:class:`~.codec.CodecPlan`). So the
method named like a registered codec is this schedule carrying that codec, with no code of
its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lowcomm.compress.codec import CodecCost
from lowcomm.errors import UsageError
from lowcomm.sim.profile import Profile
from lowcomm.sim.schedules.base import Bucket, Schedule, Sim, ddp_buckets
from lowcomm.sim.schedules.codec import CodecPlan
from lowcomm.sim.timeline import Task


class BucketSchedule(Schedule):
    """Forward, backward with per-bucket hooks, wait for all buckets, step.

    Without a codec a bucket is one all-reduce; with one, the codec's rounds (see
    :meth:`~.codec.CodecPlan.hook`).
    """

    name = "ddp"
    #: the codec's final decode runs after backward (the engine's ``finish_sync``), not in
    #: the collective's callback (DDP's comm hook)
    decode_after_backward: ClassVar[bool] = False

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, codec)
        #: (bucket, cost, final collective) of this step, when decoding after backward
        self.arrivals: list[tuple[Bucket, CodecCost, Task]] = []

    def setup(self, sim: Sim) -> None:
        """DDP's buckets: first ``first_bucket_mb``, then ``bucket_mb``, in backward order."""
        self.buckets = ddp_buckets(sim.tensors_backward(), sim.bpe, sim.bucket_bytes,
                                   sim.first_bucket_bytes)
        self.arrivals = []

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        """Issue bucket ``b``'s communication; return the task the optimizer must wait for."""
        if self.codec is None:
            return sim.collective(f"ar.b{b.index}", "all_reduce", b.numel * sim.bpe, it,
                                  after=[ready])
        task, cost = self.codec.hook(sim, it, b, ready, defer=self.decode_after_backward,
                                     beside=sim.rounds_beside and not self.decode_after_backward)
        if self.decode_after_backward:
            self.arrivals.append((b, cost, task))
        return task

    def iteration(self, sim: Sim, it: int) -> None:
        """Forward of every layer, backward with the hooks, optimizer after every bucket."""
        for i in range(len(sim.profile.layers)):
            sim.forward_layer(i, it)
        by_ready: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            by_ready.setdefault(b.ready_layer, []).append(b)
        pending: list[Task | None] = []
        self.arrivals = []
        for i in reversed(range(len(sim.profile.layers))):
            done = sim.backward_layer(i, it)
            for b in by_ready.get(i, []):
                pending.append(self.hook(sim, it, b, done))
        if self.codec is not None:  # the engine decodes in finish_sync, in launch order
            pending += [self.codec.deferred_decode(sim, it, b, cost, task)
                        for b, cost, task in self.arrivals]
        sim.tl.add("opt", "compute", sim.optimizer_s, kind="optimizer", iteration=it,
                   after=pending)


class SSGD(BucketSchedule):
    """Synchronous SGD through DDP: the reference every speed-up is measured against."""

    name = "ssgd"
    summary = "DDP bucketed all-reduce overlapped with backward"
    caveat = "exact synchronous SGD: the accuracy reference."
    exact = True


class NoComm(BucketSchedule):
    """Compute only: the lower bound any method's iteration time approaches."""

    name = "nocomm"
    summary = "no communication (compute lower bound)"
    advised = False

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        """Nothing to send."""
        return None


class CodecSchedule(BucketSchedule):
    """The method named like a registered codec: DDP with that codec's comm hook."""

    name = "codec"

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, codec)
        if codec is None:
            raise UsageError("a compression method's schedule needs its codec")
        if type(self).name == CodecSchedule.name:  # named after its codec; a subclass keeps its own
            self.name = codec.name  # type: ignore[misc]
            self.summary = codec.cls.summary  # type: ignore[misc]


@dataclass
class PufferfishOptions:
    """Pufferfish's options as the simulator reads them when the method is not registered."""

    rank_ratio: float = 0.25


class Pufferfish(Schedule):
    """The method it runs after the switch (``then=``, default ``ssgd``) on the profile's
    factorized model: Pufferfish changes the model, not the schedule."""

    name = "pufferfish"
    summary = "the inner method (then=, default ssgd) on the low-rank factorized model"
    caveat = ("trains a smaller low-rank model: needs full-rank warm-up epochs and may lose "
              "some accuracy versus the full model.")
    Options = PufferfishOptions

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, codec)
        then = self.opt("then", None) or "ssgd"
        if not isinstance(then, str):  # an already built inner method
            then = getattr(then, "spec", None) or getattr(then, "name", "ssgd")
        from lowcomm.sim.schedules import make_schedule

        self.inner = make_schedule(str(then))

    def profile_for(self, profile: Profile) -> Profile:
        """The factorized model's profile; refused when the profile has none."""
        if profile.factorized is None:
            raise UsageError("method 'pufferfish' needs the profile of the factorized model "
                             "(key 'factorized'); re-run 'lowcomm profile' where lowcomm.lowrank "
                             "is available or add it by hand")
        return profile.factorized

    def carries_momentum(self, workers: int) -> bool:
        """Whether the inner method's codec keeps the momentum."""
        return self.inner.carries_momentum(workers)

    def setup(self, sim: Sim) -> None:
        """The inner method's plan, on the factorized model."""
        self.inner.setup(sim)

    def iteration(self, sim: Sim, it: int) -> None:
        """One iteration of the inner method."""
        self.inner.iteration(sim, it)

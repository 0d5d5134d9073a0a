"""``predict_iteration_time``: one method, one profile, P workers, one network -> a Prediction.

The schedule is simulated for :data:`ITERATIONS` back-to-back iterations and the steady-state
iteration time is the mean over all but the first (which has no all-gathers pending from a
previous step and, for ACP-SGD, averages one P step and one Q step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowcomm.errors import UsageError, check_positive
from lowcomm.methods.base import DDP_BUCKET_MB, DDP_FIRST_BUCKET_MB
from lowcomm.sim.network import NetworkModel
from lowcomm.sim.profile import Profile
from lowcomm.sim.schedules import Schedule, Sim, make_schedule
from lowcomm.sim.timeline import Timeline

ITERATIONS = 5


@dataclass
class Prediction:
    """One method's predicted steady-state iteration at one scale (what ``simulate`` prints)."""
    method: str
    workers: int
    iter_time_s: float
    samples_per_s: float
    #: Mean seconds per iteration: forward, backward, optimizer, compress (all compression
    #: work), comm (busy time of the comm stream's collectives) and comm_exposed (iteration
    #: time not covered by compute-stream work).
    breakdown_s: dict[str, float]
    wire_bytes_per_worker: float
    network: dict[str, Any] = field(default_factory=dict)
    #: of ``wire_bytes_per_worker``, what crosses inter-node links (accounting's link classes)
    inter_node_bytes_per_worker: float = 0.0
    warnings: list[str] = field(default_factory=list)
    timeline: Timeline | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON form (without the timeline)."""
        return {
            "method": self.method,
            "workers": self.workers,
            "iter_time_s": self.iter_time_s,
            "samples_per_s": self.samples_per_s,
            "breakdown_s": dict(self.breakdown_s),
            "wire_bytes_per_worker": self.wire_bytes_per_worker,
            "inter_node_bytes_per_worker": self.inter_node_bytes_per_worker,
            "network": dict(self.network),
            "warnings": list(self.warnings),
        }


def ddp_caps(bucket_mb: float | None) -> tuple[float, float]:
    """(bucket cap, first bucket's cap) in MB of DDP given ``bucket_mb`` (None: given no cap),
    as ``lowcomm train --bucket-cap-mb`` passes it on: torch 2.13's DDP closes its first bucket
    at 1 MiB under its own default only, and at the cap when one is given."""
    return (DDP_BUCKET_MB, DDP_FIRST_BUCKET_MB) if bucket_mb is None else (bucket_mb, bucket_mb)


def simulate(profile: Profile, method_spec: str, *, workers: int, network: NetworkModel,
             iterations: int = ITERATIONS, bucket_mb: float = DDP_BUCKET_MB,
             first_bucket_mb: float = DDP_FIRST_BUCKET_MB, plan: list[int] | None = None,
             rounds_beside: bool | None = None) -> tuple[Sim, Schedule]:
    """Run the schedule; return the simulation (timeline inside) and the schedule object.

    ``plan``: layers per group (forward order) that a run's planner chose, replayed instead of
    planning (``mgwfbp`` only: its plan comes from timings the engine measures online).
    ``rounds_beside``: whether the DDP hooks run a codec's rounds on their own thread, beside
    backward, as they do with real compute on CPU workers over gloo
    (:func:`lowcomm.comm.hooks.state.rounds_beside`); None: when the profile is a CPU's."""
    if int(workers) != workers or workers < 1:
        raise UsageError(f"workers must be a positive integer, got {workers}")
    schedule = make_schedule(method_spec)
    if plan is not None:
        if not hasattr(schedule, "replay"):
            raise UsageError(f"{schedule.name} has no plan to replay; only mgwfbp plans at run time")
        schedule.replay = list(plan)
    used = schedule.profile_for(profile)
    sim = Sim(used, int(workers), network, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb,
              optimizer_s=schedule.optimizer_s(used, int(workers)),
              rounds_beside=profile.device == "cpu" if rounds_beside is None else rounds_beside)
    schedule.setup(sim)
    for it in range(1, iterations + 1):
        schedule.iteration(sim, it)
    sim.tl.flush()
    return sim, schedule


def predict_iteration_time(profile: Profile, method_spec: str, *, workers: int,
                           network: NetworkModel, bucket_mb: float = DDP_BUCKET_MB,
                           first_bucket_mb: float = DDP_FIRST_BUCKET_MB, plan: list[int] | None = None,
                           rounds_beside: bool | None = None) -> Prediction:
    """Predicted steady-state iteration time of ``method_spec`` on ``workers`` workers.

    ``method_spec`` is a ``--method`` string (``"acpsgd:rank=4"``); its options are parsed by
    the method itself. ``bucket_mb``/``first_bucket_mb`` are DDP's bucket caps (the trainer's
    ``--bucket-cap-mb``); ``plan`` and ``rounds_beside`` as in :func:`simulate`.
    """
    check_positive("workers", workers)
    sim, _ = simulate(profile, method_spec, workers=workers, network=network,
                      bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, plan=plan, rounds_beside=rounds_beside)
    tl = sim.tl
    first, last = 1, ITERATIONS
    n = last - first
    iter_time = (tl.end_of(last) - tl.end_of(first)) / n
    steady = [t for t in tl.tasks if first < t.iteration <= last]

    def total(pred: Any) -> float:
        return sum(t.duration for t in steady if pred(t)) / n

    compute_busy = total(lambda t: t.stream == "compute")
    breakdown = {
        "forward": total(lambda t: t.kind == "forward"),
        "backward": total(lambda t: t.kind == "backward"),
        "optimizer": total(lambda t: t.kind == "optimizer"),
        "compress": total(lambda t: t.kind == "compress"),
        "contention": total(lambda t: t.kind == "contention"),
        "comm": total(lambda t: t.kind == "comm"),
        "comm_exposed": max(0.0, iter_time - compute_busy),
    }
    warnings = []
    used = sim.profile
    if used.costs.is_zero and any(t.kind == "compress" for t in steady):
        warnings.append("profile has no compute-cost constants: compression work counted as free")
    return Prediction(
        method=method_spec,
        workers=sim.p,
        iter_time_s=iter_time,
        samples_per_s=sim.p * used.batch_size / iter_time if iter_time > 0 else float("inf"),
        breakdown_s=breakdown,
        wire_bytes_per_worker=sum(t.wire_bytes for t in steady) / n,
        inter_node_bytes_per_worker=sum(t.inter_bytes for t in steady) / n,
        network=network.describe(),
        warnings=warnings,
        timeline=tl,
    )

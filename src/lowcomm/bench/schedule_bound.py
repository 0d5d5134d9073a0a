"""Each method's own limit: its schedule on an ideal link (``schedule_bound_s`` of a bench row).

Why a second bound. The bench's ``lower_bound_s`` (:mod:`lowcomm.bench.bounds`) is
``max(compute, wire) + compression``: no method can beat it, but a method whose schedule
does not overlap some of its compute with communication cannot reach it either. DDP starts
its all-reduces in the backward pass, so its forward is never overlapped; with compute
comparable to the wire time it is 1.2-1.4x that bound however well it is built. Worse, the
two targets "DeAR ≥ 1.15x DDP" and "DDP ≤ 1.15x its bound" then exclude each other: with
one bound L for both, DeAR ≥ L gives DDP ≥ 1.15 L, so both hold only if DeAR reaches L
exactly. What tells whether a method is *implemented* near its limit is the limit of its
own schedule.

The schedule bound is that limit: the simulator runs the method's schedule
(:mod:`lowcomm.sim.schedules`) with

* the compute of the model as trained, as the universal bound takes it: the profile scaled so
  that ``nocomm`` takes the faster of the bench's ``nocomm`` runs, each phase to its measured
  share (:func:`lowcomm.sim.calibrate.calibrate_phases`), or, for a model-axis method,
  so that its own compute reference (Pufferfish's factorized model without communication)
  takes that row's time;
* an ideal link: the measured bandwidth, zero latency per message, every collective at the
  link's rate (no per-collective calibration, no queueing cost, no CPU contention);
* free compression in the schedule, with the kernels' bound
  (:func:`lowcomm.bench.kernel_bound.compression_bound_s`) added on top, as the universal
  bound adds it.

It is never below ``lower_bound_s`` (taken as the larger of the two). The gap between a row
and its schedule bound is what the implementation and the collective library cost: latency
per collective, a collective's efficiency below the link rate, and waits the schedule did
not need. Both bounds stay in the row; ``bound_ratio`` is against the universal one and
``schedule_bound_ratio`` against this one.
"""

from __future__ import annotations

from typing import Any

from lowcomm.bench.prediction import ddp_caps_of, rounds_beside_of, spec_as_run
from lowcomm.errors import UsageError


def ideal_network(info: dict[str, Any], nproc_per_node: int = 1, workers: int = 1) -> Any:
    """The zero-latency :class:`~lowcomm.sim.NetworkModel` of one bench network at its
    measured rate (inside emulated nodes: the measured loopback rate, also zero latency)."""
    from lowcomm.sim import Link, NetworkModel

    bits = info.get("measured_bits_per_s") or info.get("requested_bits_per_s")
    if not bits:
        raise ValueError("the network has no measured bandwidth")
    inter = Link(alpha_s=0.0, beta_s_per_byte=8.0 / float(bits))
    intra_bits = info.get("intra_node_bits_per_s")
    if nproc_per_node > 1 and intra_bits and workers > nproc_per_node:
        intra = Link(alpha_s=0.0, beta_s_per_byte=8.0 / float(intra_bits))
        return NetworkModel.two_level(inter, intra, nproc_per_node, name="ideal")
    return NetworkModel(inter=inter, name="ideal")


def add_schedule_bounds(rows: list[dict[str, Any]], profile: Any, info: dict[str, Any], *,
                        workers: int, nproc_per_node: int = 1) -> dict[str, Any]:
    """Fill ``schedule_bound_s`` and ``schedule_bound_ratio`` of every ok row in place (rows
    whose bounds :func:`lowcomm.bench.bounds.derive` filled); return what was used.

    A row gets None and ``schedule_bound_note`` when the simulator has no schedule for its
    method (one registered at run time without a schedule) or the run had no ``nocomm`` reference.
    """
    from lowcomm.sim import predict_iteration_time
    from lowcomm.sim.calibrate import calibrate_phases, scale_compression, scale_profile

    net = ideal_network(info, nproc_per_node, workers)
    nocomm = next((r for r in rows if r["method"] == "nocomm" and r.get("status") == "ok"), None)
    used: dict[str, Any] = {"network_model": net.describe()}
    if nocomm is None:
        for r in rows:
            r["schedule_bound_s"] = r["schedule_bound_ratio"] = None
            r["schedule_bound_note"] = "no nocomm run to take the compute from"
        return used
    reference = float(nocomm["iter_time_s_median"])  # a reference row keeps its fastest run
    prof, factor = calibrate_phases(profile, reference, nocomm.get("breakdown_s") or {},
                                     workers=workers, network=net)
    used.update(compute_scale=factor, nocomm_reference_s=reference)
    measured = {r["method"]: r["iter_time_s_median"] for r in rows if r.get("status") == "ok"}
    profiles: dict[str, Any] = {"nocomm": scale_compression(prof, 0.0)}
    for r in rows:
        if r.get("status") != "ok" or not r.get("iter_time_s_median"):
            continue
        r["schedule_bound_s"] = r["schedule_bound_ratio"] = None
        ref = r.get("compute_reference") or "nocomm"
        try:
            if ref not in profiles:  # a model-axis method: its own model's compute
                if ref not in measured:
                    raise UsageError(f"its compute reference {ref!r} did not run")
                own = predict_iteration_time(profile, ref, workers=workers, network=net).iter_time_s
                profiles[ref] = scale_compression(scale_profile(profile, measured[ref] / own), 0.0)
            cap, first = ddp_caps_of(r)
            sim = predict_iteration_time(profiles[ref], spec_as_run(r), workers=workers, network=net,
                                         bucket_mb=cap, first_bucket_mb=first, rounds_beside=rounds_beside_of(r))
        except UsageError as e:
            r["schedule_bound_note"] = str(e)
            continue
        compress = r.get("compress_bound_s")
        if compress is None:
            compress = r.get("compress_s") or 0.0
        bound = sim.iter_time_s + compress
        if r.get("lower_bound_s"):
            bound = max(bound, r["lower_bound_s"])
        r["schedule_bound_s"] = bound
        r["schedule_bound_ratio"] = r["iter_time_s_median"] / bound if bound > 0 else None
    return used

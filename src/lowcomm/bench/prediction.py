"""The simulator's prediction beside every measured bench row (issue 7, validation).

Per bench invocation the model is profiled once, in this process, with the workers' torch
thread count, batch size and input shape (:func:`measure`). Per network:

* the **network model** is the TCP probe's bandwidth as β, and per-collective α and β scale
  fitted from the collective probe (:mod:`lowcomm.bench.collprobe`) when it ran, else
  α = RTT/2 (:func:`lowcomm.sim.calibrate.network_from_probe`);
* the **compute** of the profile is scaled so that the predicted ``nocomm`` iteration equals
  the measured ``nocomm`` time on that network, each phase to its own measured share
  (:func:`lowcomm.sim.calibrate.calibrate_phases`; one factor for all when the row has no
  breakdown, :func:`lowcomm.sim.calibrate.calibrate_compute`):
  N workers sharing the machine's cores compute slower than one quiet profiling process,
  and the ``nocomm`` run measures exactly that slow-down. The bench runs ``nocomm`` before and
  after the other methods; the calibration uses the mean of the two (the load the methods
  ran under). With a single ``nocomm`` run its row has zero error by construction; every
  other row is a real prediction.

An ``mgwfbp`` row is predicted with the fusion plan its engine made at run time
(:func:`plan_of`), not one the simulator makes from the profile: the engine plans from
timings it measures online, and on 4 emulated workers at 1 Gbit/s the two plans differed
(3 groups of 22/70/2 MB against 45/45/4 MB), which put the prediction 2-3 points further off.

Each successful row gets ``predicted_iter_time_s`` (DESIGN.md's key), ``prediction_error``
((predicted − measured) / measured), ``predicted_bytes_per_worker_per_iter`` and
``predicted_breakdown_s``; a method the simulator has no schedule for (one registered at run
time without a schedule) gets ``prediction_note`` instead. A row is simulated with the DDP bucket caps its run reports
(:func:`ddp_caps_of`).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from lowcomm.errors import UsageError
from lowcomm.methods import split_spec
from lowcomm.methods.base import DDP_BUCKET_MB, split_top_level


def measure(*, model: str, batch_size: int, input_shape: str | None, threads: int | None,
            iters: int = 5, warmup: int = 2) -> Any:
    """Profile ``model`` here with the workers' settings; returns a :class:`~lowcomm.sim.Profile`."""
    import torch

    from lowcomm.sim.cli import measure_profile

    shape = tuple(int(x) for x in input_shape.split(",")) if input_shape else None
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return measure_profile(model, batch_size, "cpu", iters=iters, warmup=warmup, input_shape=shape)
    finally:
        torch.set_num_threads(before)


def network_model(info: dict[str, Any], workers: int, nproc_per_node: int = 1) -> Any:
    """The :class:`~lowcomm.sim.NetworkModel` of one bench network dict (probe results).

    Emulated nodes of ``nproc_per_node`` > 1 workers give a two-level model: the probed node
    link (with the collective calibration) between nodes, one NIC per node, and inside a node
    the probed loopback (β from its bandwidth, α the calibrated all-reduce step: on gloo the
    per-step cost is the library's, not the wire's)."""
    from lowcomm.sim import Link, NetworkModel
    from lowcomm.sim.calibrate import network_from_probe

    bits = info.get("measured_bits_per_s") or info.get("requested_bits_per_s")
    if not bits:
        raise ValueError("the network has no measured bandwidth")
    coll = info.get("collectives")
    if coll and coll.get("error"):
        coll = None
    # one shaped link per worker: no collective moves its wire bytes faster than the TCP probe
    # measured the link (a scale below 1 came from subtracting the small collective's latency,
    # 14 steps of it at 8 workers, from a 0.3 s probe: 0.92 there, while the 8-worker rows ran
    # slower than the link; simulator.md 5.3). Emulated nodes keep 0.5: half their hops are loopback.
    net = network_from_probe(bits_per_s=float(bits), rtt_s=(info.get("rtt_ms") or 0.0) / 1e3,
                             workers=workers, collectives=coll, name=info.get("label"),
                             min_scale=1.0 if nproc_per_node <= 1 else 0.5)
    intra_bits = info.get("intra_node_bits_per_s")
    if nproc_per_node > 1 and intra_bits and workers > nproc_per_node:
        alpha = net.alpha_for("all_reduce") if coll else (info.get("intra_node_rtt_ms") or 0.0) / 2e3
        intra = Link(alpha_s=alpha, beta_s_per_byte=8.0 / float(intra_bits))
        net = NetworkModel.two_level(net.inter, intra, nproc_per_node, name=net.name,
                                     collective_alpha=net.collective_alpha,
                                     collective_beta_scale=net.collective_beta_scale)
    return net


def plan_of(row: dict[str, Any]) -> list[int] | None:
    """The fusion plan an ``mgwfbp`` row's engine made at run time (layers per group, forward
    order), for the simulator to replay: the engine plans from backward times and α, β it
    measures online, which the profile and the probe reproduce only approximately, and a
    different plan is a different schedule (None: not planned, or not mgwfbp)."""
    info = row.get("method_info") or {}
    if info.get("method") != "mgwfbp" or not info.get("planned"):
        return None
    sizes = info.get("group_sizes_units")
    return [int(n) for n in sizes] if sizes else None


#: the options that set ``dear``'s and ``lee18``'s grouping, with the value a run recorded
#: before the option existed ran with (None: always recorded); ``merge_below`` is lee18's only
GROUPING_OPTIONS = {"threshold_mb": None, "first_group_mb": 0.0, "merge_below": 0}


def spec_as_run(row: dict[str, Any]) -> str:
    """The row's method spec with the grouping options its run recorded (``method_info``) added
    where the spec does not give them. Why: a default that changes later (``lee18`` one group
    per layer until 2026-12-01, the 1 MB first group since) would otherwise re-predict an old
    row as a schedule it did not run (``benchmarks/repredict.py``)."""
    spec = row.get("spec_run") or row["method"]
    info = row.get("method_info") or {}
    method, options = info.get("method"), info.get("options")
    if method not in ("dear", "lee18") or not isinstance(options, dict) or "(" in spec:
        return spec
    given = {kv.split("=", 1)[0].strip() for kv in split_top_level(split_spec(spec)[1]) if "=" in kv}
    extra = [f"{key}={options.get(key, before)}" for key, before in GROUPING_OPTIONS.items()
             if key not in given and (key != "merge_below" or method == "lee18")
             and options.get(key, before) is not None]
    if not extra:
        return spec
    return spec + ("," if ":" in spec else ":") + ",".join(extra)


def rounds_beside_of(row: dict[str, Any]) -> bool:
    """Whether a row's DDP hook ran its codec's rounds on a thread of their own, beside backward
    (``method_info["codec_rounds"] == "thread"``: real compute on CPU workers since 2026-12-02's
    third session); a row without the key ran them in the hook, stalling backward."""
    return (row.get("method_info") or {}).get("codec_rounds") == "thread"


def ddp_caps_of(row: dict[str, Any]) -> tuple[float, float]:
    """The DDP bucket caps a row's run used (``method_info``), as the simulator's
    ``(bucket_mb, first_bucket_mb)``: ``torch_powersgd`` runs one bucket on gloo, and a
    simulator with 25 MB buckets would overlap its factors' rounds with backward where the run
    could not. A run that predates ``first_bucket_mb`` (2026-12-02) gave DDP its cap (25 MB
    when not reported), which DDP then applies to the first bucket too (:func:`ddp_caps`)."""
    from lowcomm.sim.predict import ddp_caps

    info = row.get("method_info") or {}
    cap = float(info.get("bucket_cap_mb") or DDP_BUCKET_MB)
    return cap, float(info.get("first_bucket_mb") or ddp_caps(cap)[1])


def add_predictions(rows: list[dict[str, Any]], profile: Any, info: dict[str, Any], *,
                    workers: int, nproc_per_node: int = 1, contention_s_per_byte: float = 0.0,
                    contention_s_per_collective: float = 0.0, cpu_share: float = 1.0,
                    shared_compressors: Mapping[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Fill the prediction keys of every ok row in place; return what was used (for the JSON).

    ``contention_s_per_byte`` (:func:`lowcomm.bench.contention.measure_contention`): the compute
    seconds gloo's threads take per wire byte when workers share this machine's cores, and
    ``contention_s_per_collective`` the least a collective takes; charged to the compute of rows
    with real compute, and to the host work beside each transfer (the codecs, the optimizer) of
    rows with emulated compute, whose layers wait and leave the cores to gloo
    (:meth:`lowcomm.sim.timeline.Timeline.host_seconds`).
    ``cpu_share`` (:func:`lowcomm.sim.calibrate.core_share`): how much slower the workers' real
    CPU work runs when they run it at once; applied to the compression costs of rows with
    emulated compute (with real compute the ``nocomm`` calibration already carries it).
    ``shared_compressors`` (:func:`lowcomm.bench.compress_probe.measure_shared`): the codecs'
    times measured with every worker's process running them at once; where given, they price
    the emulated rows' codecs as measured, in place of the one-process times scaled by
    ``cpu_share`` and the compute calibration (the kernel constants keep that scaling).
    """
    from lowcomm.sim import predict_iteration_time
    from lowcomm.sim.calibrate import calibrate_phases, scale_compression

    net = network_model(info, workers, nproc_per_node)
    used: dict[str, Any] = {"network_model": net.describe(), "compute_scale": None,
                            "contention_s_per_wire_byte": contention_s_per_byte,
                            "contention_s_per_collective": contention_s_per_collective}
    nocomm = next((r for r in rows if r["method"] == "nocomm" and r.get("status") == "ok"), None)
    prof = profile
    if nocomm:
        reference = typical_compute_s(nocomm)
        prof, factor = calibrate_phases(profile, reference, nocomm.get("breakdown_s") or {},
                                         workers=workers, network=net)
        used["compute_scale"] = factor
        used["nocomm_reference_s"] = reference
    else:
        used["note"] = "no nocomm run: compute times are the profile's, not calibrated"
    prof = _calibrate_factorized(prof, rows, workers=workers, net=net, used=used)
    used["profile_compute_s"] = prof.compute_s
    used["emulated_compression_share"] = cpu_share
    prof_emulated = scale_compression(prof, cpu_share) if cpu_share != 1.0 else prof
    if shared_compressors:
        prof_emulated = copy.copy(prof_emulated)
        prof_emulated.compressors = {**prof_emulated.compressors, **shared_compressors}
        used["emulated_compressors"] = "measured with every worker's process at once"
    for r in rows:
        if r.get("status") != "ok":
            continue
        spec = spec_as_run(r)
        try:
            emulated = str(r.get("compute", "real")).startswith("emulated")
            shared = net.with_contention(contention_s_per_byte, contention_s_per_collective,
                                         on="host" if emulated else "compute")
            use = prof_emulated if emulated else prof
            plan = plan_of(r)
            cap, first = ddp_caps_of(r)
            as_run: dict[str, Any] = {"workers": workers, "network": shared, "bucket_mb": cap,
                                      "first_bucket_mb": first, "rounds_beside": rounds_beside_of(r)}
            try:
                pred = predict_iteration_time(use, spec, plan=plan, **as_run)
            except UsageError as e:  # a plan that does not fit the profile: the simulator plans
                if plan is None:
                    raise
                r["prediction_note"] = f"the run's plan was not replayed: {e}"
                pred = predict_iteration_time(use, spec, **as_run)
        except UsageError as e:
            r["predicted_iter_time_s"] = None
            r["prediction_note"] = str(e)
            continue
        r["predicted_iter_time_s"] = pred.iter_time_s
        r["predicted_bytes_per_worker_per_iter"] = pred.wire_bytes_per_worker
        r["predicted_inter_node_bytes_per_worker_per_iter"] = pred.inter_node_bytes_per_worker
        r["predicted_breakdown_s"] = pred.breakdown_s
        meas = r.get("iter_time_s_median")
        r["prediction_error"] = (pred.iter_time_s - meas) / meas if meas else None
    return used


def typical_compute_s(row: Mapping[str, Any]) -> float:
    """The typical time of a compute reference (``nocomm``, a model-axis method's own model),
    which predictions are calibrated to: the median of every run of it, that is the two runs
    bracketing the methods in one round (their mean), or one run per round with ``--repeat``.

    Why not the row's own time: a reference row keeps its *fastest* run, which is what a lower
    bound must take (it must not absorb a load spike), while a method's row is one typical run
    (one round's, or the median of the rounds). Calibrated to the fastest of three ``nocomm``
    rounds, every prediction of a ``--repeat 3`` run came out low by the spread of those rounds
    (853 ms against a median of 944 at 100 Mbit/s on 2026-12-02; benchmarks.md, "Real compute,
    sixteenth run")."""
    runs = row.get("nocomm_runs_s") or row.get("compute_runs_s") or row.get("repeat_iter_times_s")
    return float(statistics.median(runs)) if runs else float(row["iter_time_s_median"])


def _calibrate_factorized(prof: Any, rows: list[dict[str, Any]], *, workers: int, net: Any,
                          used: dict[str, Any]) -> Any:
    """``prof`` with its factorized section (Pufferfish's model) calibrated to that model's own
    compute-only run (its ``compute_reference`` row, e.g. ``pufferfish:then=nocomm``), as the
    full model is to ``nocomm``; unchanged without both.

    Why its own run: the per-phase factors of the full model carry that model's host-side rest
    (the optimizer over its parameters, the per-layer overheads), which the factorized model,
    with more and smaller layers, does not share: with the full model's factors its
    compute-only row was predicted 14 % fast (emulated ResNet-50, 4 workers; benchmarks.md,
    "The rest of the methods table under emulated compute")."""
    from lowcomm.sim.calibrate import calibrate_phases

    ref = next((r for r in rows if r.get("status") == "ok" and r.get("compute_reference") not in (None, "nocomm")
                and r.get("compute_reference") == (r.get("spec_run") or r["method"])), None)
    if prof.factorized is None or ref is None:
        return prof
    reference = typical_compute_s(ref)
    fact, factor = calibrate_phases(prof.factorized, reference, ref.get("breakdown_s") or {},
                                    workers=workers, network=net)
    used["factorized_compute_scale"] = factor
    used["factorized_reference_s"] = reference
    return dataclasses.replace(prof, factorized=fact)

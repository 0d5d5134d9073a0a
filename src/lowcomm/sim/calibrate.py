"""Fit the simulator to a real machine: per-collective α/β from a probe, compute from ``nocomm``.

Why: the α-β model with α = RTT/2 and β = 1/link rate assumes the collective library costs
nothing but the wire. On gloo over TCP on a CPU box that is far from true: a 4-byte
all-reduce among 4 workers takes milliseconds (every ring step wakes a thread, copies and
syscalls; the workers share the cores with each other), and each kind moves a byte at its
own rate (before lowcomm's reduce-scatter on gloo became a point-to-point ring it was an
all-to-all, 1.7x slower per byte than the ring all-reduce on shaped links). The probe
(:mod:`lowcomm.bench.collprobe`) times each kind of collective twice, with a tiny payload
(latency) and with a large one (bandwidth); this module turns the two times into the
per-step α and the β scale of :class:`~lowcomm.sim.network.NetworkModel`:

    α_k      = t_small,k / steps_k(P)
    β_k      = (t_large,k − t_small,k) / wire_bytes_k(payload, P)
    scale_k  = β_k / β_link

with ``steps`` the latency steps of the formula the simulator uses for that kind (ring
all-reduce 2(P−1), reduce-scatter and all-gather P−1, broadcast ⌈log₂P⌉) and ``wire_bytes``
the accounting layer's count, so the fitted model reproduces both probe times exactly.

Compute: a profile measured in one process on a quiet core is faster than the same model in
N worker processes sharing the machine's cores. The bench measures ``nocomm`` (the same
workers, no communication); :func:`calibrate_compute` scales every compute time of the
profile (layers, optimizer, compression kernels) by measured / predicted ``nocomm``.

Contention: with real compute on CPU cores the collective library's threads share, every
wire byte also costs the worker some compute time (:func:`lowcomm.bench.contention.measure_contention` measures it,
:func:`fit_contention` is the arithmetic); ``NetworkModel.with_contention`` charges it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any, Mapping

from lowcomm.comm.accounting import wire_bytes
from lowcomm.sim.network import NetworkModel
from lowcomm.sim.profile import ComputeCosts, Profile

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def latency_steps(kind: str, p: int) -> int:
    """Number of α terms in the simulator's formula for ``kind`` among ``p`` workers."""
    if p <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (p - 1)
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return p - 1
    if kind == "broadcast":
        return math.ceil(math.log2(p))
    raise ValueError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


def probe_wire_bytes(kind: str, payload: int, p: int) -> int:
    """Wire bytes per worker of one probe collective (``payload`` as the wrappers count it:
    the full tensor for all-reduce/reduce-scatter/broadcast, one worker's part for all-gather).
    Broadcast counts the root's bytes times the tree depth (what the slowest path carries)."""
    if kind == "broadcast":
        return payload * latency_steps(kind, p)
    return wire_bytes(kind, payload, p)


def fit_collectives(
    *,
    bits_per_s: float,
    workers: int,
    small_s: Mapping[str, float],
    large: Mapping[str, tuple[int, float]] | None = None,
    min_scale: float = 0.5,
) -> tuple[dict[str, float], dict[str, float]]:
    """Per-kind α (s per step) and β scale from probe times (see module docstring).

    ``small_s[kind]`` is the median time of a tiny collective; ``large[kind]`` is
    ``(payload_bytes, median seconds)`` of a large one. A kind without a large run keeps
    scale 1. Scales are clamped to ``>= min_scale`` (a probe cannot make the wire faster
    than half its measured rate; a lower figure is noise).
    """
    if bits_per_s <= 0:
        raise ValueError(f"bits_per_s must be > 0, got {bits_per_s}")
    beta = 8.0 / bits_per_s
    alpha: dict[str, float] = {}
    scale: dict[str, float] = {}
    for kind, t in small_s.items():
        steps = latency_steps(kind, workers)
        if steps and t >= 0:
            alpha[kind] = t / steps
    for kind, (payload, t) in (large or {}).items():
        wb = probe_wire_bytes(kind, int(payload), workers)
        if wb <= 0:
            continue
        per_byte = (t - small_s.get(kind, 0.0)) / wb
        scale[kind] = max(min_scale, per_byte / beta)
    return alpha, scale


def network_from_probe(
    *,
    bits_per_s: float,
    rtt_s: float,
    workers: int,
    collectives: Mapping[str, Any] | None = None,
    name: str | None = None,
    min_scale: float = 0.5,
) -> NetworkModel:
    """The network model a bench prediction uses: link β from the TCP probe, and when the
    collective probe ran (``collectives`` = its JSON: ``small_s``, ``large``), per-kind α and
    β scale fitted from it (at least ``min_scale``, :func:`fit_collectives`); otherwise α =
    RTT/2 for every kind."""
    kw = {"name": name} if name else {}
    net = NetworkModel.from_probe(bits_per_s, rtt_s, **kw)
    if not collectives:
        return net
    large = {k: (int(v[0]), float(v[1])) for k, v in (collectives.get("large") or {}).items()}
    alpha, scale = fit_collectives(bits_per_s=bits_per_s, workers=workers,
                                   small_s=collectives.get("small_s") or {}, large=large, min_scale=min_scale)
    net = net.with_calibration(alpha, scale)
    queued = queued_alpha(collectives.get("stream_s") or {}, alpha, workers=workers)
    if not queued:
        return net
    beside_s = collectives.get("beside_s") or {}
    beside = queued_alpha(beside_s, queued, workers=workers)
    # the ring runs two at a time since its probe measures it beside a transfer (2026-11-29)
    overlap = GLOO_CONCURRENT + (("reduce_scatter",) if "reduce_scatter" in beside_s else ())
    return replace(net, queued_alpha=queued, queued_overlap=overlap, beside_alpha=beside)


#: Kinds a gloo process group runs two at a time: its collectives go to a pool of two worker
#: threads (torch's default), so a queued one's latency overlaps the transfer of the one
#: before. Measured: without this, the simulator put ``wfbp`` and ``lee18`` (one collective
#: per layer) 9-18 % above emulated-compute runs, with it 2-10 % (docs/benchmarks.md,
#: "Reduce-scatter on gloo, and the schedules again"). lowcomm's reduce-scatter on gloo
#: (:mod:`lowcomm.comm.ring`) joins them where the probe timed it beside a transfer: it runs
#: two rings at once since then, one before (recorded runs keep their model).
GLOO_CONCURRENT = ("all_reduce", "all_gather")


def queued_alpha(stream_s: Mapping[str, float], alpha: Mapping[str, float], *, workers: int) -> dict[str, float]:
    """Per-step α of a collective queued behind another, by kind: the probe's back-to-back time
    per collective over its latency steps, at most the isolated α (queuing cannot add latency;
    a larger figure is noise)."""
    out: dict[str, float] = {}
    for kind, t in stream_s.items():
        steps = latency_steps(kind, workers)
        if steps and t >= 0:
            out[kind] = min(t / steps, alpha.get(kind, math.inf))
    return out


# -- compute -----------------------------------------------------------------------------
def scale_profile(profile: Profile, factor: float) -> Profile:
    """A copy of ``profile`` with every compute time multiplied by ``factor`` (layers,
    optimizer, compression kernels and codecs, and the factorized model's)."""
    if factor <= 0 or not math.isfinite(factor):
        raise ValueError(f"scale factor must be a positive number, got {factor}")
    out = copy.deepcopy(profile)
    _scale_phases(out, factor, factor, factor)
    note = f"compute scaled x{factor:.3g} to match the measured nocomm run"
    for prof in (out, out.factorized):
        if prof is not None:
            _append_note(prof, note)
    return out


def _append_note(profile: Profile, note: str) -> None:
    """Add ``note`` to the profile's notes (how it was derived), after any it has."""
    profile.notes = f"{profile.notes}; {note}" if profile.notes else note


def scale_compression(profile: Profile, factor: float) -> Profile:
    """A copy of ``profile`` with only its compression costs (kernel constants and codecs)
    multiplied by ``factor``; the layers, the optimizer and the factorized model's layers stay.

    Why: in emulated compute the layers are waits, so the ``nocomm`` calibration sees no core
    sharing, but the compression stays real CPU work that the workers of one machine run at
    the same moments (they are in lock-step) on fewer cores than workers: each takes about
    ``workers x threads / cores`` times its one-process time (:func:`core_share`).

    ``factor`` 0 makes compression free: the schedule bound
    (:mod:`lowcomm.bench.schedule_bound`) adds the kernels' bound instead."""
    if factor < 0 or not math.isfinite(factor):
        raise ValueError(f"compression scale factor must be a number >= 0, got {factor}")
    out = copy.deepcopy(profile)
    for prof in (out, out.factorized):
        if prof is not None:
            _scale_costs(prof, factor)
    return out


def _scale_costs(profile: Profile, factor: float) -> None:
    """Multiply ``profile``'s compression costs (kernel constants and codecs) by ``factor`` in place."""
    profile.costs = ComputeCosts(**{k: v * factor for k, v in vars(profile.costs).items()})
    profile.compressors = {name: {k: v * factor for k, v in c.items()} for name, c in profile.compressors.items()}


def core_share(*, workers: int, threads_per_worker: int, cpus: int) -> float:
    """How many times slower a worker's CPU work runs when ``workers`` processes of
    ``threads_per_worker`` threads run it at once on ``cpus`` cores (1 when they fit)."""
    return max(1.0, workers * max(1, threads_per_worker) / max(1, cpus))


def calibrate_compute(profile: Profile, measured_nocomm_s: float, *, workers: int,
                      network: NetworkModel) -> tuple[Profile, float]:
    """Scale ``profile`` so that its predicted ``nocomm`` iteration equals the measured one.

    Returns ``(scaled profile, factor)``. ``nocomm`` sends nothing, so its prediction is the
    profile's forward + backward + optimizer and the factor is independent of the network.
    """
    from lowcomm.sim.predict import predict_iteration_time

    predicted = predict_iteration_time(profile, "nocomm", workers=workers, network=network).iter_time_s
    if predicted <= 0 or measured_nocomm_s <= 0:
        raise ValueError("cannot calibrate compute: nocomm time must be > 0 "
                         f"(measured {measured_nocomm_s}, predicted {predicted})")
    factor = measured_nocomm_s / predicted
    return scale_profile(profile, factor), factor


def calibrate_phases(profile: Profile, measured_nocomm_s: float, breakdown: Mapping[str, float], *,
                     workers: int, network: NetworkModel) -> tuple[Profile, float]:
    """Like :func:`calibrate_compute`, but each phase matched to its own share of the
    measured ``nocomm`` iteration: the layers' forward times to its ``forward``, backward to
    its ``backward``, and the optimizer to the rest (the host-side update, data loading and
    the per-iteration synchronization). Compression costs are scaled by the overall factor,
    as :func:`calibrate_compute` scales them. Falls back to that function when the breakdown
    has no forward or backward time. Returns ``(profile, overall factor)``.

    Why: a single factor spreads the host-side update (on four workers sharing two cores,
    2-3x its one-process time) over the layers, in proportion to their times. A schedule that
    overlaps communication with one phase and not another then gets the wrong overlap: DeAR's
    update runs beside the all-gathers before each forward, so a profile that moved it into
    backward predicted 0.17 s of exposed all-gathers where 0.14 s were measured, and put
    DeAR's own bound above its measured time (docs/simulator.md, section 5, step 3)."""
    fwd, bwd = float(breakdown.get("forward") or 0.0), float(breakdown.get("backward") or 0.0)
    total = sum(float(v) for v in breakdown.values() if isinstance(v, (int, float)))
    if fwd <= 0 or bwd <= 0 or total <= 0 or profile.forward_s <= 0 or profile.backward_s <= 0:
        return calibrate_compute(profile, measured_nocomm_s, workers=workers, network=network)
    share = measured_nocomm_s / total  # the breakdown of one run, the reference a mean of runs
    factor = measured_nocomm_s / profile.compute_s if profile.compute_s > 0 else 1.0
    out = copy.deepcopy(profile)
    _scale_phases(out, fwd * share / profile.forward_s, bwd * share / profile.backward_s, factor)
    from lowcomm.sim.predict import predict_iteration_time

    out.optimizer_s = 0.0  # the rest: what nocomm takes beyond the layers (and the schedule's own sync)
    predicted = predict_iteration_time(out, "nocomm", workers=workers, network=network).iter_time_s
    out.optimizer_s = max(0.0, measured_nocomm_s - predicted)
    step = float(breakdown.get("optimizer") or 0.0) * share  # the measured optimizer phase: the step itself
    out.optimizer_step_s = min(step, out.optimizer_s) if step > 0 else None
    _append_note(out, "compute calibrated per phase (forward, backward, the rest) to the measured nocomm run")
    return out, factor


def _scale_phases(profile: Profile, forward: float, backward: float, factor: float) -> None:
    """Multiply the layers' forward and backward times, and the optimizer and compression costs
    (by ``factor``), in place; the factorized model's likewise."""
    for layer in profile.layers:
        layer.forward_s *= forward
        layer.backward_s *= backward
    profile.optimizer_s *= factor
    if profile.optimizer_step_s is not None:
        profile.optimizer_step_s *= factor
    _scale_costs(profile, factor)
    if profile.factorized is not None:
        _scale_phases(profile.factorized, forward, backward, factor)


# -- contention: the collective library's threads take CPU from compute ---------------------
def fit_contention(*, alone_iters: int, alone_s: float, with_iters: int, with_s: float,
                   wire_bytes_moved: float) -> float:
    """Compute seconds lost per wire byte, from a compute loop run alone and beside collectives.

    The loop ran ``alone_iters`` iterations in ``alone_s`` alone, and ``with_iters`` in
    ``with_s`` while this worker's collectives moved ``wire_bytes_moved`` bytes. At the alone
    rate the latter iterations needed ``with_iters · alone_s / alone_iters``; the rest of
    ``with_s`` is compute time the library took. Clamped at 0 (noise can make it negative).
    """
    if alone_iters <= 0 or alone_s <= 0 or with_s <= 0 or wire_bytes_moved <= 0:
        raise ValueError("contention fit needs positive iterations, times and bytes, got "
                         f"{alone_iters}, {alone_s}, {with_s}, {wire_bytes_moved}")
    needed = with_iters * alone_s / alone_iters
    return max(0.0, with_s - needed) / wire_bytes_moved


def _contention_rank(*, seconds: float, payload_elems: int, matmul_n: int, threads: int,
                     rounds: int, small_elems: int = 0) -> dict[str, float]:
    """One rank of :func:`lowcomm.bench.contention.measure_contention` (module level: forked workers call it).

    ``rounds`` alternations of a compute-alone phase and a compute-beside-all-reduces phase
    (``payload_elems`` floats each; with ``small_elems``, a third phase beside all-reduces of
    that many, keys prefixed ``small_``), so that a drift in the machine's load (other jobs)
    hits every phase alike.
    """
    import threading
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(dist.get_rank())
    a, b = torch.randn(matmul_n, matmul_n, generator=g), torch.randn(matmul_n, matmul_n, generator=g)
    phase = seconds / rounds

    def compute_until(stop: Any) -> tuple[int, float]:
        n, t0 = 0, time.perf_counter()
        while not stop():
            torch.mm(a, b)
            n += 1
        return n, time.perf_counter() - t0

    def ops_per_phase(buf: torch.Tensor) -> int:
        """How many all-reduces fill one phase here (rank 0 decides, everyone runs the same count)."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(buf)
        count = torch.tensor([max(3, int(phase / max((time.perf_counter() - t0) / 3, 1e-6)))])
        dist.broadcast(count, 0)
        return int(count.item())

    def beside(buf: torch.Tensor, n_ops: int) -> tuple[int, float]:
        done = threading.Event()

        def comm() -> None:
            for _ in range(n_ops):
                dist.all_reduce(buf)
            done.set()

        dist.barrier()
        th = threading.Thread(target=comm)
        th.start()
        out = compute_until(done.is_set)
        th.join()
        return out

    bufs = {"": torch.ones(payload_elems)}
    if small_elems:
        bufs["small_"] = torch.ones(small_elems)
    counts = {k: ops_per_phase(buf) for k, buf in bufs.items()}
    out = {"alone_iters": 0, "alone_s": 0.0}
    for k in bufs:
        out.update({f"{k}with_iters": 0, f"{k}with_s": 0.0, f"{k}all_reduces": 0})
    for _ in range(rounds):
        dist.barrier()
        t_end = time.perf_counter() + phase
        i, t = compute_until(lambda end=t_end: time.perf_counter() >= end)
        out["alone_iters"] += i
        out["alone_s"] += t
        for k, buf in bufs.items():
            i, t = beside(buf, counts[k])
            out[f"{k}with_iters"] += i
            out[f"{k}with_s"] += t
            out[f"{k}all_reduces"] += counts[k]
    return out


__all__ = ["KINDS", "calibrate_compute", "calibrate_phases", "fit_collectives", "fit_contention", "latency_steps",
           "network_from_probe", "probe_wire_bytes", "scale_profile"]

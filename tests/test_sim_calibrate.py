"""Calibration: per-collective α/β fitted from a probe, and compute scaled to a nocomm run."""

from __future__ import annotations

import math

import pytest

from lowcomm.comm.accounting import wire_bytes
from lowcomm.sim import LayerProfile, NetworkModel, Profile, predict_iteration_time
from lowcomm.sim.calibrate import (calibrate_compute, calibrate_phases, core_share, fit_collectives, latency_steps,
                                   network_from_probe, queued_alpha, scale_compression, scale_profile)
from lowcomm.sim.profile import ComputeCosts

BITS = 100e6  # 100 Mbit/s link
BETA = 8 / BITS
P = 4
# a probe as gloo answers it on 4 CPU workers: milliseconds of latency, all-to-all slower per byte
SMALL = {"all_reduce": 6e-3, "reduce_scatter": 3e-3, "all_gather": 1.5e-3, "broadcast": 0.4e-3}
LARGE = {"all_reduce": (4_000_000, 0.55), "reduce_scatter": (4_000_000, 0.57), "all_gather": (1_000_000, 0.28)}


def fitted() -> NetworkModel:
    return network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                              collectives={"small_s": SMALL, "large": LARGE})


def test_fitted_model_reproduces_every_probe_time() -> None:
    net = fitted()
    assert net.all_reduce(0, P) == pytest.approx(SMALL["all_reduce"])
    assert net.reduce_scatter(0, P) == pytest.approx(SMALL["reduce_scatter"])
    assert net.all_gather(0, P) == pytest.approx(SMALL["all_gather"])
    assert net.broadcast(0, P) == pytest.approx(SMALL["broadcast"])
    assert net.all_reduce(4_000_000, P) == pytest.approx(0.55)
    assert net.reduce_scatter(4_000_000, P) == pytest.approx(0.57)
    assert net.all_gather(1_000_000, P) == pytest.approx(0.28)


def test_alpha_per_step_and_beta_scale_follow_the_formula() -> None:
    alpha, scale = fit_collectives(bits_per_s=BITS, workers=P, small_s=SMALL, large=LARGE)
    assert alpha["all_reduce"] == pytest.approx(6e-3 / (2 * (P - 1)))
    assert alpha["reduce_scatter"] == pytest.approx(3e-3 / (P - 1))
    assert alpha["broadcast"] == pytest.approx(0.4e-3 / math.ceil(math.log2(P)))
    wb = wire_bytes("reduce_scatter", 4_000_000, P)
    assert scale["reduce_scatter"] == pytest.approx((0.57 - 3e-3) / wb / BETA)
    # the gloo all-to-all moves a byte more slowly than the ring all-reduce
    assert scale["reduce_scatter"] > scale["all_reduce"]
    assert "broadcast" not in scale  # no large broadcast measured: the link's β


def test_uncalibrated_kinds_and_plain_probe_fall_back_to_link() -> None:
    net = fitted()
    assert net.alpha_for("p2p") == pytest.approx(1e-5) and net.beta_for("p2p") == pytest.approx(BETA)
    plain = network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P, collectives=None)
    assert plain.all_reduce(1e6, P) == pytest.approx(2 * 3 * 1e-5 + 1.5e6 * BETA)
    assert "collective_alpha_s" in net.describe() and "collective_alpha_s" not in plain.describe()


def test_latency_steps_match_simulator_formulas() -> None:
    assert [latency_steps(k, 8) for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")] == [14, 7, 7, 3]
    assert latency_steps("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        latency_steps("gossip", 4)


def test_noise_cannot_make_a_collective_faster_than_half_the_link() -> None:
    _, scale = fit_collectives(bits_per_s=BITS, workers=P, small_s={"all_reduce": 0.5},
                               large={"all_reduce": (1000, 0.4)})
    assert scale["all_reduce"] == 0.5


def profile() -> Profile:
    return Profile(model="two", batch_size=8, optimizer_s=0.01,
                   costs=ComputeCosts(elementwise_s_per_elem=1e-9, topk_s_per_elem=2e-9),
                   compressors={"signsgd": {"encode_s_per_elem": 3e-9}},
                   layers=[LayerProfile("a", 0.02, 0.04, [[256, 256]]), LayerProfile("b", 0.01, 0.03, [[10, 256]])])


def test_scale_profile_multiplies_every_compute_time() -> None:
    prof = profile()
    prof.factorized = profile()
    s = scale_profile(prof, 2.5)
    assert s.compute_s == pytest.approx(2.5 * prof.compute_s)
    assert s.costs.topk_s_per_elem == pytest.approx(5e-9)
    assert s.compressors["signsgd"]["encode_s_per_elem"] == pytest.approx(7.5e-9)
    assert s.factorized is not None and s.factorized.compute_s == pytest.approx(2.5 * prof.compute_s)
    assert prof.compute_s == pytest.approx(0.11)  # the original is untouched
    with pytest.raises(ValueError):
        scale_profile(prof, 0.0)


def test_scale_compression_scales_the_compression_costs_only() -> None:
    prof = profile()
    prof.factorized = profile()
    s = scale_compression(prof, 2.0)
    assert s.compute_s == pytest.approx(prof.compute_s)  # the layers' waits are emulated: unchanged
    assert s.costs.topk_s_per_elem == pytest.approx(2 * prof.costs.topk_s_per_elem)
    assert s.compressors["signsgd"]["encode_s_per_elem"] == pytest.approx(6e-9)
    assert s.factorized is not None and s.factorized.costs.topk_s_per_elem == pytest.approx(4e-9)
    assert prof.costs.topk_s_per_elem == pytest.approx(2e-9)
    net = fitted()
    plain = predict_iteration_time(prof, "signsgd", workers=P, network=net).breakdown_s["compress"]
    shared = predict_iteration_time(s, "signsgd", workers=P, network=net).breakdown_s["compress"]
    assert plain > 0 and shared == pytest.approx(2 * plain)


@pytest.mark.parametrize("workers, threads, cpus, share", [(4, 1, 2, 2.0), (2, 1, 2, 1.0), (1, 1, 16, 1.0),
                                                           (8, 2, 4, 4.0)])
def test_core_share_is_threads_wanted_over_cores_and_never_below_one(workers: int, threads: int, cpus: int,
                                                                     share: float) -> None:
    assert core_share(workers=workers, threads_per_worker=threads, cpus=cpus) == share


def test_calibrated_compute_predicts_the_measured_nocomm_time() -> None:
    net = fitted()
    scaled, factor = calibrate_compute(profile(), 0.33, workers=P, network=net)
    assert factor == pytest.approx(0.33 / 0.11)
    assert predict_iteration_time(scaled, "nocomm", workers=P, network=net).iter_time_s == pytest.approx(0.33)
    # communication is not scaled: ssgd's extra over nocomm is the network model's all-reduce
    ssgd = predict_iteration_time(scaled, "ssgd", workers=P, network=net).iter_time_s
    assert ssgd > 0.33


def test_phase_calibration_gives_each_phase_its_measured_share_and_the_rest_to_the_optimizer() -> None:
    net = fitted()
    # a nocomm run whose host-side update is slow (four workers on two cores): one factor would
    # spread its 0.12 s over the layers; per phase, forward and backward keep their own times
    breakdown = {"data": 0.0, "forward": 0.06, "backward": 0.14, "comm_wait": 0.02, "compress": 0.0, "optimizer": 0.12}
    measured = 0.34 * 1.5  # the reference (a mean of runs) is 1.5x the run the breakdown came from
    prof = profile()
    prof.factorized = profile()
    scaled, factor = calibrate_phases(prof, measured, breakdown, workers=P, network=net)
    assert factor == pytest.approx(measured / prof.compute_s)
    assert predict_iteration_time(scaled, "nocomm", workers=P, network=net).iter_time_s == pytest.approx(measured)
    assert scaled.forward_s == pytest.approx(0.06 * 1.5)
    assert scaled.backward_s == pytest.approx(0.14 * 1.5)
    assert scaled.optimizer_s == pytest.approx((0.02 + 0.12) * 1.5)
    assert scaled.optimizer_step_s == pytest.approx(0.12 * 1.5)  # the step itself, inside the rest
    # each layer keeps its share of its phase; compression kernels scale by the overall factor
    assert scaled.layers[0].forward_s / scaled.layers[1].forward_s == pytest.approx(2.0)
    assert scaled.costs.topk_s_per_elem == pytest.approx(2e-9 * factor)
    assert scaled.factorized is not None
    assert scaled.factorized.backward_s == pytest.approx(0.14 * 1.5)
    # the single-factor calibration matches the total but moves the update into the layers
    single, _ = calibrate_compute(prof, measured, workers=P, network=net)
    assert single.backward_s > scaled.backward_s * 1.2


@pytest.mark.parametrize("breakdown", [{}, {"forward": 0.0, "backward": 0.1}, {"optimizer": 0.3}])
def test_phase_calibration_without_forward_and_backward_times_is_the_single_factor(breakdown: dict) -> None:
    net = fitted()
    a, fa = calibrate_phases(profile(), 0.33, breakdown, workers=P, network=net)
    b, fb = calibrate_compute(profile(), 0.33, workers=P, network=net)
    assert fa == pytest.approx(fb)
    assert [lay.backward_s for lay in a.layers] == pytest.approx([lay.backward_s for lay in b.layers])
    assert a.optimizer_s == pytest.approx(b.optimizer_s)


# -- collectives queued behind another -----------------------------------------------------
def test_queued_alpha_is_the_back_to_back_time_per_step_and_never_above_the_isolated_one() -> None:
    alpha = {"all_reduce": 1e-3, "all_gather": 1e-4}
    stream = {"all_reduce": 3e-3, "all_gather": 1.0}  # all_gather: noise above the isolated latency
    q = queued_alpha(stream, alpha, workers=P)
    assert q["all_reduce"] == pytest.approx(3e-3 / latency_steps("all_reduce", P))
    assert q["all_gather"] == pytest.approx(1e-4)


def test_the_probe_without_stream_times_leaves_no_queued_model() -> None:
    assert fitted().queued() is None
    net = network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                             collectives={"small_s": SMALL, "stream_s": {"all_reduce": 1.2e-3}, "large": LARGE})
    queued = net.queued()
    assert queued is not None
    assert queued.alpha_for("all_reduce") == pytest.approx(1.2e-3 / latency_steps("all_reduce", P))
    assert queued.alpha_for("all_gather") == net.alpha_for("all_gather")  # not measured: isolated
    assert queued.beta_for("all_reduce") == net.beta_for("all_reduce")


def test_only_collectives_that_wait_for_the_link_pay_the_queued_latency() -> None:
    net = network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                             collectives={"small_s": SMALL, "stream_s": {"all_reduce": 1e-4}, "large": LARGE})
    many = Profile(model="m", batch_size=8,
                   layers=[LayerProfile(f"l{i}", 1e-4, 1e-4, [[1000]]) for i in range(40)])
    slow_layers = Profile(model="m", batch_size=8,
                          layers=[LayerProfile(f"l{i}", 1.0, 1.0, [[1000]]) for i in range(40)])
    for prof, queues in ((many, True), (slow_layers, False)):
        with_q = predict_iteration_time(prof, "wfbp", workers=P, network=net).iter_time_s
        without = predict_iteration_time(prof, "wfbp", workers=P, network=fitted()).iter_time_s
        # layer-wise all-reduces pile up behind each other when backward is fast, not when slow
        assert (with_q < without) if queues else with_q == pytest.approx(without)


def test_the_timeline_uses_the_queued_duration_only_for_a_task_that_waited_for_its_stream() -> None:
    from lowcomm.sim.timeline import Timeline

    tl = Timeline()
    first = tl.add("a", "comm", 1.0, kind="comm", iteration=0, queued_duration=0.1)  # stream idle
    second = tl.add("b", "comm", 1.0, kind="comm", iteration=0, queued_duration=0.5)  # waits for "a"
    late = tl.add("c", "compute", 5.0, kind="backward", iteration=0)
    third = tl.add("d", "comm", 1.0, kind="comm", iteration=0, after=[late], queued_duration=0.5)
    assert first.duration == 1.0 and second.duration == 0.5 and second.start == first.end
    assert third.start == late.end and third.duration == 1.0  # the link was free when it was issued


def test_a_queued_gloo_collective_costs_the_larger_of_its_wire_time_and_its_queued_latency() -> None:
    from lowcomm.sim.calibrate import GLOO_CONCURRENT
    from lowcomm.sim.schedules.base import Sim

    stream = {"all_reduce": 4e-3, "reduce_scatter": 2e-3, "broadcast": 0.3e-3}
    older = network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                               collectives={"small_s": SMALL, "stream_s": stream, "large": LARGE})
    assert set(older.queued_overlap) == set(GLOO_CONCURRENT) == {"all_reduce", "all_gather"}  # one ring at a time
    beside_s = {"all_reduce": 9.0, "reduce_scatter": 9.0, "all_gather": 9.0}  # clamped: the older rule's values
    net = network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                             collectives={"small_s": SMALL, "stream_s": stream, "beside_s": beside_s, "large": LARGE})
    assert set(net.queued_overlap) == {"all_reduce", "all_gather", "reduce_scatter"}  # the ring: two at once
    prof = Profile(model="m", batch_size=8, layers=[LayerProfile("l", 1e-3, 1e-3, [[10]])])
    sim = Sim(prof, P, net)
    queued = net.queued()
    assert queued is not None
    for size in (16, 4_000_000):  # latency-bound, then wire-bound
        first = sim.collective("a", "all_reduce", size, 0)
        second = sim.collective("b", "all_reduce", size, 0)  # waits for the link behind "a"
        wire = net.all_reduce(size, P) - net.all_reduce(0, P)
        assert second.start == pytest.approx(first.end)
        assert second.duration == pytest.approx(max(wire, queued.all_reduce(0, P)))
        # the ring reduce-scatter runs two rings at once too
        sim.collective("c", "reduce_scatter", size, 0)
        rs = sim.collective("d", "reduce_scatter", size, 0)
        rs_wire = net.reduce_scatter(size, P) - net.reduce_scatter(0, P)
        assert rs.duration == pytest.approx(max(rs_wire, queued.reduce_scatter(0, P)))
        # a kind run one at a time (broadcast): queued latency and wire time add up
        b1 = sim.collective("e", "broadcast", size, 0)
        b2 = sim.collective("f", "broadcast", size, 0)
        assert b2.start == pytest.approx(b1.end)
        assert b2.duration == pytest.approx(queued.broadcast(size, P))


def test_a_collective_beside_a_transfer_hides_its_latency_under_it_down_to_what_the_probe_measured() -> None:
    from lowcomm.sim.schedules.base import Sim

    stream = {"all_reduce": 4e-3, "all_gather": 2e-3}
    beside_s = {"all_reduce": 0.5e-3, "all_gather": 9.0}  # 9 s: above the queued α, clamped to it
    net = network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                             collectives={"small_s": SMALL, "stream_s": stream, "beside_s": beside_s, "large": LARGE})
    queued, beside = net.queued(), net.beside()
    assert queued is not None and beside is not None
    assert beside.alpha_for("all_reduce") == pytest.approx(0.5e-3 / latency_steps("all_reduce", P))
    assert beside.alpha_for("all_gather") == pytest.approx(queued.alpha_for("all_gather"))
    assert "beside_alpha_s" in net.describe()
    prof = Profile(model="m", batch_size=8, layers=[LayerProfile("l", 1e-3, 1e-3, [[10]])])
    sim = Sim(prof, P, net)
    big = sim.collective("big", "all_reduce", 4_000_000, 0)  # 0.3 s on the wire
    small = sim.collective("small", "all_reduce", 16, 0)  # issued while "big" transfers
    assert small.start == pytest.approx(big.end)
    assert small.duration == pytest.approx(beside.all_reduce(0, P))  # its latency hid under "big"
    tiny = sim.collective("tiny", "all_reduce", 16, 0)  # behind a tiny one: most of its latency shows
    assert tiny.duration == pytest.approx(max(beside.all_reduce(0, P), small.start + queued.all_reduce(0, P) - small.end))
    assert tiny.duration > small.duration
    # a probe without the measurement keeps the older rule (recorded runs re-predict as before)
    assert network_from_probe(bits_per_s=BITS, rtt_s=2e-5, workers=P,
                              collectives={"small_s": SMALL, "stream_s": stream, "large": LARGE}).beside() is None


def test_the_timeline_starts_a_beside_latency_with_the_task_before_it() -> None:
    from lowcomm.sim.timeline import Timeline

    tl = Timeline()
    first = tl.add("a", "comm", 1.0, kind="comm", iteration=0)
    hidden = tl.add("b", "comm", 1.0, kind="comm", iteration=0, beside=(0.01, 0.5, 0.02))
    assert hidden.start == first.end and hidden.duration == pytest.approx(0.02)  # 0.5 s latency ran under "a"
    shown = tl.add("c", "comm", 1.0, kind="comm", iteration=0, beside=(0.01, 0.5, 0.02))
    assert shown.duration == pytest.approx(hidden.start + 0.5 - hidden.end)  # "b" was short: most shows
    late = tl.add("w", "compute", 9.0, kind="backward", iteration=0)
    idle = tl.add("d", "comm", 1.0, kind="comm", iteration=0, after=[late], beside=(0.01, 0.5, 0.02))
    assert idle.duration == 1.0  # the link was free: its own duration


def test_held_work_runs_between_the_tasks_issued_around_its_ready_time() -> None:
    from lowcomm.sim.timeline import Timeline

    tl = Timeline()
    tl.add("bwd.2", "compute", 1.0, kind="backward", iteration=0)
    tl.add_when_ready("cb", "compute", 0.5, kind="contention", iteration=0, ready=1.5)
    early = tl.add("bwd.1", "compute", 1.0, kind="backward", iteration=0)  # starts at 1.0 < 1.5: goes first
    late = tl.add("bwd.0", "compute", 1.0, kind="backward", iteration=0)  # would start at 2.0: after it
    cb = tl.find("cb")
    assert (early.start, cb.start, cb.end, late.start) == (1.0, 2.0, 2.5, 2.5)
    tl.add_when_ready("idle", "compute", 0.5, kind="contention", iteration=0, ready=9.0)
    after_gap = tl.add("opt", "compute", 1.0, kind="optimizer", iteration=0, after=[tl.add(
        "ar", "comm", 9.5, kind="comm", iteration=0)])
    assert tl.find("idle").start == 9.0 and after_gap.start == 9.5  # ran in the idle stream's gap
    tl.add_when_ready("last", "compute", 0.5, kind="contention", iteration=0, ready=20.0)
    tl.flush()  # nothing follows it: placed at its ready time
    assert (tl.find("last").start, tl.find("last").end) == (20.0, 20.5)
    with pytest.raises(ValueError, match="stream"):
        tl.add_when_ready("x", "nope", 1.0, kind="contention", iteration=0, ready=0.0)

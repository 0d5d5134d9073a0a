"""Schedules: closed-form one-layer cases and overlap rules visible in two-layer timelines."""

from __future__ import annotations

import math

import pytest

from lowcomm.errors import UsageError
from lowcomm.sim import ComputeCosts, LayerProfile, Link, NetworkModel, Profile
from lowcomm.sim import predict_iteration_time, simulate
from lowcomm.sim.schedules import mgwfbp_groups, Sim

A, B = 1e-3, 1e-8  # 1 ms latency, 100 MB/s
NET = NetworkModel(inter=Link(A, B))
F, BW, OPT = 2e-3, 4e-3, 1e-3
COSTS = ComputeCosts(elementwise_s_per_elem=1e-9, matmul_s_per_flop=1e-11,
                     orthogonalize_s_per_elem=1e-8, topk_s_per_elem=2e-9, scatter_s_per_elem=3e-9)


def one_layer(shape: list[int] = [1024, 1024], costs: ComputeCosts = COSTS) -> Profile:
    return Profile(model="one", batch_size=16, optimizer_s=OPT, costs=costs,
                   layers=[LayerProfile("fc", F, BW, [shape])])


def two_layers() -> Profile:
    # 4 MB per layer: one DDP bucket each would need bucket_mb < 4
    return Profile(model="two", batch_size=16, optimizer_s=OPT, costs=COSTS,
                   layers=[LayerProfile("a", F, BW, [[1024, 1024]]),
                           LayerProfile("b", F, BW, [[1024, 1024]])])


# -- closed forms --------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4, 16])
def test_ssgd_one_layer_is_compute_plus_ring_all_reduce(p: int) -> None:
    prof = one_layer()
    n = 1024 * 1024 * 4
    pred = predict_iteration_time(prof, "ssgd", workers=p, network=NET)
    assert pred.iter_time_s == pytest.approx(F + BW + OPT + 2 * (p - 1) * A + 2 * (p - 1) / p * n * B,
                                             rel=1e-12)
    assert pred.wire_bytes_per_worker == 2 * (p - 1) * n // p
    assert pred.breakdown_s["comm_exposed"] == pytest.approx(pred.iter_time_s - F - BW - OPT)
    assert pred.samples_per_s == pytest.approx(p * 16 / pred.iter_time_s)


def test_nocomm_and_one_worker_are_pure_compute() -> None:
    prof = one_layer()
    assert predict_iteration_time(prof, "nocomm", workers=64, network=NET).iter_time_s == \
        pytest.approx(prof.compute_s)
    assert predict_iteration_time(prof, "ssgd", workers=1, network=NET).iter_time_s == \
        pytest.approx(prof.compute_s)


def test_powersgd_one_layer_is_two_dependent_all_reduces_plus_compression() -> None:
    p, r, m, n = 4, 4, 1024, 1024
    prof = one_layer()
    # momentum correction and local clipping off: the velocity's passes are priced separately
    # (test_momentum_correction), the clipping's by test_dgc
    pred = predict_iteration_time(prof, f"powersgd:rank={r},momentum_correction=false,clip=0", workers=p, network=NET)
    ar = lambda nbytes: 2 * (p - 1) * A + 2 * (p - 1) / p * nbytes * B  # noqa: E731
    mm = 2 * m * n * r * 1e-11
    enc = m * n * 1e-9 + mm
    mid = m * r * 1e-8 + mm
    dec = mm + m * n * 1e-9
    expect = F + BW + enc + ar(m * r * 4) + mid + ar(n * r * 4) + dec + OPT
    assert pred.iter_time_s == pytest.approx(expect, rel=1e-12)
    tl = pred.timeline
    # the P all-reduce is blocking: orthogonalization and Q = M^T P follow it in the hook
    ar1, orth, ar2 = (tl.find(x, 3) for x in ("ar1.b0", "after.ar1.b0", "ar2.b0"))
    assert orth.start == pytest.approx(ar1.end) and ar2.start == pytest.approx(orth.end)


def test_powersgd_blocking_p_all_reduce_stalls_backward_but_acpsgd_does_not() -> None:
    prof = two_layers()
    ps = simulate(prof, "powersgd", workers=4, network=NET, bucket_mb=1)[0].tl
    # bucket 0 holds layer b; layer a's backward waits for P all-reduce + orthogonalization
    assert ps.find("bwd.0", 2).start == pytest.approx(ps.find("after.ar1.b0", 2).end)
    assert ps.find("ar2.b0", 2).overlaps(ps.find("bwd.0", 2))  # the Q all-reduce is async
    acp = simulate(prof, "acpsgd", workers=4, network=NET, bucket_mb=1)[0].tl
    assert acp.find("bwd.0", 2).start == pytest.approx(acp.find("enc.b0", 2).end)
    assert acp.find("ar.b0", 2).overlaps(acp.find("bwd.0", 2))


@pytest.mark.parametrize("method, first_round, stall_ends", [("powersgd", "ar1.b0", "after.ar1.b0"),
                                                            ("gtopk", "x1.b0", "dec.b0")])
def test_rounds_beside_backward_leave_it_unstalled_and_run_in_bucket_order(method: str, first_round: str,
                                                                           stall_ends: str) -> None:
    prof = two_layers()
    kw = dict(workers=4, network=NET, bucket_mb=1)
    stalled = simulate(prof, method, rounds_beside=False, **kw)[0].tl
    beside = simulate(prof, method, rounds_beside=True, **kw)[0].tl
    assert stalled.find("bwd.0", 2).start == pytest.approx(stalled.find(stall_ends, 2).end)
    # on the rounds' own thread: layer a's backward follows bucket 0's encode at once, beside
    # the rounds; their work is on the comm chain, done before bucket 1's first collective
    assert beside.find("bwd.0", 2).start == pytest.approx(beside.find("enc.b0", 2).end)
    assert beside.find(first_round, 2).overlaps(beside.find("bwd.0", 2))
    assert beside.find(stall_ends, 2).stream == "comm"
    of_b1 = [t for t in beside.tasks if t.iteration == 2 and t.stream == "comm" and t.name.endswith(".b1")]
    assert min(t.start for t in of_b1) >= beside.find("dec.b0", 2).end - 1e-12
    assert beside.end_of(3) - beside.end_of(2) < stalled.end_of(3) - stalled.end_of(2)


def test_rounds_beside_defaults_to_a_cpu_profile_only() -> None:
    cpu, gpu = two_layers(), two_layers()
    cpu.device, gpu.device = "cpu", "cuda"
    kw = dict(workers=4, network=NET, bucket_mb=1)
    assert simulate(cpu, "gtopk", **kw)[0].rounds_beside and not simulate(gpu, "gtopk", **kw)[0].rounds_beside


def test_acpsgd_sends_one_factor_per_step_alternating_p_and_q() -> None:
    p, r = 4, 4
    prof = one_layer([2048, 512])
    pred = predict_iteration_time(prof, f"acpsgd:rank={r}", workers=p, network=NET)
    tl = pred.timeline
    for it in range(1, 6):
        comms = [t for t in tl.of_iteration(it) if t.kind == "comm"]
        assert len(comms) == 1
    # P step (odd iterations) sends m·r, Q step n·r; the mean is their average
    sizes = {it: tl.find("ar.b0", it).wire_bytes for it in (2, 3)}
    assert sorted(sizes.values()) == sorted([2 * 3 * 2048 * r * 4 // 4, 2 * 3 * 512 * r * 4 // 4])
    ps = predict_iteration_time(prof, f"powersgd:rank={r}", workers=p, network=NET)
    assert pred.iter_time_s < ps.iter_time_s


def test_uncompressible_tensors_go_uncompressed_in_first_all_reduce() -> None:
    prof = one_layer([1024])  # 1-D bias only
    pred = predict_iteration_time(prof, "powersgd", workers=2, network=NET)
    assert [t.name for t in pred.timeline.of_iteration(2) if t.kind == "comm"] == ["ar.b0"]
    assert pred.wire_bytes_per_worker == 1024 * 4  # 2(P-1)/P·n with P=2


def test_signsgd_all_gather_grows_with_workers() -> None:
    prof = one_layer()
    n = 1024 * 1024
    payload = (n + 7) // 8 + 4
    times = []
    for p in (2, 8, 32):
        pred = predict_iteration_time(prof, "signsgd", workers=p, network=NET)
        assert pred.wire_bytes_per_worker == (p - 1) * payload
        times.append(pred.iter_time_s)
    assert times[0] < times[1] < times[2]


def test_topk_sends_values_and_int32_indices() -> None:
    prof = one_layer()
    k = math.ceil(0.01 * 1024 * 1024)
    pred = predict_iteration_time(prof, "topk:density=0.01", workers=4, network=NET)
    assert pred.wire_bytes_per_worker == 3 * k * 8


@pytest.mark.parametrize("p,rounds", [(2, 1), (8, 3), (1024, 10), (6, 2 + 2)])
def test_gtopk_takes_log2_p_rounds(p: int, rounds: int) -> None:
    """Power of two: log2 P exchanges; otherwise log2 P' plus one fold-in and one fold-out."""
    prof = one_layer()
    pred = predict_iteration_time(prof, "gtopk", workers=p, network=NET)
    comms = [t for t in pred.timeline.of_iteration(2) if t.kind == "comm"]
    assert len(comms) == rounds
    k = math.ceil(0.01 * 1024 * 1024)
    assert comms[0].duration == pytest.approx(A + 8 * k * B)


def test_fp16_halves_bytes() -> None:
    prof = one_layer(costs=ComputeCosts())
    a = predict_iteration_time(prof, "ssgd", workers=4, network=NET)
    h = predict_iteration_time(prof, "fp16", workers=4, network=NET)
    assert h.wire_bytes_per_worker * 2 == a.wire_bytes_per_worker
    assert h.warnings  # no cost constants: compression counted free, and said so


def test_pufferfish_uses_factorized_profile_and_refuses_without_it() -> None:
    prof = one_layer()
    with pytest.raises(UsageError, match="factorized"):
        predict_iteration_time(prof, "pufferfish", workers=4, network=NET)
    prof.factorized = Profile(model="one:pf", batch_size=16, optimizer_s=OPT / 2,
                              layers=[LayerProfile("fc.u", F / 4, BW / 4, [[256, 1024]]),
                                      LayerProfile("fc.v", F / 4, BW / 4, [[1024, 256]])])
    pf = predict_iteration_time(prof, "pufferfish", workers=4, network=NET)
    assert pf.breakdown_s["forward"] == pytest.approx(F / 2)
    assert pf.iter_time_s < predict_iteration_time(prof, "ssgd", workers=4, network=NET).iter_time_s


def test_unknown_method_and_bad_options_are_refused() -> None:
    prof = one_layer()
    with pytest.raises(UsageError, match="valid"):
        predict_iteration_time(prof, "powrsgd", workers=4, network=NET)
    with pytest.raises(UsageError):
        predict_iteration_time(prof, "topk:density=2", workers=4, network=NET)
    with pytest.raises(UsageError):
        predict_iteration_time(prof, "powersgd:rank=0", workers=4, network=NET)
    with pytest.raises(UsageError):
        predict_iteration_time(prof, "ssgd:bogus=1", workers=4, network=NET)
    # options valid for training are valid here too
    predict_iteration_time(prof, "topk:density=0.05,fast_select=true,seed=3", workers=4, network=NET)


# -- schedule rules in a two-layer example -------------------------------------------------
def test_wfbp_overlaps_last_layers_all_reduce_with_backward() -> None:
    sim, _ = simulate(two_layers(), "wfbp", workers=4, network=NET)
    tl = sim.tl
    ar_b, bwd_a = tl.find("ar.b0", 2), tl.find("bwd.0", 2)  # bucket 0 = layer 1 ("b")
    assert ar_b.start == pytest.approx(tl.find("bwd.1", 2).end)
    assert ar_b.overlaps(bwd_a)
    # the optimizer waits for both all-reduces
    assert tl.find("opt", 2).start == pytest.approx(tl.find("ar.b1", 2).end)


def test_ddp_buckets_follow_cap_and_one_big_bucket_cannot_overlap() -> None:
    prof = two_layers()
    one = simulate(prof, "ssgd", workers=4, network=NET)[0].tl
    comms = [t for t in one.of_iteration(2) if t.kind == "comm"]
    # 1 MiB first bucket takes layer b (4 MiB), layer a fills the second
    assert len(comms) == 2 and comms[0].overlaps(one.find("bwd.0", 2))
    big = simulate(prof, "ssgd", workers=4, network=NET, bucket_mb=100, first_bucket_mb=100)[0].tl
    [ar] = [t for t in big.of_iteration(2) if t.kind == "comm"]
    assert ar.start == pytest.approx(big.find("bwd.0", 2).end)


def test_dear_overlaps_all_gather_with_next_forward() -> None:
    sim, sched = simulate(two_layers(), "dear:threshold_mb=1", workers=4, network=NET)
    assert sched.groups == [[0], [1]]
    tl = sim.tl
    it = 3
    ag0, ag1 = tl.find("ag.g0", it), tl.find("ag.g1", it)
    fwd0, fwd1 = tl.find("fwd.0", it), tl.find("fwd.1", it)
    assert ag0.start >= tl.find("sync", it - 1).end - 1e-15  # issued at step()
    assert fwd0.start >= ag0.end - 1e-15  # a group's forward waits for its all-gather
    assert ag1.overlaps(fwd0)  # the next group's all-gather hides behind this forward
    assert fwd1.start >= ag1.end - 1e-15
    # reduce-scatter of layer b runs during the backward of layer a
    assert tl.find("rs.g1", it).overlaps(tl.find("bwd.0", it))


@pytest.mark.parametrize("schedule", ["dear", "lee18"])
@pytest.mark.parametrize("alpha", [1e-4, 5e-3])
def test_tuning_finds_a_threshold_no_slower_than_fixed_ones(schedule: str, alpha: float) -> None:
    prof = Profile(model="eight", batch_size=16, optimizer_s=OPT, costs=COSTS,
                   layers=[LayerProfile(f"l{i}", F, BW, [[1024, 1024]]) for i in range(8)])
    net = NetworkModel(inter=Link(alpha, 2e-9))
    spec = f"{schedule}:fc=data_parallel," if schedule == "lee18" else f"{schedule}:"  # every layer averaged
    tuned = predict_iteration_time(prof, spec + "tune=true", workers=8, network=net).iter_time_s
    for mb in (0, 4, 25, 256):
        fixed = predict_iteration_time(prof, spec + f"threshold_mb={mb}", workers=8, network=net)
        assert tuned <= fixed.iter_time_s * (1 + 1e-9)
    sim, sched = simulate(prof, spec + "threshold_mb=0", workers=8, network=net)
    assert sched.groups == [[i] for i in range(8)]
    if alpha > 1e-3:  # every exchange's start costs more than the overlap gains: fused
        sim, sched = simulate(prof, spec + "tune=true", workers=8, network=net)
        assert len(sched.groups) < 8


def test_dear_beats_ssgd_when_communication_bound() -> None:
    prof = two_layers()
    net = NetworkModel(inter=Link(1e-4, 2e-9))
    d = predict_iteration_time(prof, "dear:threshold_mb=1", workers=8, network=net)
    s = predict_iteration_time(prof, "ssgd", workers=8, network=net)
    assert d.iter_time_s < s.iter_time_s
    assert d.wire_bytes_per_worker == s.wire_bytes_per_worker  # RS + AG = one all-reduce


def test_lee18_updates_own_shard_and_gathers_parameters_in_next_forward() -> None:
    prof = two_layers()
    # fc=data_parallel: fc=auto would run these 2-D layers model-parallel (test_lee18_fc_sim)
    # update=step: one update after backward (update=layer: tests/test_sim_lee18_update.py);
    # threshold_mb=0: one group per layer, so that the second layer's gather can follow the first
    pred = predict_iteration_time(prof, "lee18:fc=data_parallel,update=step,threshold_mb=0", workers=4, network=NET)
    tl = pred.timeline
    assert tl.find("upd.shard", 3).duration == pytest.approx(OPT / 4)
    assert tl.find("ag.g1", 3).overlaps(tl.find("fwd.0", 3))
    assert tl.find("fwd.1", 3).start >= tl.find("ag.g1", 3).end - 1e-15


def test_mgwfbp_merges_when_latency_dominates_and_splits_when_hideable() -> None:
    prof = two_layers()
    slow_start = NetworkModel(inter=Link(1.0, 1e-12))  # α far above the backward gap
    assert mgwfbp_groups(Sim(prof, 4, slow_start)) == [[1, 0]]
    fast = NetworkModel(inter=Link(1e-6, 1e-12))  # comm of b done before a's gradient
    assert mgwfbp_groups(Sim(prof, 4, fast)) == [[1], [0]]
    # never slower than plain WFBP on the latency-bound network
    assert predict_iteration_time(prof, "mgwfbp", workers=4, network=slow_start).iter_time_s <= \
        predict_iteration_time(prof, "wfbp", workers=4, network=slow_start).iter_time_s


def test_mgwfbp_replays_a_runs_plan_instead_of_planning() -> None:
    prof = two_layers()
    slow_start = NetworkModel(inter=Link(1.0, 1e-12))  # its own plan would merge both layers
    _, merged = simulate(prof, "mgwfbp", workers=4, network=slow_start)
    _, replayed = simulate(prof, "mgwfbp", workers=4, network=slow_start, plan=[1, 1])
    assert merged.groups == [[1, 0]] and replayed.groups == [[1], [0]]
    # the replayed plan is what is timed: one α per group, as wfbp's
    assert predict_iteration_time(prof, "mgwfbp", workers=4, network=slow_start, plan=[1, 1]).iter_time_s == \
        pytest.approx(predict_iteration_time(prof, "wfbp", workers=4, network=slow_start).iter_time_s)


def test_a_plan_is_refused_where_it_does_not_fit_or_nothing_plans() -> None:
    with pytest.raises(UsageError, match="3 layers in groups \\[2, 1\\] does not fit the profile's 2"):
        simulate(two_layers(), "mgwfbp", workers=2, network=NET, plan=[2, 1])
    with pytest.raises(UsageError, match="only mgwfbp plans at run time"):
        simulate(two_layers(), "dear", workers=2, network=NET, plan=[1, 1])


def test_every_method_runs_at_1024_workers() -> None:
    prof = two_layers()
    prof.factorized = one_layer([256, 1024])
    from lowcomm.sim import method_names

    for m in method_names():
        pred = predict_iteration_time(prof, m, workers=1024, network=NetworkModel.preset("10gbit"))
        assert pred.iter_time_s >= prof.forward_s * (0.5 if m == "pufferfish" else 1.0)

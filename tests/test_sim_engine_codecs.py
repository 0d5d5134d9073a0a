"""Engine schedules carrying codecs: the payload from the codec's declared cost, the pairing
refused with the engine's own reason, codec options beside the engine's."""

from __future__ import annotations

import pytest

from lowcomm.compress.codec import codec_class
from lowcomm.errors import UsageError
from lowcomm.sched.pairing import Mode, mode_refusal
from lowcomm.sim import ComputeCosts, LayerProfile, Link, NetworkModel, Profile, predict_iteration_time, simulate

NET = NetworkModel(inter=Link(1e-3, 1e-8))
COSTS = ComputeCosts(elementwise_s_per_elem=1e-9, matmul_s_per_flop=1e-11,
                     orthogonalize_s_per_elem=1e-8, topk_s_per_elem=2e-9, scatter_s_per_elem=3e-9)


def two_layers() -> Profile:
    return Profile(model="two", batch_size=16, optimizer_s=1e-3, costs=COSTS,
                   layers=[LayerProfile("a", 2e-3, 4e-3, [[1024, 1024]]),
                           LayerProfile("b", 2e-3, 4e-3, [[1024, 1024]])])


def test_dear_with_fp16_halves_both_halves_and_decodes_before_each_update() -> None:
    prof = two_layers()
    plain = predict_iteration_time(prof, "dear:threshold_mb=1", workers=4, network=NET)
    half = predict_iteration_time(prof, "dear:threshold_mb=1,compress=fp16", workers=4, network=NET)
    assert half.wire_bytes_per_worker * 2 == plain.wire_bytes_per_worker
    tl = half.timeline
    it = 3
    dec, upd = tl.find("dec.g0", it), tl.find("upd.g0", it)
    assert dec.start >= tl.find("ag.g0", it).end - 1e-15  # decode after the gathered shards
    assert upd.start >= dec.end - 1e-15 and tl.find("fwd.0", it).start >= upd.end - 1e-15
    assert tl.find("rs.b1", it).overlaps(tl.find("bwd.0", it))  # message reduce-scattered in backward


def test_lee18_with_a_cast_decodes_only_its_shard() -> None:
    prof = two_layers()
    pred = predict_iteration_time(prof, "lee18:compress=bf16,fc=data_parallel,update=step", workers=4, network=NET)
    n = prof.numel
    assert pred.timeline.find("dec.shard", 3).duration == pytest.approx(n * 1e-9 / 4)


@pytest.mark.parametrize("spec,mode", [("dear:compress=powersgd", Mode.DEAR),
                                       ("lee18:compress=powersgd", Mode.SHARD),
                                       ("lee18:compress=acpsgd", Mode.SHARD)])
def test_impossible_pairs_are_refused_with_the_engines_reason(spec: str, mode: Mode) -> None:
    name, codec = spec.split(":compress=")
    why = mode_refusal(mode, name, codec_class(codec))
    assert why
    with pytest.raises(UsageError) as e:
        predict_iteration_time(two_layers(), spec, workers=4, network=NET)
    assert str(e.value) == why


def test_gathered_codec_in_wfbp_is_all_gathered_per_layer_with_its_own_options() -> None:
    prof = two_layers()
    sim, sched = simulate(prof, "wfbp:compress=topk,density=0.05", workers=4, network=NET)
    k = int(0.05 * 1024 * 1024) + 1  # ceil
    for g in (0, 1):
        assert sim.tl.find(f"ag.b{g}", 2).wire_bytes == 3 * k * 8
    assert sched.codec is not None and sched.codec.options.density == 0.05
    with pytest.raises(UsageError):
        predict_iteration_time(prof, "wfbp:compress=topk,density=2", workers=4, network=NET)


def test_gathered_codec_in_dear_is_decoded_after_backward_and_needs_no_all_gather() -> None:
    prof = two_layers()
    spec = "dear:threshold_mb=1,compress=signsgd"
    pred = predict_iteration_time(prof, spec, workers=4, network=NET)
    tl = pred.timeline
    assert tl.find("ag.b1", 3).overlaps(tl.find("bwd.0", 3))  # payload exchanged in backward
    assert tl.find("dec.b1", 3).start >= tl.find("bwd.0", 3).end - 1e-15  # in finish_sync
    assert not [t for t in tl.of_iteration(3) if t.name.startswith("ag.g")]  # the mean is complete
    signs = predict_iteration_time(prof, "wfbp:compress=signsgd", workers=4, network=NET)
    assert pred.wire_bytes_per_worker == signs.wire_bytes_per_worker
    # each group's update still runs in its forward pre-hook
    assert tl.find("fwd.1", 3).start >= tl.find("upd.g1", 3).end - 1e-15


def test_wfbp_decodes_in_finish_sync_after_backward() -> None:
    tl = predict_iteration_time(two_layers(), "wfbp:compress=fp16", workers=4, network=NET).timeline
    dec = tl.find("dec.b0", 3)
    assert dec.stream == "compute" and dec.start >= tl.find("bwd.0", 3).end - 1e-15
    assert tl.find("opt", 3).start >= tl.find("dec.b1", 3).end - 1e-15


def test_acpsgd_in_dear_splits_engine_and_codec_options() -> None:
    sim, sched = simulate(two_layers(), "dear:compress=acpsgd,rank=2,threshold_mb=0", workers=4,
                          network=NET)
    assert sched.groups == [[0], [1]]  # type: ignore[attr-defined]
    assert sched.codec is not None and sched.codec.options.rank == 2
    rs = sim.tl.find("rs.b1", 2)
    assert rs.wire_bytes == 3 * (1024 * 2 * 4) // 4  # one factor of rank 2, reduce-scattered


def test_pufferfish_simulates_its_inner_method_on_the_factorized_model() -> None:
    prof = two_layers()
    prof.factorized = Profile(model="two:pf", batch_size=16, optimizer_s=5e-4, costs=COSTS,
                              layers=[LayerProfile("a.u", 1e-3, 2e-3, [[256, 1024]]),
                                      LayerProfile("a.v", 1e-3, 2e-3, [[1024, 256]])])
    ssgd = predict_iteration_time(prof, "pufferfish", workers=4, network=NET)
    half = predict_iteration_time(prof, "pufferfish:then=fp16", workers=4, network=NET)
    assert half.wire_bytes_per_worker * 2 == ssgd.wire_bytes_per_worker
    nested = simulate(prof, "pufferfish:then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.25",
                      workers=4, network=NET)[1]
    inner = nested.inner  # type: ignore[attr-defined]
    assert inner.codec is not None and inner.codec.name == "acpsgd" and inner.codec.options.rank == 4

"""The simulator's lee18 ``update=layer``: updates overlap the exchanges still in flight, and
the step is never slower than ``update=step``.

Why: the point of the per-layer update is to hide the shard update behind communication. On
a hand-built comm-bound profile the hidden part is known in closed form (every group's
update but the last one's, each ``optimizer_s / P`` times its share of the parameters), so
the simulated saving must equal it exactly; on other profiles (compute-bound, one long
early exchange as VGG's fully-connected weights, random ones) ``update=layer`` must never
lose. The layers are convolution-shaped so that lee18's ``fc=`` choice never applies.
"""

from __future__ import annotations

import random

import pytest

from lowcomm.sim import (
    ComputeCosts,
    LayerProfile,
    Link,
    NetworkModel,
    Profile,
    predict_iteration_time,
)
from lowcomm.sim.predict import simulate

COSTS = ComputeCosts(
    elementwise_s_per_elem=1e-9,
    matmul_s_per_flop=1e-11,
    orthogonalize_s_per_elem=1e-8,
    topk_s_per_elem=2e-9,
    scatter_s_per_elem=3e-9,
)
SLOW = NetworkModel(inter=Link(1e-3, 1e-8))  # 1 ms latency, 100 MB/s
FAST = NetworkModel(inter=Link(1e-6, 1e-11))


def conv_profile(shapes: list[list[int]], fwd: float, bwd: float, opt: float) -> Profile:
    layers = [LayerProfile(f"conv{i}", fwd, bwd, [s]) for i, s in enumerate(shapes)]
    return Profile(model="convs", batch_size=16, optimizer_s=opt, costs=COSTS, layers=layers)


def both(
    prof: Profile, workers: int, net: NetworkModel, extra: str = ""
) -> tuple[float, float, object]:
    # one group per layer (the paper's grouping): every closed form below counts per layer
    layer = predict_iteration_time(prof, f"lee18:threshold_mb=0,update=layer{extra}", workers=workers, network=net)
    step = predict_iteration_time(prof, f"lee18:threshold_mb=0,update=step{extra}", workers=workers, network=net)
    return layer.iter_time_s, step.iter_time_s, layer.timeline


def snapshots_s(prof: Profile, workers: int) -> float:
    """What update=layer adds per step: the copies of the slice kept to undo a skipped step."""
    return 2 * prof.numel / workers * COSTS.elementwise_s_per_elem


def test_comm_bound_saving_equals_the_update_time_hidden_behind_the_exchanges() -> None:
    # three 4 MiB layers: each reduce-scatter (~34 ms) is far longer than a backward (4 ms)
    opt, p = 30e-3, 4
    prof = conv_profile([[256, 256, 4, 4]] * 3, 2e-3, 4e-3, opt)
    layer, step, tl = both(prof, p, SLOW)
    it = 3
    last_exchange = tl.find("rs.g0", it)  # group 0 is launched last
    updates = [tl.find(f"upd.g{g}", it) for g in range(3)]
    hidden = sum(u.duration for u in updates if u.end <= last_exchange.end + 1e-15)
    # groups 2 and 1 are updated while later exchanges are in flight; group 0 after its own
    assert [u.end <= last_exchange.end + 1e-15 for u in updates] == [False, True, True]
    assert hidden == pytest.approx(opt / p * 2 / 3, rel=1e-12)
    # the saving: the hidden updates, less the one snapshot copy left exposed (group 0's)
    exposed_copy = tl.find("snap.g0", it).duration
    assert exposed_copy == pytest.approx(snapshots_s(prof, p) / 3, rel=1e-12)
    assert step - layer == pytest.approx(hidden - exposed_copy, rel=1e-9)
    assert tl.find("upd.g2", it).start >= tl.find("rs.g2", it).end  # only once it has arrived
    assert tl.find("upd.g2", it).overlaps(tl.find("rs.g1", it))


def test_compute_bound_the_update_moves_into_backward_at_the_cost_of_its_snapshot() -> None:
    prof = conv_profile([[64, 64, 3, 3]] * 4, 20e-3, 40e-3, 8e-3)
    layer, step, tl = both(prof, 4, FAST)
    assert tl.find("upd.g3", 3).end <= tl.find("bwd.0", 3).start  # updated during backward
    # the compute stream is the bottleneck: the same work plus the snapshot copies, less what
    # overlaps the last exchange (group 1's snapshot, issued once group 0's is launched)
    assert tl.find("snap.g1", 3).start < tl.find("rs.g0", 3).end
    extra = snapshots_s(prof, 4)
    assert (
        step + extra - tl.find("rs.g0", 3).duration * (1 + 1e-9)
        <= layer
        <= step + extra * (1 + 1e-9)
    )


def test_a_long_first_exchange_in_backward_never_makes_the_step_slower() -> None:
    # VGG-like: a huge last layer (first in backward) before many small ones; waiting for its
    # exchange inside backward would stall every layer behind it
    shapes = [[64, 64, 3, 3]] * 8 + [[4096, 4096, 1, 1]]
    prof = conv_profile(shapes, 2e-3, 6e-3, 40e-3)
    layer, step, tl = both(prof, 4, SLOW)
    assert layer <= step
    assert (
        tl.find("bwd.0", 3).start < tl.find(f"rs.g{len(shapes) - 1}", 3).end
    )  # backward not stalled


def test_update_layer_is_never_slower_than_its_snapshot_copies_on_random_profiles() -> None:
    rng = random.Random(0)
    for _ in range(25):
        n = rng.randint(1, 6)
        shapes = [[rng.choice([16, 64, 256]), rng.choice([16, 64, 256]), 3, 3] for _ in range(n)]
        prof = conv_profile(
            shapes, rng.uniform(1e-4, 5e-3), rng.uniform(1e-4, 1e-2), rng.uniform(0, 2e-2)
        )
        for net in (SLOW, FAST):
            workers = rng.choice([2, 4, 8])
            layer, step, _ = both(prof, workers, net)
            assert layer <= (step + snapshots_s(prof, workers)) * (1 + 1e-12)


def test_a_summed_codec_decodes_each_groups_slice_before_its_update() -> None:
    prof = conv_profile([[256, 256, 4, 4]] * 2, 2e-3, 4e-3, 1e-3)
    pred = predict_iteration_time(prof, "lee18:threshold_mb=0,update=layer,compress=bf16", workers=4, network=SLOW)
    tl = pred.timeline
    decodes = [tl.find(f"dec.g{g}", 3) for g in range(2)]
    assert sum(d.duration for d in decodes) == pytest.approx(
        prof.numel * 1e-9 / 4
    )  # as update=step
    for g, d in enumerate(decodes):
        assert tl.find(f"upd.g{g}", 3).start >= d.end


def test_a_fusion_threshold_fuses_layers_into_fewer_exchanges_and_saves_their_latency() -> None:
    # eight 16 KiB layers on a 1 ms-latency link: one group per layer pays eight latencies of
    # each collective, a 1 MiB threshold one
    prof = conv_profile([[64, 64]] * 8, 1e-4, 2e-4, 1e-4)
    per_layer = predict_iteration_time(prof, "lee18:threshold_mb=0,merge_below=0", workers=4, network=SLOW)
    fused = predict_iteration_time(prof, "lee18:threshold_mb=1", workers=4, network=SLOW)
    exchanges = [t for t in fused.timeline.of_iteration(2) if t.name.startswith("rs.")]
    assert len(exchanges) == 1
    assert len([t for t in per_layer.timeline.of_iteration(2) if t.name.startswith("rs.")]) == 8
    assert fused.iter_time_s < per_layer.iter_time_s - 5e-3


def test_layers_under_8192_elements_ride_with_their_neighbour_unless_merge_below_is_0() -> None:
    # 4,096-element layers: by default two of them fill a group, as the engine groups them
    prof = conv_profile([[64, 64]] * 8, 1e-4, 2e-4, 1e-4)
    counts = []
    for spec in ("lee18:threshold_mb=0", "lee18:threshold_mb=0,merge_below=0"):
        timeline = predict_iteration_time(prof, spec, workers=4, network=SLOW).timeline
        counts.append(len([t for t in timeline.of_iteration(2) if t.name.startswith("rs.")]))
    assert counts == [4, 8]


def test_by_default_layers_fuse_into_25_mb_groups_after_a_1_mb_first_group_as_dears() -> None:
    prof = conv_profile([[256, 256, 4, 4]] * 16, 1e-4, 2e-4, 1e-4)  # 4 MiB each
    default = predict_iteration_time(prof, "lee18", workers=4, network=SLOW)
    fused = predict_iteration_time(prof, "lee18:threshold_mb=25,first_group_mb=1", workers=4, network=SLOW)
    assert default.iter_time_s == fused.iter_time_s
    for spec, sizes in (("lee18", [1, 7, 7, 1]), ("lee18:first_group_mb=0", [7, 7, 2]), ("dear", [1, 7, 7, 1])):
        _, schedule = simulate(prof, spec, workers=4, network=SLOW)
        assert [len(g) for g in schedule.groups] == sizes, spec

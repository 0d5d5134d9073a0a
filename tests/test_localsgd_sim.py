"""The simulator and the advisor know ``localsgd``, ``diloco`` and ``streaming_diloco``:
bytes per step averaged over the period (equal to what the trainer counts), iteration time
from the exposed part of each sync, and the advisor's separate semi-synchronous branch."""

from __future__ import annotations

import pytest

from lowcomm.sim.advise import SEMI_SYNC, advise, candidates
from lowcomm.sim.network import Link, NetworkModel
from lowcomm.sim.predict import predict_iteration_time
from lowcomm.sim.profile import LayerProfile, Profile
from lowcomm.sim.schedules import make_schedule
from lowcomm.testing import run_distributed
from test_localsgd import WORLD, make_model, rank_run

NET = NetworkModel(inter=Link(1e-4, 1e-9))  # 100 us latency, 1 GB/s


def profile_of_test_model() -> Profile:
    """The layers of tests/test_localsgd.py's model (fc1, fc2, fc3), 10 ms of compute each."""
    model = make_model()
    layers = [
        LayerProfile(name, 0.004, 0.006, [list(p.shape) for p in mod.parameters()])
        for name, mod in model.named_children()
        if list(mod.parameters())
    ]
    return Profile(model="net", batch_size=8, optimizer_s=0.001, layers=layers)


@pytest.mark.parametrize(
    "spec, tag",
    [
        ("localsgd:sync_every=4", "localsgd"),
        ("diloco:sync_every=4", "diloco"),
        ("streaming_diloco:sync_every=4,fragments=2,delay=1", "streaming_diloco"),
        ("diloco:sync_every=4,compress=fp16", "diloco"),
        ("diloco:sync_every=4,compress=(topk:density=0.25)", "diloco"),
    ],
)
def test_predicted_bytes_per_step_equal_the_trainers_count_over_a_period(
    spec: str, tag: str
) -> None:
    steps = 8
    measured = (
        run_distributed(rank_run, WORLD, spec, steps)[1]["by_tag"][tag] / steps
    )  # rank 1: no init
    pred = predict_iteration_time(profile_of_test_model(), spec, workers=WORLD, network=NET)
    assert pred.wire_bytes_per_worker == pytest.approx(measured, rel=1e-9)


def test_iteration_time_is_compute_plus_a_period_share_of_the_blocking_sync() -> None:
    prof = profile_of_test_model()
    h = 10
    ssgd_like = predict_iteration_time(prof, "localsgd:sync_every=1", workers=4, network=NET)
    local = predict_iteration_time(prof, f"localsgd:sync_every={h}", workers=4, network=NET)
    sync = ssgd_like.iter_time_s - prof.compute_s
    assert sync > 0
    assert local.iter_time_s == pytest.approx(prof.compute_s + sync / h, rel=1e-9)


def test_streaming_hides_a_fragment_sync_shorter_than_the_delayed_steps() -> None:
    prof = profile_of_test_model()
    # ring all-reduce on 4 workers: 6 latencies = 60 ms per sync, two steps of compute (31 ms)
    slow = NetworkModel(inter=Link(0.01, 1e-9))
    diloco = predict_iteration_time(prof, "diloco:sync_every=20", workers=4, network=slow)
    hidden = predict_iteration_time(
        prof, "streaming_diloco:sync_every=20,fragments=2,delay=19", workers=4, network=slow
    )
    blocking = predict_iteration_time(
        prof, "streaming_diloco:sync_every=20,fragments=2,delay=0", workers=4, network=slow
    )
    assert hidden.iter_time_s == pytest.approx(prof.compute_s, rel=1e-9)
    assert diloco.iter_time_s < blocking.iter_time_s  # two blocking syncs pay the latency twice
    assert hidden.wire_bytes_per_worker == pytest.approx(diloco.wire_bytes_per_worker)


def test_semi_synchronous_methods_are_a_separate_branch_of_the_advice() -> None:
    prof = profile_of_test_model()
    assert not set(SEMI_SYNC) & set(candidates())
    slow = NetworkModel(inter=Link(1e-3, 1e-6))  # 1 MB/s: every synchronous method waits
    adv = advise(prof, workers=8, network=slow, methods=["ssgd", "fp16", "topk:density=0.01"])
    assert adv.semi_synchronous and adv.best.method in ("ssgd", "fp16", "topk:density=0.01")
    data = adv.as_dict()
    assert (
        data["semi_synchronous"][0]["speedup_vs_ssgd"] > 1.2
        and data["semi_synchronous"][0]["caveat"]
    )
    fast = NetworkModel(inter=Link(1e-9, 1e-15))
    assert not advise(prof, workers=8, network=fast, methods=["ssgd"]).semi_synchronous


def test_a_nested_codec_spec_builds_the_schedule_and_too_many_fragments_are_refused() -> None:
    assert make_schedule("diloco:compress=(topk:density=0.01),sync_every=50").plan is not None  # type: ignore[attr-defined]
    from lowcomm.errors import UsageError

    with pytest.raises(UsageError, match="fragments=3 is invalid"):
        predict_iteration_time(
            Profile(
                model="one",
                batch_size=1,
                layers=[LayerProfile("a", 0.1, 0.1, [[4, 4]]), LayerProfile("b", 0.1, 0.1, [[4]])],
            ),
            "streaming_diloco:sync_every=6,fragments=3",
            workers=2,
            network=NET,
        )

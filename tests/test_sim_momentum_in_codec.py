"""A codec that carries SGD's momentum leaves the optimizer a step without one (counted once)."""

from __future__ import annotations

import pytest

from lowcomm.sim import LayerProfile, Link, NetworkModel, Profile, predict_iteration_time
from lowcomm.sim.profile import ComputeCosts
from lowcomm.sim.schedules import make_schedule
from lowcomm.sim.schedules.base import STEP_WITHOUT_MOMENTUM

NET = NetworkModel(inter=Link(1e-5, 8e-9))


def _profile(step: float | None = None) -> Profile:
    layers = [LayerProfile("a", 2e-3, 4e-3, [[512, 512]]), LayerProfile("b", 2e-3, 4e-3, [[512, 512]])]
    prof = Profile(model="two", batch_size=8, optimizer_s=0.05, layers=layers,
                   costs=ComputeCosts(elementwise_s_per_elem=1e-9, topk_s_per_elem=2e-9, scatter_s_per_elem=1e-9,
                                      matmul_s_per_flop=1e-11, orthogonalize_s_per_elem=1e-9),
                   optimizer_step_s=step)
    prof.factorized = Profile(model="two-f", batch_size=8, optimizer_s=0.05, layers=layers, costs=prof.costs)
    return prof


@pytest.mark.parametrize("spec", ["topk", "powersgd", "acpsgd", "signsgd", "pufferfish:then=topk"])
def test_momentum_carrying_codecs_step_without_the_momentum_pass(spec: str) -> None:
    prof = _profile()
    schedule = make_schedule(spec)
    assert schedule.carries_momentum(4)
    assert schedule.optimizer_s(prof, 4) == pytest.approx(0.05 * STEP_WITHOUT_MOMENTUM)


@pytest.mark.parametrize("spec", ["ssgd", "fp16", "qsgd", "topk:momentum_correction=false", "dear", "pufferfish"])
def test_the_optimizer_keeps_its_momentum_otherwise(spec: str) -> None:
    assert make_schedule(spec).optimizer_s(_profile(), 4) == pytest.approx(0.05)


def test_only_the_step_inside_a_calibrated_rest_loses_the_momentum_pass() -> None:
    # a calibrated optimizer_s (0.05) holds the step (0.02) and the iteration's other host work
    assert make_schedule("topk").optimizer_s(_profile(step=0.02), 4) == pytest.approx(
        0.05 - 0.02 * (1 - STEP_WITHOUT_MOMENTUM))


def test_the_prediction_uses_it() -> None:
    prof = _profile()
    on = predict_iteration_time(prof, "topk", workers=4, network=NET).breakdown_s["optimizer"]
    off = predict_iteration_time(prof, "topk:momentum_correction=false", workers=4, network=NET).breakdown_s["optimizer"]
    assert on == pytest.approx(0.05 * STEP_WITHOUT_MOMENTUM) and off == pytest.approx(0.05)


def test_a_profile_keeps_its_step_through_json() -> None:
    prof = _profile(step=0.02)
    assert Profile.from_dict(prof.to_dict()).optimizer_step_s == 0.02
    assert "optimizer_step_s" not in _profile().to_dict()

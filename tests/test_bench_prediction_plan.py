"""The bench predicts an mgwfbp row with the fusion plan its engine made at run time, and a
dear/lee18 row with the grouping options its run recorded."""

from __future__ import annotations

from typing import Any

import pytest

from lowcomm.bench.prediction import add_predictions, plan_of, spec_as_run
from lowcomm.sim import LayerProfile, Link, NetworkModel, Profile, predict_iteration_time

PROFILE = Profile(model="two", batch_size=8, optimizer_s=0.0,
                  layers=[LayerProfile("a", 2e-3, 4e-3, [[1024, 1024]]), LayerProfile("b", 2e-3, 4e-3, [[1024, 1024]])])
#: α far above the backward gap: the simulator's own planner would merge both layers
INFO = {"measured_bits_per_s": 8e9, "rtt_ms": 2000.0}


def _row(method: str, info: dict[str, Any]) -> dict[str, Any]:
    return {"method": method, "status": "ok", "iter_time_s_median": 1.0, "compute": "real", "method_info": info}


def test_only_a_planned_mgwfbp_row_has_a_plan_to_replay() -> None:
    planned = {"method": "mgwfbp", "planned": True, "group_sizes_units": [1, 1]}
    assert plan_of(_row("mgwfbp", planned)) == [1, 1]
    assert plan_of(_row("mgwfbp", {**planned, "planned": False})) is None
    assert plan_of(_row("dear", {**planned, "method": "dear"})) is None
    assert plan_of({"method": "mgwfbp", "status": "ok"}) is None


def test_the_row_is_predicted_with_its_own_plan() -> None:
    rows = [_row("mgwfbp", {"method": "mgwfbp", "planned": True, "group_sizes_units": [1, 1]})]
    add_predictions(rows, PROFILE, INFO, workers=2)
    net = NetworkModel(inter=Link(1.0, 1e-9))
    split = predict_iteration_time(PROFILE, "mgwfbp", workers=2, network=net, plan=[1, 1]).iter_time_s
    merged = predict_iteration_time(PROFILE, "mgwfbp", workers=2, network=net).iter_time_s
    assert merged < split  # (the two plans do differ in time here)
    assert rows[0]["predicted_iter_time_s"] == pytest.approx(split)
    assert "prediction_note" not in rows[0]


def test_a_plan_that_does_not_fit_the_profile_falls_back_to_planning_and_says_so() -> None:
    rows = [_row("mgwfbp", {"method": "mgwfbp", "planned": True, "group_sizes_units": [3]})]
    add_predictions(rows, PROFILE, INFO, workers=2)
    net = NetworkModel(inter=Link(1.0, 1e-9))
    assert rows[0]["predicted_iter_time_s"] == pytest.approx(
        predict_iteration_time(PROFILE, "mgwfbp", workers=2, network=net).iter_time_s)
    assert "the run's plan was not replayed" in rows[0]["prediction_note"]


def test_a_sharded_row_is_predicted_with_the_grouping_its_run_recorded() -> None:
    # lee18 before 2026-12-01: one group per layer, no first-group rule, merge_below recorded
    old = _row("lee18", {"method": "lee18", "options": {"threshold_mb": 0.0, "merge_below": 8192, "tune": False}})
    assert spec_as_run(old) == "lee18:threshold_mb=0.0,first_group_mb=0.0,merge_below=8192"
    # before merge_below existed: strictly per layer
    assert spec_as_run(_row("lee18", {"method": "lee18", "options": {"threshold_mb": 0.0}})) == (
        "lee18:threshold_mb=0.0,first_group_mb=0.0,merge_below=0")
    # what the spec gives stays; dear has no merge_below
    dear = {**_row("dear:threshold_mb=4", {"method": "dear", "options": {"threshold_mb": 4.0, "first_group_mb": 1.0}})}
    assert spec_as_run(dear) == "dear:threshold_mb=4,first_group_mb=1.0"
    # rows without recorded options, other methods and nested specs are left as they are
    assert spec_as_run(_row("lee18", {})) == "lee18"
    assert spec_as_run(_row("ssgd", {"method": "ssgd", "options": {"threshold_mb": 1.0}})) == "ssgd"
    rows = [old, _row("lee18:threshold_mb=0,first_group_mb=0", {})]
    add_predictions(rows, PROFILE, INFO, workers=2)
    assert rows[0]["predicted_iter_time_s"] == pytest.approx(rows[1]["predicted_iter_time_s"])

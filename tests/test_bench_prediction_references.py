"""The bench calibrates its predictions to the compute references' typical runs.

A Pufferfish profile's factorized model is calibrated to that model's own compute-only run, as
the full model is to ``nocomm``. A reference row keeps its fastest run (what the lower bound
takes), while each method row is one typical run (or the median of ``--repeat`` rounds), so the
calibration takes the median of every run of a reference: calibrated to the fastest round,
every prediction of a three-round run came out low by the spread of the reference's rounds."""

from __future__ import annotations

from typing import Any

import pytest

from lowcomm.bench.prediction import add_predictions, typical_compute_s
from lowcomm.sim import LayerProfile, Profile


def _profile() -> Profile:
    full = [LayerProfile("a", 2e-3, 4e-3, [[256, 256]]), LayerProfile("b", 2e-3, 4e-3, [[256, 256]])]
    fact = [LayerProfile("a.u", 1e-3, 2e-3, [[256, 16]]), LayerProfile("a.v", 1e-3, 2e-3, [[16, 256]]),
            LayerProfile("b", 2e-3, 4e-3, [[256, 256]])]
    prof = Profile(model="two", batch_size=8, optimizer_s=1e-3, layers=full)
    prof.factorized = Profile(model="two-factorized", batch_size=8, optimizer_s=5e-4, layers=fact)
    return prof


def _row(method: str, seconds: float, reference: str, forward: float, backward: float,
         **extra: Any) -> dict[str, Any]:
    return {"method": method, "spec_run": method, "status": "ok", "iter_time_s_median": seconds,
            "compute": "emulated:scale=1", "compute_reference": reference,
            "breakdown_s": {"forward": forward, "backward": backward, "optimizer": seconds - forward - backward},
            **extra}


INFO = {"measured_bits_per_s": 1e9, "rtt_ms": 0.1}


def test_the_factorized_models_compute_only_row_is_predicted_at_its_own_measured_time() -> None:
    rows = [_row("nocomm", 0.030, "nocomm", 0.008, 0.016),
            _row("pufferfish:then=nocomm", 0.027, "pufferfish:then=nocomm", 0.009, 0.012)]
    used = add_predictions(rows, _profile(), INFO, workers=2)
    assert rows[0]["predicted_iter_time_s"] == pytest.approx(0.030, rel=1e-6)
    assert rows[1]["predicted_iter_time_s"] == pytest.approx(0.027, rel=1e-6)
    assert used["factorized_reference_s"] == 0.027 and used["factorized_compute_scale"] > 0


def test_without_its_own_run_the_factorized_model_keeps_the_full_models_factors() -> None:
    rows = [_row("nocomm", 0.030, "nocomm", 0.008, 0.016)]
    used = add_predictions(rows, _profile(), INFO, workers=2)
    assert "factorized_compute_scale" not in used
    alone = [_row("pufferfish:then=nocomm", 0.027, "nocomm", 0.009, 0.012)]  # not its own reference
    add_predictions(rows + alone, _profile(), INFO, workers=2)
    assert alone[0]["predicted_iter_time_s"] != pytest.approx(0.027, rel=1e-3)


def test_one_round_takes_the_mean_of_the_two_runs_bracketing_the_methods() -> None:
    assert typical_compute_s(_row("nocomm", 0.030, "nocomm", 0.008, 0.016,
                                  nocomm_runs_s=[0.030, 0.034])) == pytest.approx(0.032)
    own = _row("p", 0.020, "p", 0.005, 0.010, compute_runs_s=[0.024, 0.020])
    assert typical_compute_s(own) == pytest.approx(0.022)


def test_rounds_take_the_median_round_not_the_fastest_one() -> None:
    row = _row("nocomm", 0.0853, "nocomm", 0.02, 0.05, repeat_iter_times_s=[0.0853, 0.0944, 0.0995])
    assert typical_compute_s(row) == pytest.approx(0.0944)


def test_a_row_measured_once_is_its_own_typical_time() -> None:
    assert typical_compute_s(_row("nocomm", 0.030, "nocomm", 0.008, 0.016)) == 0.030


def test_a_three_round_run_is_predicted_from_the_median_references() -> None:
    nocomm = _row("nocomm", 0.030, "nocomm", 0.008, 0.016, repeat_iter_times_s=[0.036, 0.030, 0.033])
    own = _row("pufferfish:then=nocomm", 0.020, "pufferfish:then=nocomm", 0.006, 0.010,
               repeat_iter_times_s=[0.020, 0.026, 0.023])
    used = add_predictions([nocomm, own], _profile(), INFO, workers=2)
    assert used["nocomm_reference_s"] == pytest.approx(0.033)
    assert used["factorized_reference_s"] == pytest.approx(0.023)
    # the reference rows themselves are predicted at their typical time, above their fastest run
    assert nocomm["predicted_iter_time_s"] == pytest.approx(0.033, rel=1e-6)
    assert own["predicted_iter_time_s"] == pytest.approx(0.023, rel=1e-6)

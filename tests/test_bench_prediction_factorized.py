"""The bench calibrates a Pufferfish profile's factorized model to that model's own compute-only run."""

from __future__ import annotations

from typing import Any

import pytest

from lowcomm.bench.prediction import add_predictions
from lowcomm.sim import LayerProfile, Profile


def _profile() -> Profile:
    full = [LayerProfile("a", 2e-3, 4e-3, [[256, 256]]), LayerProfile("b", 2e-3, 4e-3, [[256, 256]])]
    fact = [LayerProfile("a.u", 1e-3, 2e-3, [[256, 16]]), LayerProfile("a.v", 1e-3, 2e-3, [[16, 256]]),
            LayerProfile("b", 2e-3, 4e-3, [[256, 256]])]
    prof = Profile(model="two", batch_size=8, optimizer_s=1e-3, layers=full)
    prof.factorized = Profile(model="two-factorized", batch_size=8, optimizer_s=5e-4, layers=fact)
    return prof


def _row(method: str, seconds: float, reference: str, forward: float, backward: float) -> dict[str, Any]:
    return {"method": method, "spec_run": method, "status": "ok", "iter_time_s_median": seconds,
            "compute": "emulated:scale=1", "compute_reference": reference,
            "breakdown_s": {"forward": forward, "backward": backward, "optimizer": seconds - forward - backward}}


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

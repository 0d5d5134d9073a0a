"""Each method's schedule bound: its schedule on a zero-latency link at the measured rate."""

from __future__ import annotations

from typing import Any

import pytest

from lowcomm.bench.schedule_bound import add_schedule_bounds, ideal_network
from lowcomm.sim import LayerProfile, Profile

#: one layer of 1000x1000 fp32 (4 MB of gradient), forward 10 ms, backward 20 ms
PROFILE = Profile(model="toy", batch_size=8, optimizer_s=0.0, layers=[LayerProfile("a", 0.01, 0.02, [[1000, 1000]])])
GBIT = {"measured_bits_per_s": 1e9}
GRAD_BYTES = 1000 * 1000 * 4


def _rows(**extra: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{"method": "nocomm", "status": "ok", "iter_time_s_median": 0.06, "nocomm_runs_s": [0.09, 0.06]}]
    for method, fields in extra.items():
        rows.append({"method": method, "status": "ok", "iter_time_s_median": 0.2, "lower_bound_s": 0.01, **fields})
    return rows


def test_the_ideal_network_has_no_latency_and_the_measured_rate() -> None:
    net = ideal_network({"measured_bits_per_s": 5e8})
    assert net.alpha_s == 0.0 and net.alpha_for("all_reduce") == 0.0
    assert net.beta_s_per_byte == pytest.approx(8 / 5e8)
    assert net.all_reduce(1e6, 4) == pytest.approx(2 * 3 / 4 * 1e6 * 8 / 5e8)


def test_ssgd_on_one_layer_cannot_overlap_so_its_bound_is_compute_plus_the_all_reduce() -> None:
    rows = _rows(ssgd={"compress_bound_s": 0.0})
    used = add_schedule_bounds(rows, PROFILE, GBIT, workers=2)
    # compute from the faster nocomm run (0.06 s = 2x the profile's 0.03 s)
    assert used["compute_scale"] == pytest.approx(2.0) and used["nocomm_reference_s"] == 0.06
    ssgd = rows[1]
    wire = 2 * (2 - 1) / 2 * GRAD_BYTES * 8 / 1e9  # ring all-reduce, 2 workers, no latency
    assert ssgd["schedule_bound_s"] == pytest.approx(0.06 + wire)
    assert ssgd["schedule_bound_ratio"] == pytest.approx(0.2 / (0.06 + wire))
    assert rows[0]["schedule_bound_s"] == pytest.approx(0.06)  # nocomm: its own compute


def test_the_bound_adds_the_kernel_bound_and_never_falls_below_the_universal_bound() -> None:
    rows = _rows(topk={"compress_bound_s": 0.005}, ssgd={"lower_bound_s": 0.5})
    add_schedule_bounds(rows, PROFILE, GBIT, workers=2)
    topk, ssgd = rows[1], rows[2]
    assert 0.06 + 0.005 < topk["schedule_bound_s"] < 0.06 + 0.005 + 0.002  # a 1 % payload adds little
    assert ssgd["schedule_bound_s"] == 0.5


def test_without_a_kernel_bound_the_measured_compression_time_is_added() -> None:
    with_bound = _rows(signsgd={"compress_bound_s": 0.0, "compress_s": 0.04})
    without = _rows(signsgd={"compress_bound_s": None, "compress_s": 0.04})
    add_schedule_bounds(with_bound, PROFILE, GBIT, workers=2)
    add_schedule_bounds(without, PROFILE, GBIT, workers=2)
    assert without[1]["schedule_bound_s"] == pytest.approx(with_bound[1]["schedule_bound_s"] + 0.04)


def test_a_method_the_simulator_cannot_run_gets_a_note_not_a_number() -> None:
    rows = _rows(torch_zero3={})  # no such schedule
    add_schedule_bounds(rows, PROFILE, GBIT, workers=2)
    assert rows[1]["schedule_bound_s"] is None and "no method 'torch_zero3'" in rows[1]["schedule_bound_note"]


def test_without_a_nocomm_run_no_row_gets_a_schedule_bound() -> None:
    rows = _rows(ssgd={})[1:]
    add_schedule_bounds(rows, PROFILE, GBIT, workers=2)
    assert rows[0]["schedule_bound_s"] is None and "nocomm" in rows[0]["schedule_bound_note"]


def test_failed_rows_are_left_alone() -> None:
    rows = _rows() + [{"method": "ssgd", "status": "failed", "reason": "boom"}]
    add_schedule_bounds(rows, PROFILE, GBIT, workers=2)
    assert "schedule_bound_s" not in rows[1]


def test_a_model_axis_method_takes_its_compute_from_its_own_reference_row() -> None:
    """Pufferfish trains a factorized model: like the universal bound, its schedule bound takes
    the compute of its ``then=nocomm`` row, not the full model's ``nocomm``."""
    factorized = Profile(model="toy-f", batch_size=8, optimizer_s=0.0,
                         layers=[LayerProfile("a", 0.005, 0.01, [[1000, 10], [10, 1000]])])
    prof = Profile(model="toy", batch_size=8, optimizer_s=0.0, factorized=factorized,
                   layers=[LayerProfile("a", 0.01, 0.02, [[1000, 1000]])])
    ref = "pufferfish:then=nocomm"
    rows = _rows(**{ref: {"compute_reference": ref, "iter_time_s_median": 0.045},
                    "pufferfish": {"compute_reference": ref}})
    add_schedule_bounds(rows, prof, GBIT, workers=2)
    assert rows[1]["schedule_bound_s"] == pytest.approx(0.045)  # 3x the profile's 0.015 s
    wire = 2 * (2 - 1) / 2 * (1000 * 10 * 2) * 4 * 8 / 1e9
    assert rows[2]["schedule_bound_s"] == pytest.approx(0.045 + wire)
    # without its reference row the method gets a note, not the full model's compute
    rows = _rows(pufferfish={"compute_reference": ref})
    add_schedule_bounds(rows, prof, GBIT, workers=2)
    assert rows[1]["schedule_bound_s"] is None and "did not run" in rows[1]["schedule_bound_note"]


def test_an_old_row_is_bounded_with_the_grouping_it_ran_not_todays_defaults() -> None:
    """A ``dear`` run recorded before the 1 MB first group existed ran one fused group; its
    bound replays that (``method_info``), as its prediction does, not today's first group."""
    layers = [LayerProfile(f"l{i}", 0.01, 0.02, [[1000, 1000]]) for i in range(3)]
    prof = Profile(model="toy3", batch_size=8, optimizer_s=0.0, layers=layers)
    old = {"method_info": {"method": "dear", "options": {"threshold_mb": 25.0}}, "spec_run": "dear"}
    rows = [*_rows(), {"method": "dear", "status": "ok", "iter_time_s_median": 0.3, **old},
            {"method": "dear", "status": "ok", "iter_time_s_median": 0.3, "spec_run": "dear:first_group_mb=0"},
            {"method": "dear", "status": "ok", "iter_time_s_median": 0.3, "spec_run": "dear"}]
    add_schedule_bounds(rows, prof, GBIT, workers=4)
    as_ran, explicit, today = (r["schedule_bound_s"] for r in rows[1:])
    assert as_ran == pytest.approx(explicit)
    assert today != pytest.approx(as_ran)  # the 1 MB first group is a different schedule

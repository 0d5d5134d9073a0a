"""Emulated rows' compression priced with the codecs timed by every worker's process at once."""

from __future__ import annotations

from typing import Any

import pytest

from lowcomm.bench import compress_probe, trained
from lowcomm.bench.compress_probe import measure_shared, measure_shared_rates, median_table
from lowcomm.bench.prediction import add_predictions
from lowcomm.compress.codec import CODECS
from lowcomm.sim import LayerProfile, Profile
from lowcomm.sim.profile import ComputeCosts

INFO = {"measured_bits_per_s": 1e9, "rtt_ms": 0.1}
SHAPES = [[256, 256], [256]]
ONE_PROCESS = {"fp16": {"encode_s_per_elem": 1e-9, "decode_s_per_elem": 1e-9}}


def _profile() -> Profile:
    layers = [LayerProfile("a", 2e-3, 4e-3, SHAPES), LayerProfile("b", 2e-3, 4e-3, SHAPES)]
    return Profile(model="two", batch_size=8, optimizer_s=1e-3, layers=layers, compressors=dict(ONE_PROCESS),
                   costs=ComputeCosts(elementwise_s_per_elem=1e-10))


def _row(method: str, compute: str) -> dict[str, Any]:
    return {"method": method, "spec_run": method, "status": "ok", "iter_time_s_median": 0.03, "compute": compute,
            "breakdown_s": {"forward": 0.004, "backward": 0.008, "optimizer": 0.018}}


def _compress(shared: dict[str, dict[str, float]] | None, compute: str) -> float:
    rows = [_row("nocomm", compute), _row("fp16", compute)]
    add_predictions(rows, _profile(), INFO, workers=4, cpu_share=2.0, shared_compressors=shared)
    return rows[1]["predicted_breakdown_s"]["compress"]


def test_an_emulated_row_takes_the_codecs_times_measured_together() -> None:
    numel = 2 * (256 * 256 + 256)
    together = {"fp16": {"encode_s_per_elem": 5e-9, "decode_s_per_elem": 3e-9}}
    assert _compress(together, "emulated:scale=5") == pytest.approx(numel * 8e-9)
    # without it: the one-process times, scaled by the core share (and the compute calibration)
    assert _compress(None, "emulated:scale=5") != pytest.approx(numel * 8e-9)


def test_a_real_compute_row_is_not_priced_with_them() -> None:
    together = {"fp16": {"encode_s_per_elem": 5e-9, "decode_s_per_elem": 3e-9}}
    assert _compress(together, "real") == pytest.approx(_compress(None, "real"))


def test_the_table_is_the_median_over_processes_per_field() -> None:
    tables = [{"a": {"x": 1.0, "y": 4.0}, "b": {"x": 1.0}}, {"a": {"x": 3.0, "y": 2.0}},
              {"a": {"x": 2.0, "y": 9.0}, "b": {"x": 7.0}}]
    assert median_table(tables) == {"a": {"x": 2.0, "y": 4.0}}  # "b": not every process has it


def test_two_processes_time_every_codec_together() -> None:
    table = measure_shared(SHAPES, 2, reps=1)
    assert set(CODECS.names()) <= set(table)
    assert all(v >= 0 for entry in table.values() for v in entry.values())
    assert all(table[name]["encode_s_per_elem"] > 0 for name in CODECS.names())


def test_no_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1"):
        measure_shared(SHAPES, 0)


def test_two_processes_measure_their_shares_of_the_machine_rates_together() -> None:
    rates = measure_shared_rates(2, window_s=0.05)
    assert set(rates) == {"copy_bytes_per_s", "matmul_flops_per_s"} and min(rates.values()) > 0


def test_workers_that_outnumber_the_cores_get_their_share_of_the_kernel_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def shared(workers: int, **kw: Any) -> dict[str, float]:
        asked.append(workers)
        return {"copy_bytes_per_s": 1.0, "matmul_flops_per_s": 1e30}  # the second above one process's

    monkeypatch.setattr(compress_probe, "measure_shared_rates", shared)
    fits = trained.machine_rates(1, workers=2, cpus=2)
    assert asked == [] and "one_process" not in fits  # a core each: one process's rates
    crowded = trained.machine_rates(1, workers=4, cpus=2)
    assert asked == [4] and crowded["workers_at_once"] == 4
    assert crowded["copy_bytes_per_s"] == 1.0  # the share, when below one process's
    assert crowded["matmul_flops_per_s"] == crowded["one_process"]["matmul_flops_per_s"]  # never above it


def test_a_failed_shared_measurement_leaves_one_processs_rates_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(workers: int, **kw: Any) -> dict[str, float]:
        raise RuntimeError("shared probe: a process exited with code -9")

    monkeypatch.setattr(compress_probe, "measure_shared_rates", broken)
    rates = trained.machine_rates(1, workers=4, cpus=2)
    assert "exited with code -9" in rates["shared_error"] and "one_process" not in rates
    assert rates["copy_bytes_per_s"] > 0 and rates["matmul_flops_per_s"] > 0

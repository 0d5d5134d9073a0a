"""Reports are generated from a recorded bench JSON alone (no re-run needed)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from lowcomm.bench import report

RECORDED = Path(__file__).parent / "data" / "bench_result.json"


@pytest.fixture
def result() -> dict:
    return report.load_json(RECORDED)


def test_recorded_json_has_the_contract_keys(result: dict) -> None:
    assert {"requested", "measured_bits_per_s", "rtt_ms", "emulated"} <= set(result["network"])
    for run in result["runs"]:
        if run["status"] == "ok":
            assert {"method", "iter_time_s_median", "samples_per_s", "bytes_per_worker_per_iter",
                    "speedup_vs_ssgd", "breakdown_s", "lower_bound_s"} <= set(run)


def test_markdown_has_one_row_per_method_and_lists_failures(result: dict) -> None:
    result = copy.deepcopy(result)
    result["runs"].append({"method": "broken", "net": result["network"]["requested"], "status": "failed",
                           "reason": "exit code 1: RuntimeError: boom"})
    md = report.markdown(result)
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    table_rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| method")]
    assert len(table_rows) == len(ok)
    for r in ok:
        assert any(row.startswith(f"| {r['method']}") for row in table_rows)
        assert f"{r['iter_time_s_median'] * 1e3:.1f}" in md
    assert "broken: FAILED — exit code 1: RuntimeError: boom" in md
    assert f"{result['world_size']} workers" in md and result["model"] in md


def test_plot_writes_breakdown_png_and_sweep_writes_speedup_png(result: dict, tmp_path: Path) -> None:
    files = report.plot(result, tmp_path / "bench.png")
    assert [f.name for f in files] == ["bench.png"]
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    sweep = copy.deepcopy(result)
    net2 = dict(sweep["network"], requested="1gbit", measured_bits_per_s=sweep["network"]["measured_bits_per_s"] * 10)
    sweep["networks"] = [sweep["network"], net2]
    sweep["runs"] += [dict(r, net="1gbit") for r in result["runs"]]
    names = [f.name for f in report.plot(sweep, tmp_path / "sweep.png")]
    assert names == ["sweep.png", "sweep_speedup.png"]


def test_terminal_table_prints_every_method(result: dict, capsys: pytest.CaptureFixture[str]) -> None:
    report.print_table(result)
    out = capsys.readouterr().out
    for r in result["runs"]:
        assert r["method"] in out
    assert "lower bound" in out


def test_measured_interface_bytes_column_sits_next_to_counted_bytes(result: dict) -> None:
    result = copy.deepcopy(result)
    header = report.markdown(result).splitlines()[2]
    assert "MB sent (IP)" not in header and "pred ms" not in header  # old recordings render as before
    for r in result["runs"]:
        if r["status"] == "ok":
            r["measured_tx_bytes_per_iter"] = r["bytes_per_worker_per_iter"] * 1.05 + 1234
            r["predicted_iter_time_s"], r["prediction_error"] = r["iter_time_s_median"] * 1.1, 0.1
    lines = report.markdown(result).splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[cells.index("MB/worker/iter") + 1] == "MB sent (IP)"
    assert cells[cells.index("iter ms") + 1: cells.index("iter ms") + 3] == ["pred ms", "pred err"]
    ssgd = next(r for r in result["runs"] if r["method"] == "ssgd")
    row = next([c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ssgd "))
    assert row[cells.index("MB sent (IP)")] == f"{ssgd['measured_tx_bytes_per_iter'] / 1e6:.3g}"
    assert row[cells.index("pred err")] == "+10%"


def test_emulated_compute_rows_and_compute_references_are_labelled(result: dict) -> None:
    result = copy.deepcopy(result)
    ok = [r for r in result["runs"] if r["status"] == "ok"]
    for r in ok:
        r["compute"] = "emulated:a100-resnet50"
    ok[-1]["method"] = ok[-1]["compute_reference"] = "pufferfish:then=nocomm"
    rows = [ln for ln in report.markdown(result).splitlines() if ln.startswith("| ") and not ln.startswith("| method")]
    assert rows and all("(compute emulated)" in row for row in rows)
    assert any(row.startswith("| pufferfish:then=nocomm (compute only) (compute emulated)") for row in rows)

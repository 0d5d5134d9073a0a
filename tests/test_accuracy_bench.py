"""The accuracy and time-to-accuracy benchmarks' bookkeeping, on fake results (no training),
and the digits CNN they use.

Why: the benchmark's tables are what users read to decide whether a compressor is worth it,
so mean/sd, gaps, missing runs, the issue's target checks and the doc rewrite must be right
without running the (hour-long) matrix.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lowcomm import models
from lowcomm.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def _load(name: str) -> ModuleType:
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(f"bench_{name}", module)
    spec.loader.exec_module(module)
    return module


acc = _load("accuracy")
tta_bench = _load("time_to_accuracy")

WL = "mnist1d-cnn1d-c256"
NAMES = ["ssgd", "powersgd", "topk", "signsgd"]


def run(accuracy: float, bytes_step: float = 1000.0, total: float = 10_000.0, **extra: Any) -> dict[str, Any]:
    return {"status": "ok", "final_test_accuracy": accuracy, "bytes_per_step_last_epoch": bytes_step,
            "bytes_total": total, "notices": [], **extra}


def fake_runs() -> dict[str, Any]:
    runs = {}
    for s, a in enumerate([0.940, 0.944, 0.942]):
        runs[acc.run_key(WL, 40, "ssgd", s)] = run(a, 4000.0, 40_000.0)
    for s, a in enumerate([0.935, 0.937, 0.933]):  # -0.7: within 1 point
        runs[acc.run_key(WL, 40, "powersgd", s)] = run(a, 500.0, 8_000.0)
    for s, a in [(0, 0.931), (1, 0.929)]:  # seed 2 missing
        runs[acc.run_key(WL, 40, "topk", s)] = run(a, 100.0, 4_000.0, notices=["lowcomm: moved momentum"])
    runs[acc.run_key(WL, 40, "topk", 2)] = {"status": "failed", "error": "boom", "returncode": 1}
    return runs


def row_of(table: str, method: str) -> list[str]:
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| `{method}` |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_cell_mean_and_sample_sd_over_seeds() -> None:
    c = acc.cell(fake_runs(), WL, 40, "ssgd")
    assert c.n == 3
    assert c.mean == pytest.approx(94.2)
    assert c.sd == pytest.approx(statistics.stdev([94.0, 94.4, 94.2]))
    assert acc.fmt_acc(c) == "94.20 ± 0.20"


def test_table_gaps_bytes_and_target_check() -> None:
    table = acc.render_table(fake_runs(), WL, 40, NAMES)
    ps = row_of(table, "powersgd")
    assert ps[1] == "93.50 ± 0.20"
    assert ps[2] == "93.5 / 93.7 / 93.3"
    assert ps[3] == "-0.70"
    assert ps[4] == "0.5 kB"
    assert ps[5] == "8.00× / 5.00×"
    assert ps[6] == "PASS (≥ −1)"
    assert row_of(table, "ssgd")[6] == "baseline"
    assert "target (within 1 pt of ssgd)" in table


def test_missing_and_failed_runs_are_shown_never_dropped() -> None:
    table = acc.render_table(fake_runs(), WL, 40, NAMES)
    topk = row_of(table, "topk")
    assert topk[1] == "93.00 ± 0.14 (n=2)"
    assert topk[2] == "93.1 / 92.9 / failed"
    assert topk[6] == "FAIL (≥ −1), provisional: n=2"  # -1.2 points
    sign = row_of(table, "signsgd")
    assert sign[1] == "not run" and sign[6] == "not run"
    assert "- `topk`: `lowcomm: moved momentum`" in table


def test_a_method_with_runs_but_no_longer_registered_still_appears() -> None:
    runs = fake_runs()
    runs[acc.run_key(WL, 40, "oldcodec", 0)] = run(0.9)
    table = acc.render_table(runs, WL, 40, NAMES)
    assert row_of(table, "oldcodec")[1] == "90.00 (n=1)"


def test_target_check_at_15_epochs_allows_2_points_and_needs_fewer_bytes() -> None:
    runs = {acc.run_key(WL, 15, "ssgd", s): run(0.94, 4000.0) for s in range(3)}
    runs |= {acc.run_key(WL, 15, "topk", s): run(0.925, 100.0) for s in range(3)}  # -1.5
    runs |= {acc.run_key(WL, 15, "powersgd", s): run(0.94, 4000.0) for s in range(3)}  # no reduction
    table = acc.render_table(runs, WL, 15, NAMES)
    assert row_of(table, "topk")[-1] == "PASS (≥ −2)"
    assert row_of(table, "powersgd")[-1] == "FAIL (≥ −2)"


def test_no_target_column_for_other_workloads_and_no_ssgd_said() -> None:
    runs = {acc.run_key("digits-cnn2d", 15, "topk", 0): run(0.97)}
    table = acc.render_table(runs, "digits-cnn2d", 15, NAMES)
    assert "target" not in table.splitlines()[0]
    assert row_of(table, "topk")[3] == "–"  # no ssgd: no gap
    assert acc.target_check(acc.cell(runs, "digits-cnn2d", 15, "topk"),
                            acc.cell(runs, "digits-cnn2d", 15, "ssgd"), 1.0) == "no ssgd runs"


def test_render_all_has_every_workload_and_length() -> None:
    text = acc.render_all({"runs": fake_runs()}, NAMES)
    for w in acc.WORKLOADS.values():
        for e in acc.LENGTHS:
            assert f"### {w.label}, {e} epochs" in text


def test_plan_skips_ok_runs_and_retries_failed_ones() -> None:
    doc = {"runs": fake_runs()}
    todo = acc.plan(doc, [WL], [40], [0, 1, 2], ["ssgd", "topk"])
    assert todo == [(WL, 40, "topk", 2)]


def test_rerun_plans_ok_runs_again() -> None:
    todo = acc.plan({"runs": fake_runs()}, [WL], [40], [0], ["ssgd", "topk"], rerun=True)
    assert todo == [(WL, 40, "ssgd", 0), (WL, 40, "topk", 0)]


def test_parse_run_bytes_of_the_last_epoch_and_notices() -> None:
    steps = [{"event": "step", "epoch": 0, "bytes": 100}, {"event": "step", "epoch": 1, "bytes": 10},
             {"event": "step", "epoch": 1, "bytes": 30}, {"event": "eval", "epoch": 2}]
    summary = {"final_test_accuracy": 0.9, "bytes_sent_per_worker": 140, "steps": 3, "params": 5,
               "history": [{"event": "eval", "test_accuracy": 0.8}, {"event": "eval", "test_accuracy": 0.9}]}
    stderr = "lowcomm: --method topk: --momentum 0.9 -> 0\nlowcomm: --method topk: --momentum 0.9 -> 0\n" \
             "lowcomm: error: nope\nwarning: careful\nnoise\n"
    rec = acc.parse_run(summary, steps, stderr)
    assert rec["bytes_per_step_last_epoch"] == 20
    assert rec["accuracy_by_epoch"] == [0.8, 0.9]
    assert rec["notices"] == ["lowcomm: --method topk: --momentum 0.9 -> 0", "warning: careful"]


def test_train_command_is_the_users_command_at_trainer_defaults() -> None:
    cmd = acc.train_command(acc.WORKLOADS[WL], 40, "topk", 2, Path("s.json"), Path("l.jsonl"))
    assert cmd[3:] == ["train", "--nproc", "4", "--model", "cnn1d", "--model-arg", "channels=256",
                       "--data", "mnist1d", "--epochs", "40", "--seed", "2", "--method", "topk", "--quiet",
                       "--no-progress", "--json", "s.json", "--log", "l.jsonl"]


def test_methods_come_from_the_codec_registry() -> None:
    from lowcomm.compress.codec import CODECS

    assert acc.methods() == ["ssgd", *CODECS.names()]


def test_marker_rewrite_is_idempotent_and_keeps_the_rest() -> None:
    text = "head\n<!-- accuracy:begin -->\nold\n<!-- accuracy:end -->\ntail\n"
    once = acc.replace_block(text, "accuracy", "new table\n")
    assert once == "head\n<!-- accuracy:begin -->\nnew table\n<!-- accuracy:end -->\ntail\n"
    assert acc.replace_block(once, "accuracy", "new table\n") == once
    with pytest.raises(ValueError):
        acc.replace_block("no markers", "accuracy", "x")
    with pytest.raises(ValueError):
        acc.replace_block(text + text, "accuracy", "x")


def test_save_is_atomic_and_load_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "r" / "accuracy.json"
    doc = acc.load(out)
    doc["runs"][acc.run_key(WL, 15, "ssgd", 0)] = run(0.9)
    acc.save(out, doc)
    assert acc.load(out)["runs"] == doc["runs"]
    assert not list(out.parent.glob("*.tmp"))


def test_the_doc_has_both_generated_blocks_and_they_are_current() -> None:
    doc = (REPO / "docs" / "results_accuracy.md").read_text()
    body = acc.render_all(acc.load(acc.RESULTS), acc.methods())
    assert acc.replace_block(doc, "accuracy", body) == doc, "run benchmarks/accuracy.py --table-only"
    tdoc = acc.load(tta_bench.RESULTS) if tta_bench.RESULTS.exists() else {"runs": {}}
    assert acc.replace_block(doc, "tta", tta_bench.render_all(tdoc)) == doc, \
        "run benchmarks/time_to_accuracy.py --table-only"


# --- time to accuracy -------------------------------------------------------------------------


def curve(points: list[tuple[float, float]]) -> list[dict[str, Any]]:
    return [{"epoch": i + 1, "wall_s": t + 1.0, "train_s": t, "test_accuracy": a} for i, (t, a) in enumerate(points)]


def tta_record(emulated: bool = True) -> dict[str, Any]:
    ok = {"status": "ok"}
    return {
        "command": "lowcomm bench ...", "world_size": 4, "threads_per_worker": 1, "git_commit": "abc",
        "machine": {"cpu": "Test CPU", "cpu_count": 2, "torch": "2.x", "load_avg_1m_at_start": 0.5},
        "network": ({"requested": "100mbit", "label": "100 Mbit/s", "emulated": True, "measured_bits_per_s": 95e6,
                     "rtt_ms": 0.04} if emulated else
                    {"requested": "100mbit", "label": "100 Mbit/s", "emulated": False,
                     "note": "not emulated: not root; ran on loopback"}),
        "runs": [
            {**ok, "method": "ssgd", "final_test_accuracy": 0.94, "bytes_per_worker_per_iter": 2.4e6,
             "accuracy_curve": curve([(10, 0.80), (20, 0.935), (30, 0.94)])},
            {**ok, "method": "topk", "final_test_accuracy": 0.935, "bytes_per_worker_per_iter": 3e4,
             "accuracy_curve": curve([(4, 0.85), (8, 0.9310), (12, 0.935)])},
            {**ok, "method": "acpsgd", "final_test_accuracy": 0.92, "bytes_per_worker_per_iter": 2e4,
             "accuracy_curve": curve([(4, 0.85), (8, 0.90), (12, 0.92)])},
            {"method": "powersgd", "status": "failed", "reason": "exit code 1: boom"},
        ],
    }


def test_tta_target_times_and_speedups() -> None:
    a = tta_bench.analyse(tta_record())
    assert a["target"] == pytest.approx(0.99 * 0.94)
    rows = {r["method"]: r for r in a["rows"]}
    assert rows["ssgd"]["time_s"] == 20  # 0.935 >= 0.9306
    assert rows["topk"]["time_s"] == 8 and rows["topk"]["speedup"] == pytest.approx(2.5)
    assert rows["acpsgd"]["time_s"] is None and rows["acpsgd"]["speedup"] is None
    assert a["clock"] == "training"


def test_tta_table_says_not_reached_failed_and_checks_the_2x_target() -> None:
    text = tta_bench.render_one("100mbit/15/0", tta_record())
    assert row_of(text, "ssgd")[-1] == "baseline"
    assert row_of(text, "topk")[2:4] == ["8.0", "2.50×"] and row_of(text, "topk")[-1] == "PASS (≥ 2×)"
    assert row_of(text, "acpsgd")[2] == "not reached (best 92.0 %)"
    assert row_of(text, "acpsgd")[-1] == "FAIL (target not reached)"
    assert row_of(text, "powersgd")[2].startswith("failed: exit code 1")
    assert "4 workers share its 2 cores" in text and "emulated 100 Mbit/s" in text


def test_tta_loopback_fallback_is_stated_in_the_table() -> None:
    text = tta_bench.render_one("100mbit/15/0", tta_record(emulated=False))
    assert "**loopback, not the 100 Mbit/s cluster**" in text


def test_tta_without_ssgd_has_no_target() -> None:
    rec = tta_record()
    rec["runs"] = rec["runs"][1:]
    assert tta_bench.analyse(rec)["target"] is None
    assert "No successful `ssgd` run" in tta_bench.render_one("100mbit/15/0", rec)


# --- the digits CNN ---------------------------------------------------------------------------


def test_cnn2d_reads_64_features_as_8x8_and_gives_logits() -> None:
    torch.manual_seed(0)
    kw = models.kwargs_for_data("cnn2d", num_classes=10, input_shape=(64,))
    model = models.create("cnn2d", **kw)
    assert 3_000 <= models.count_parameters(model) <= 20_000
    x = torch.randn(5, 64)
    out = model(x)
    assert out.shape == (5, 10)
    assert torch.equal(model(x.reshape(5, 1, 8, 8)), out)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cnn2d_refuses_a_non_square_input_with_the_fix() -> None:
    kw = models.kwargs_for_data("cnn2d", num_classes=10, input_shape=(40,))  # MNIST-1D
    with pytest.raises(UsageError, match="square.*cnn1d"):
        models.create("cnn2d", **kw)

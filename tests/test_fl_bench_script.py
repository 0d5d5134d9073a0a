"""The lowcomm-vs-Flower benchmark's orchestration, without Flower, Ray or a training run.

Why: the comparison is only worth its numbers if both sides really run the same setup, if the
memory of *every* process of a run is counted (Ray's daemons need not be descendants of the
driver), and if the table says what was measured. Those pieces are tested here on tiny inputs
and canned results; the real runs are the benchmark itself (benchmarks/fl_vs_flower.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import fl_vs_flower as fb  # noqa: E402  (scripts, not a package: loaded from their folder)
import fl_vs_flower_report as fr  # noqa: E402
import flower_app  # noqa: E402  (imports flwr only inside its Flower functions)


def test_defaults_are_the_issues_comparison() -> None:
    a = fb.parse_args([])
    assert (a.clients, a.samples_per_client, a.per_round, a.hidden) == (1000, 40, [100, 1000], 256)
    assert (a.local_epochs, a.batch_size, a.nproc, a.partition) == (1, 16, 2, "dirichlet:alpha=0.5")
    assert a.sides == ["lowcomm", "flower"]


@pytest.mark.parametrize("argv", [["--per-round", "2000"], ["--rounds", "0"], ["--lr", "0"],
                                  ["--per-round", "0"], ["--sides", "fedml"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        fb.parse_args(argv)
    assert e.value.code == 2


def _setup(**over: Any) -> dict[str, Any]:
    args = fb.parse_args(["--clients", "20", "--per-round", "5", "--rounds", "2", "--lr", "0.05", "--seed", "3"])
    return {**fb.same_setup(args, 5), **over}


def test_lowcomm_command_is_accepted_by_lowcomm_fl_with_the_same_setup(tmp_path: Path) -> None:
    from lowcomm.fl.cli import add_fl_arguments, config_from_args

    setup = _setup()
    cmd = fb.lowcomm_command(setup, tmp_path / "out.json")
    assert cmd[1:4] == ["-m", "lowcomm", "fl"]
    p = argparse.ArgumentParser()
    add_fl_arguments(p)
    cfg = config_from_args(p.parse_args(cmd[4:]))
    for key in ("clients", "per_round", "nproc", "algorithm", "model", "model_args", "data", "partition",
                "rounds", "local_epochs", "batch_size", "lr", "seed", "samples_per_client"):
        assert getattr(cfg, key) == setup[key], key
    assert cfg.momentum == 0.0 and cfg.eval_every == 1 and cfg.threads == setup["cpus_per_client"]
    assert cfg.device == "cpu"  # Flower's side is CPU-only: so is lowcomm's, even on a GPU machine
    assert cfg.json == str(tmp_path / "out.json")


def test_flower_side_builds_the_same_clients_data_and_initial_weights() -> None:
    from lowcomm.fl.partition import sample_clients
    from lowcomm.fl.workload import build_partition, initial_model, load_data

    setup = _setup()
    w = flower_app.workload(setup)
    bundle = load_data("mnist1d", data_dir=None, data_args={}, clients=20, samples_per_client=40)
    part = build_partition(bundle, setup["partition"], clients=20, seed=3)
    model = initial_model("mlp", {"hidden": 256}, bundle, seed=3)
    np.testing.assert_array_equal(w["partition"].indices, part.indices)
    np.testing.assert_array_equal(w["partition"].offsets, part.offsets)
    for a, b in zip(w["initial"], model.state_dict().values()):
        assert a.shape == b.shape and bool((a == b).all())
    assert [p.shape for p in model.parameters()][0] == (256, 40)
    for r in range(3):
        assert flower_app.sampled_clients(setup, r) == sample_clients(20, 5, seed=3, round=r).tolist()


def test_flower_client_training_moves_the_weights_and_reports_its_samples() -> None:
    setup = _setup()
    w = flower_app.workload(setup)
    start = {k: v.clone() for k, v in w["model"].state_dict().items()}
    acc0, _ = flower_app.evaluate(setup, start)
    trained, n = flower_app.train_client(setup, start, client_id=4, round=0)
    assert n == len(w["partition"].client(4)) > 0
    assert any(not bool((trained[k] == start[k]).all()) for k in start)
    again, _ = flower_app.train_client(setup, start, client_id=4, round=0)
    assert all(bool((again[k] == trained[k]).all()) for k in start)  # batch order seeded: reproducible
    assert 0.0 <= acc0 <= 1.0


def _detached_marked_child(token: str) -> int:
    """A process carrying the marker whose parent has exited (re-parented: not a descendant)."""
    code = ("import subprocess; p = subprocess.Popen(['sleep', '30'], stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL, start_new_session=True); print(p.pid)")
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", fb.MARKER: token},
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_memory_sampler_counts_marked_processes_that_are_not_descendants() -> None:
    pid = _detached_marked_child("tok-a")
    other = _detached_marked_child("tok-b")  # another run's: not counted
    try:
        sampler = fb.RunMemorySampler(root_pid=2**22 + 7, token="tok-a", interval_s=0.05)
        pids = {p.pid for p in sampler.members()}
        assert pid in pids and other not in pids
        sampler.sample()
        assert sampler.peak["processes"] >= 1 and sampler.peak["pss_bytes"] > 0
        assert sampler.peak["rss_bytes"] >= sampler.peak["pss_bytes"]
        assert sampler.end_leftovers(grace_s=0.0) == 1
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        for p in (pid, other):
            try:
                psutil.Process(p).kill()
            except psutil.Error:
                pass


def test_run_measured_reports_exit_code_peaks_and_output(tmp_path: Path) -> None:
    res = fb.run_measured([sys.executable, "-c", "import time; print('hi'); time.sleep(0.3)"],
                          interval_s=0.05, timeout_s=60)
    assert res["returncode"] == 0 and "hi" in res["log_tail"]
    assert res["peak_memory"]["processes"] >= 1 and res["peak_memory"]["rss_bytes"] > 0
    bad = fb.run_measured([sys.executable, "-c", "raise SystemExit(3)"], interval_s=0.05, timeout_s=60)
    assert bad["returncode"] == 3


def test_summary_medians_and_first_round() -> None:
    hist = [{"round": i, "round_time_s": t, "test_accuracy": a}
            for i, (t, a) in enumerate([(5.0, 0.2), (1.0, 0.3), (2.0, 0.4), (3.0, 0.5)])]
    s = fb.summarize(hist)
    assert s["round_time_s_median"] == 2.5 and s["first_round_s"] == 5.0
    assert s["round_time_s_median_after_first"] == 2.0 and s["final_test_accuracy"] == 0.5


def _side(round_s: float, rss: float, pss: float, accuracy: float, n: int = 3) -> dict[str, Any]:
    hist = [{"round": i, "round_time_s": round_s, "test_accuracy": accuracy, "elapsed_s": (i + 1) * round_s}
            for i in range(n)]
    return {"status": "ok", "wall_s": 10.0, **fb.summarize(hist), "history": hist,
            "peak_memory": {"rss_bytes": int(rss * 1e9), "pss_bytes": int(pss * 1e9), "processes": 3}}


def canned(per_round: int, flower_s: float = 41.5, flower_gb: float = 2.3) -> dict[str, Any]:
    setup = fb.same_setup(fb.parse_args([]), per_round)
    fl = _side(flower_s, flower_gb, flower_gb * 0.7, 0.605)
    fl.update(versions={"flwr": "1.41.0", "ray": "2.55.1"}, actors=2)
    return {"setup": setup, "lowcomm": _side(2.0, 0.2, 0.15, 0.60), "flower": fl,
            "machine": {"cpu": "Test CPU 9000", "cpu_count": 2, "memory_gb": 8.0}, "git_commit": "abc" * 14}


def test_comparison_and_targets_only_at_1000_clients_per_round() -> None:
    c = fr.compare(canned(1000))
    assert c is not None
    assert c["speedup"] == pytest.approx(41.5 / 2.0) and c["memory_ratio_rss"] == pytest.approx(11.5)
    assert c["accuracy_gap_points"] == pytest.approx(-0.5)
    assert c["targets"] == {"speedup": True, "memory": True, "accuracy": True}
    low_memory = fr.compare(canned(1000, flower_gb=1.0))
    assert low_memory is not None and low_memory["targets"]["memory"] is False
    small = fr.compare(canned(100))
    assert small is not None and "targets" not in small
    failed = canned(1000)
    failed["flower"] = {"status": "failed", "returncode": 1}
    assert fr.compare(failed) is None


def test_markdown_names_machine_versions_and_both_rows() -> None:
    doc = {"scenarios": {"b": canned(1000), "a": canned(100, flower_s=3.6)}}
    md = fr.render_markdown(doc)
    assert md.index("### 100 of 1000") < md.index("### 1000 of 1000")  # by clients per round
    assert "Test CPU 9000" in md and "2 cores" in md and "Flower 1.41.0 + Ray 2.55.1" in md
    assert "| lowcomm | 2.00 s |" in md and "| Flower | 41.50 s |" in md and "60.0 %" in md
    assert "**20.8x** faster" in md and "speed met, memory met, accuracy met" in md
    doc["scenarios"]["b"]["flower"] = {"status": "failed", "returncode": 1}
    assert "| Flower | failed (exit 1) |" in fr.render_markdown(doc)


def test_outputs_write_the_block_plot_and_keep_the_rest_of_the_doc(tmp_path: Path) -> None:
    doc = {"scenarios": {"k": canned(1000)}}
    page = tmp_path / "fl.md"
    page.write_text("intro\n<!-- fl-vs-flower:begin -->\nold\n<!-- fl-vs-flower:end -->\noutro\n")
    args = fb.parse_args(["--markdown", str(tmp_path / "t.md"), "--doc", str(page),
                          "--plot", str(tmp_path / "p.png")])
    fb.write_outputs(doc, args)
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| Flower | 41.50 s |" in text
    assert (tmp_path / "t.md").read_text().startswith("<!-- fl-vs-flower:begin -->")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_table_only_renders_saved_results_without_running(tmp_path: Path, capsys: Any) -> None:
    results = tmp_path / "r.json"
    fb.save(results, {"benchmark": "fl_vs_flower", "scenarios": {"k": canned(1000)}})
    t0 = time.perf_counter()
    assert fb.main(["--table-only", "--results", str(results), "--markdown", str(tmp_path / "t.md"),
                    "--doc", str(tmp_path / "none.md"), "--plot", str(tmp_path / "p.png")]) == 0
    assert "| lowcomm | 2.00 s |" in capsys.readouterr().out
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "none.md").exists()


def test_missing_benchmark_environment_is_a_failed_row_saying_what_to_do(tmp_path: Path) -> None:
    args = fb.parse_args(["--flower-python", str(tmp_path / "nope" / "python")])
    row = fb.run_side("flower", fb.same_setup(args, 100), args, tmp_path)
    assert row["status"] == "failed" and "fl_env.sh" in row["error"]

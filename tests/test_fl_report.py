"""The federated run's display and measurement: process-tree memory, round lines, summary, plots."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from lowcomm.errors import UsageError
from lowcomm.fl.memory import MemoryPeak, ProcessTreeSampler, peak_of_self, tree_memory
from lowcomm.fl.report import (
        RoundDisplay,
    RoundRecord,
    human_bytes,
    plot,
    plot_runs,
    print_round,
    print_summary,
    round_line,
)

ALLOC = 64 * 2**20
# the child holds ALLOC private, touched bytes; the parent's own RSS may move by a few MB
# between our reading and the sampler's (allocator, imports), far below a quarter of ALLOC
SLACK = ALLOC // 4

CHILD = (
    "import sys\n"
    f"block = b'\\x01' * {ALLOC}\n"  # bytes built by repetition are written, hence resident
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def _record(r: int, acc: float, elapsed: float, predicted: float | None = None) -> RoundRecord:
    return RoundRecord(
        round=r, test_accuracy=acc, test_loss=1.0 - acc, round_time_s=0.5, train_makespan_s=0.4,
        predicted_makespan_s=predicted,
        plan={"kind": "even" if predicted is None else "fitted", "clients_per_worker": [3, 2],
              "samples_per_worker": [120, 80], "predicted_s_per_worker": None,
              "actual_s_per_worker": [0.4, 0.3]},
        bytes_per_worker=2.0e5, clients=5, elapsed_s=elapsed)


# records number rounds from 0, as the engine does
HISTORY = [_record(0, 0.3, 0.5), _record(1, 0.45, 1.0), _record(2, 0.6, 1.5, predicted=0.38)]


def test_the_sampler_counts_a_child_process_memory() -> None:
    sampler = ProcessTreeSampler(os.getpid(), interval_s=0.05).start()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        own = psutil.Process().memory_info().rss
        sampler.sample()  # explicitly, while the child holds its block: no reliance on timing
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
    peak = sampler.stop()
    assert peak.processes >= 2
    assert peak.rss_bytes >= own + ALLOC - SLACK
    assert peak.pss_bytes >= ALLOC - SLACK  # the child's block is private: fully in its PSS
    assert sampler.samples >= 3  # start, the explicit one, stop


def test_pss_never_exceeds_rss_and_a_vanished_root_gives_nothing() -> None:
    now = tree_memory(os.getpid())
    assert now is not None and 0 < now.pss_bytes <= now.rss_bytes and now.processes >= 1
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    assert tree_memory(gone.pid) is None


def test_peak_of_self_is_at_least_the_current_rss() -> None:
    assert peak_of_self() >= psutil.Process().memory_info().rss * 0.9


def test_memory_peak_json_form() -> None:
    assert MemoryPeak(3, 2, 1).to_dict() == {"rss_bytes": 3, "pss_bytes": 2, "processes": 1}


def test_round_line_shows_accuracy_times_and_the_plan() -> None:
    line = round_line(HISTORY[2], total=10)
    assert line.startswith("round 3/10: acc 60.00 %")
    assert "makespan 0.400 s (predicted 0.380 s)" in line and "fitted plan" in line
    assert "predicted" not in round_line(HISTORY[0].to_dict())  # dicts work too; even: no prediction


def test_print_round_and_the_progress_display_write_each_round() -> None:
    for live in (False, True):
        buf = io.StringIO()
        console = Console(file=buf, width=200)
        with RoundDisplay(total_rounds=len(HISTORY), start_round=0, console=console, live=live) as progress:
            for rec in HISTORY:
                progress.update(rec)
        assert buf.getvalue().count("round ") >= len(HISTORY)
    buf = io.StringIO()
    print_round(HISTORY[0], console=Console(file=buf, width=200))
    assert "acc 30.00 %" in buf.getvalue()


def test_print_summary_renders_the_result_json() -> None:
    summary = {
        "command": "fl", "algorithm": "fedavg", "clients": 1000, "per_round": 100, "world_size": 2,
        "model": "mlp", "data": "mnist1d", "partition": "dirichlet:alpha=0.5", "rounds": 3,
        "local_epochs": 1, "batch_size": 16, "lr": 0.05, "final_test_accuracy": 0.6,
        "round_time_s_median": 0.5, "bytes_per_round_per_worker": 2.0e5,
        "peak_memory": {"rss_bytes": 3 * 2**30, "pss_bytes": 2**30, "processes": 3},
        "partition_stats": {"min_size": 10, "mean_size": 40.0, "per_client": [1, 2]},
        "history": [r.to_dict() for r in HISTORY],
    }
    buf = io.StringIO()
    print_summary(summary, console=Console(file=buf, width=200))
    text = buf.getvalue()
    for expected in ("fedavg", "60.00 %", "0.500 s", "1.0 GiB", "3.0 GiB", "195.3 KiB",
                     "partition: min_size", "predicted 0.380 s"):
        assert expected in text, expected
    assert "per_client" not in text  # lists stay in the JSON


def test_record_round_trips_through_json_form() -> None:
    rec = HISTORY[2]
    assert RoundRecord.from_dict({**rec.to_dict(), "future_key": 1}) == rec


def test_human_bytes() -> None:
    assert human_bytes(512) == "512 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(None) == "-"


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_writes_the_file_named(tmp_path: Path, suffix: str) -> None:
    out = plot(HISTORY, tmp_path / "sub" / f"acc{suffix}")
    assert out.is_file() and out.stat().st_size > 0


def test_plot_runs_overlays_two_runs(tmp_path: Path) -> None:
    out = plot_runs({"lowcomm": HISTORY, "flower": [r.to_dict() for r in HISTORY[:2]]},
                    tmp_path / "both.pdf", title="1000 clients", log_time=True)
    assert out.read_bytes().startswith(b"%PDF")


def test_plot_refuses_an_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"\.png, \.svg, \.pdf"):
        plot(HISTORY, tmp_path / "acc.jpeg")

"""``lowcomm split`` end to end on a tiny BERT checkpoint and tiny GLUE files: two processes,
bytes per direction as the formula says, the unsplit baseline, one-line misuse, a lost peer.

The checkpoint is written in HF's layout (``test_split_bert``'s helpers), so the same loader
that reads MiniLM reads it; the data are SST-2-format TSV files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lowcomm.split.bert import BertEncoder
from lowcomm.split.transport import backward_bytes, forward_bytes
from lowcomm.testing.faults import alive, step_records, worker_pids

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from test_split_bert import VOCAB, hf_names, tiny_config, write_checkpoint  # noqa: E402

WORDS = VOCAB[5:]
BATCH, MAX_LEN, RANK = 4, 12, 4


def _sst2(d: Path, rows: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", rows), ("dev.tsv", 8)):
        lines = ["sentence\tlabel"]
        for i in range(n):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))
            lines.append(f"{words}\t{i % 2}")
        (d / name).write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("split")
    torch.manual_seed(0)
    encoder = BertEncoder(tiny_config(num_hidden_layers=2))
    model = write_checkpoint(root / "tiny", encoder.config, hf_names(encoder.state_dict(), 2))
    _sst2(root / "SST-2", rows=400)
    return model, root


def _split(setup: tuple[Path, Path], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    model, data = setup
    cmd = [sys.executable, "-m", "lowcomm", "split", "--model", str(model), "--data", "sst2",
           "--data-dir", str(data), "--split-layer", "1", "--rank", str(RANK), "--batch-size", str(BATCH),
           "--max-len", str(MAX_LEN), "--threads", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("wire, extra, widths", [("bf16", [], [RANK]), ("fp32", ["--no-compress"], [32]),
                                                 ("fp16", ["--keep-residual"], [RANK, 32])])
def test_edge_and_cloud_train_and_count_each_direction(setup: tuple[Path, Path], tmp_path: Path, wire: str,
                                                       extra: list[str], widths: list[int]) -> None:
    out = tmp_path / "split.json"
    r = _split(setup, "--steps", "3", "--wire", wire, "--json", str(out), "--quiet", *extra)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == 3 and s["test_samples"] == 8 and 0.0 <= s["final_test_accuracy"] <= 1.0
    # full batches of BATCH texts padded to MAX_LEN tokens: the transport's own formulas
    assert s["bytes_per_step"]["edge_to_cloud"] == forward_bytes(BATCH, MAX_LEN, widths, wire)
    assert s["bytes_per_step"]["cloud_to_edge"] == backward_bytes(BATCH, MAX_LEN, widths, wire)


def test_emulated_compute_replays_real_messages_through_the_link_and_reports_no_accuracy(
        setup: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "emulated.json"
    r = _split(setup, "--steps", "11", "--wire", "bf16", "--compute", "emulated:scale=5", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["compute"] == "emulated:scale=5" and s["final_test_accuracy"] is None
    assert s["steps"] == 11 and s["timed_steps"] == 3
    # every step, replayed ones included, crossed the link with the real message's bytes
    assert s["bytes_per_step"]["edge_to_cloud"] == forward_bytes(BATCH, MAX_LEN, [RANK], "bf16")
    assert s["bytes_per_step"]["cloud_to_edge"] == backward_bytes(BATCH, MAX_LEN, [RANK], "bf16")
    measured = s["compute_measured"]
    assert all(measured[k] > 0 for k in ("edge_forward_s", "edge_backward_s", "cloud_s", "real_step_time_s_median"))


def test_unsplit_baseline_runs_in_one_process_and_sends_nothing(setup: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "unsplit.json"
    r = _split(setup, "--unsplit", "--steps", "2", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["mode"] == "unsplit" and s["bytes_per_step_total"] == 0 and s["steps"] == 2


@pytest.mark.parametrize("args, words", [
    (["--split-layer", "3"], "--split-layer must be an integer from 1 to 2"),
    (["--rank", "32"], "from 1 to 31"),
    (["--wire", "fp8"], "fp32, fp16, bf16"),
    (["--no-compress", "--keep-residual"], "compressed split only"),
    (["--model", "/nonexistent/bert"], "/nonexistent/bert"),
    (["--data", "imdb"], "tweets"),
    (["--compute", "emulated:scale=2"], "N > 8"),
    (["--compute", "emulated:x.json"], "real or emulated:scale=K"),
])
def test_misuse_is_one_line_and_exit_2(setup: tuple[Path, Path], args: list[str], words: str) -> None:
    r = _split(setup, "--steps", "1", *args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")
def test_a_lost_cloud_stops_the_edge_and_is_named(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model, data = setup
    log = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "lowcomm", "split", "--model", str(model), "--data", "sst2", "--data-dir", str(data),
           "--split-layer", "1", "--rank", str(RANK), "--batch-size", str(BATCH), "--max-len", str(MAX_LEN),
           "--threads", "1", "--epochs", "50", "--log", str(log), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180  # start-up guard only: two interpreters importing torch
        while len(step_records(log)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.05)
        pids = worker_pids(proc.pid)
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)  # a hang would fail here
        assert proc.returncode not in (0, None)
        assert "worker rank 1 was killed by SIGKILL" in err
        assert not alive(pids[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

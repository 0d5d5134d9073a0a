"""A worker SIGKILLed in the middle of training stops every rank and is named; ``--resume``
then continues from the last complete checkpoint, never from one being written at the kill.

The checkpoint unit tests kill a real child process in the middle of a write (SIGKILL: no
``finally`` and no exit handler runs, as with the OOM killer). The end-to-end tests wait for
training to be under way by reading rank 0's JSONL log, never by sleeping; their only clocks
are hang guards. ``benchmarks/kill_loop.py`` repeats the kill ten times.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowcomm.errors import UsageError
from lowcomm.runtime import checkpoint
from lowcomm.testing.faults import KillResult, run_and_kill, step_records

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")

# --- checkpoint files: what a kill at any moment leaves behind is never loaded -------------


def _save_complete(directory: Path, step: int, world: int = 2) -> None:
    for rank in range(world):
        checkpoint.save_rank(str(directory), step, rank, {"step": step, "w": torch.full((4,), float(rank))})
    checkpoint.commit(str(directory), step, {"world_size": world})


# The child saves step 20 of rank 0 and SIGKILLs itself at the given point.
_KILL_WHILE_SAVING = """
import os, signal, sys
import torch
from lowcomm.runtime import checkpoint

directory, where = sys.argv[1], sys.argv[2]

class DieWhilePickled:
    # torch.save has opened the temp file and written part of it when this is pickled
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)

if where == "rank-file":
    checkpoint.save_rank(directory, 20, 0, {"w": torch.zeros(1000), "x": DieWhilePickled()})
elif where == "manifest":  # the rank files are complete; die before latest.json is renamed
    for rank in (0, 1):
        checkpoint.save_rank(directory, 20, rank, {"step": 20, "w": torch.ones(4)})
    os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.commit(directory, 20, {"world_size": 2})
"""


def _kill_child_while_saving(directory: Path, where: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILL_WHILE_SAVING, str(directory), where], timeout=240)
    assert proc.returncode == -9, "the child was meant to die by SIGKILL mid-write"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["rank-file", "manifest"])
def test_checkpoint_killed_mid_write_is_never_loaded(tmp_path: Path, where: str) -> None:
    _save_complete(tmp_path, 10)
    _kill_child_while_saving(tmp_path, where)

    assert list(tmp_path.glob(".tmp-*")), "the kill should have left a temporary file behind"
    manifest = checkpoint.latest(str(tmp_path))
    assert manifest is not None and manifest["step"] == 10
    for rank in (0, 1):
        assert torch.equal(checkpoint.load_rank(str(tmp_path), 10, rank)["w"], torch.full((4,), float(rank)))


def test_rank_files_without_a_manifest_are_ignored(tmp_path: Path) -> None:
    _save_complete(tmp_path, 10)
    for rank in (0, 1):  # every rank saved step 20, the job died before commit
        checkpoint.save_rank(str(tmp_path), 20, rank, {"step": 20})
    assert checkpoint.latest(str(tmp_path))["step"] == 10
    assert checkpoint.load_rank(str(tmp_path), 10, 1)["step"] == 10


def test_next_commit_removes_files_left_by_a_killed_writer(tmp_path: Path) -> None:
    _save_complete(tmp_path, 10)
    (tmp_path / ".tmp-abandoned").write_bytes(b"PK\x03\x04 half a zip")
    checkpoint.save_rank(str(tmp_path), 20, 0, {"step": 20})  # rank 1 never got there
    _save_complete(tmp_path, 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000030-rank0.pt", "ckpt-00000030-rank1.pt", "latest.json"
    ]


def test_damaged_or_missing_rank_file_is_a_one_line_error(tmp_path: Path) -> None:
    _save_complete(tmp_path, 10)
    path = Path(checkpoint.rank_path(str(tmp_path), 10, 1))
    path.write_bytes(path.read_bytes()[:100])  # e.g. copied partially
    with pytest.raises(UsageError, match="is damaged"):
        checkpoint.load_rank(str(tmp_path), 10, 1)
    path.unlink()
    with pytest.raises(UsageError, match="is missing"):
        checkpoint.load_rank(str(tmp_path), 10, 1)


def test_unreadable_manifest_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / checkpoint.MANIFEST).write_text('{"step": 1')
    with pytest.raises(UsageError, match="unreadable"):
        checkpoint.latest(str(tmp_path))


# --- end to end: SIGKILL of one worker mid-step --------------------------------------------

# Far more steps than the test waits for: the kill always lands while training runs.
_LONG_RUN = ["--model", "mlp", "--data", "mnist1d", "--batch-size", "32", "--lr", "0.05",
             "--schedule", "constant", "--threads", "1", "--quiet", "--no-progress", "--no-eval",
             "--steps", "1000000"]


def _assert_stopped_and_named(result: KillResult) -> None:
    assert not result.hung, "the command did not exit within the 120 s hang guard after the kill"
    # the requirement is 60 s; measured 1-3 s under load, so this bound has a 20x margin
    assert result.exit_s is not None and result.exit_s < 60, result.exit_s
    assert result.returncode != 0
    assert f"lowcomm: worker rank {result.rank} was killed by SIGKILL" in result.stderr, result.stderr
    assert result.leftover_pids == []  # every rank exited, none orphaned


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_a_worker_mid_training_stops_every_rank_and_names_it(tmp_path: Path) -> None:
    # Rank 1 here; the resume test below kills rank 0 (the one that logs and commits).
    result = run_and_kill([*_LONG_RUN, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "5"],
                          nproc=2, rank=1, log_path=tmp_path / "log.jsonl", after_steps=10)
    _assert_stopped_and_named(result)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_after_a_kill_continues_from_the_last_complete_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    # Rank 0 writes the manifest: killing it with a checkpoint every step makes a kill in the
    # middle of checkpointing likely (rank files written, manifest not yet).
    killed = run_and_kill([*_LONG_RUN, "--checkpoint-dir", str(ck), "--checkpoint-every", "1"],
                          nproc=2, rank=0, log_path=tmp_path / "killed.jsonl", after_steps=10)
    _assert_stopped_and_named(killed)

    manifest = checkpoint.latest(str(ck))
    assert manifest is not None and manifest["step"] >= 1
    start = manifest["step"]

    # Resume; a few more steps are enough to show it continues and finishes.
    resumed_log = tmp_path / "resumed.jsonl"
    argv = [sys.executable, "-m", "lowcomm", "train", "--nproc", "2", *_LONG_RUN[:-2], "--steps", str(start + 8),
            "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--resume", "--log", str(resumed_log)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr

    steps = [r["step"] for r in step_records(resumed_log)]
    assert steps == list(range(start + 1, start + 9))  # picked up right after the manifest's step
    assert checkpoint.latest(str(ck))["step"] == start + 8
    assert not list(ck.glob(".tmp-*"))  # what the kill left half-written is gone

"""Malformed command lines: every one exits 2 with exactly one line on stderr, no traceback,
and before any work starts.

Numbers are refused for what they mean, not only their sign: nan and inf (``1e400`` parses
as inf) pass a plain ``x > 0`` test, so ``--lr nan`` used to train to nan without a word.
Most cases run in-process through :func:`lowcomm.cli.main` (fast), with the entry points
that start work replaced by tripwires: a case that gets past validation fails loudly
instead of training. A few run as real ``python -m lowcomm`` processes, to check what a user
sees on the terminal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lowcomm.cli import main

BIG = str(10**30)
PROFILE = "@PROFILE"  # replaced by the path of a small hand-written profile

_TRAIN = ["train", "--model", "mlp", "--data", "mnist1d"]

# (argv, a fragment the one error line must contain: it is about the right thing)
TRAIN_CASES: list[tuple[list[str], str]] = [
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "1e400"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--lr", ""], "--lr"),
    (["--gamma", "0", "--schedule", "step"], "--gamma"),
    (["--gamma", "nan"], "--gamma"),
    (["--gamma", "1.5", "--schedule", "multistep"], "--gamma"),
    (["--momentum", "1"], "--momentum"),
    (["--momentum", "nan"], "--momentum"),
    (["--momentum", "-0.1"], "--momentum"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--weight-decay", "inf"], "--weight-decay"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--epochs", "0"], "--epochs"),
    (["--epochs", "-3"], "--epochs"),
    (["--epochs", "1.5"], "--epochs"),
    (["--epochs", BIG], "--epochs"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", ""], "--batch-size"),
    (["--batch-size", "1e400"], "--batch-size"),
    (["--eval-batch-size", "0"], "--eval-batch-size"),
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "-1"], "--nproc"),
    (["--nproc", "100000"], "--nproc"),
    (["--nproc", BIG], "--nproc"),
    (["--steps", "0"], "--steps"),
    (["--steps", BIG], "--steps"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--lr-warmup-epochs", "nan"], "--lr-warmup-epochs"),
    (["--lr-warmup-epochs", "-1"], "--lr-warmup-epochs"),
    (["--milestones", "abc"], "--milestones"),
    (["--milestones", ""], "--milestones"),
    (["--milestones", "0.5,nan"], "--milestones"),
    (["--milestones", "-0.5"], "--milestones"),
    (["--step-size-epochs", "0"], "--step-size-epochs"),
    (["--clip-grad", "0"], "--clip-grad"),
    (["--clip-grad", "nan"], "--clip-grad"),
    (["--clip-grad", "inf"], "--clip-grad"),
    (["--threads", "0"], "--threads"),
    (["--threads", BIG], "--threads"),
    (["--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
    (["--bucket-cap-mb", "inf"], "--bucket-cap-mb"),
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--seed", "-1"], "--seed"),
    (["--seed", BIG], "--seed"),
    (["--num-classes", "0"], "--num-classes"),
    (["--vocab-size", "1"], "--vocab-size"),
    (["--input-shape", "0"], "--input-shape"),
    (["--input-shape", "a,b"], "--input-shape"),
    (["--input-shape", f"{BIG},{BIG}"], "--input-shape"),
    (["--model", ""], "unknown model"),
    (["--model", "nosuchnet"], "unknown model"),
    (["--data", ""], "unknown dataset"),
    (["--optimizer", "adam"], "--optimizer"),
    (["--schedule", "linear"], "--schedule"),
    (["--device", "tpu"], "--device"),
    (["--model-arg", "noeq"], "--model-arg"),
    (["--model-arg", "=3"], "--model-arg"),
    (["--model-arg", "num_classes=0"], "num_classes"),
    (["--model-arg", "nosuch=1"], "nosuch"),
    (["--nesterov", "--momentum", "0"], "--nesterov"),
    (["--stop-after-steps", "3"], "--checkpoint-dir"),
    (["--bogus"], "--bogus"),
    # --method name:key=value strings
    (["--method", ""], "method"),
    (["--method", ":"], "method"),
    (["--method", "magic"], "unknown method"),
    (["--method", "acpsgd:rank="], "rank"),
    (["--method", "acpsgd:=4"], "unknown option ''"),
    (["--method", "acpsgd:rank=abc"], "rank"),
    (["--method", "acpsgd:rank=0"], "rank"),
    (["--method", "acpsgd:rank=-1"], "rank"),
    (["--method", "acpsgd:rank=4.5"], "rank"),
    (["--method", "acpsgd:rank=1e400"], "rank"),
    (["--method", f"powersgd:rank={BIG}"], "rank"),
    (["--method", "acpsgd:rank"], "key=value"),
    (["--method", "acpsgd:nosuch=1"], "nosuch"),
    (["--method", "acpsgd:min_compression_rate=nan"], "min_compression_rate"),
    (["--method", "acpsgd:min_compression_rate=inf"], "min_compression_rate"),
    (["--method", "acpsgd:min_compression_rate=0"], "min_compression_rate"),
    (["--method", "acpsgd:start_iter=-1"], "start_iter"),
    (["--method", "acpsgd:error_feedback=maybe"], "error_feedback"),
    (["--method", "topk:density=2"], "density"),
    (["--method", "topk:density=0"], "density"),
    (["--method", "topk:density=nan"], "density"),
    (["--method", "topk:density=-0.1"], "density"),
    (["--method", "topk:density="], "density"),
    (["--method", "gtopk:density=inf"], "density"),
    (["--method", "signum:momentum=1"], "momentum"),
    (["--method", "signum:momentum=nan"], "momentum"),
    (["--method", "pufferfish:rank_ratio=0"], "rank_ratio"),
    (["--method", "pufferfish:rank_ratio=nan"], "rank_ratio"),
    (["--method", "pufferfish:warmup_epochs=-1"], "warmup_epochs"),
    (["--method", "pufferfish:frob_decay=inf"], "frob_decay"),
    (["--method", "pufferfish:full_rank=("], "full_rank"),
    (["--method", "pufferfish:warmup_method=nosuch"], "nosuch"),
    (["--method", "mgwfbp:alpha=nan,beta=1"], "alpha"),
    (["--method", "mgwfbp:profile_iters=0"], "profile_iters"),
    (["--method", "dear:threshold_mb=inf"], "threshold_mb"),
    (["--method", "dear:tune_max_mb=inf"], "tune_max_mb"),
    (["--method", "wfbp:compress=nosuch"], "compress"),
]

BENCH_CASES: list[tuple[list[str], str]] = [
    (["--nproc", "0"], "--nproc"),
    (["--nproc", BIG], "--nproc"),
    (["--iters", "0"], "--iters"),
    (["--warmup", "-1"], "--warmup"),
    (["--batch-size", "0"], "--batch-size"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "inf"], "--timeout"),
    (["--timeout", "0"], "--timeout"),
    (["--epochs", "0"], "--epochs"),
    (["--threads", "0"], "--threads"),
    (["--net", "fast"], "network rate"),
    (["--net", ""], "network rate"),
    (["--net", "0mbit"], "network rate"),
    (["--net", "100mbit,delay=nan"], "delay"),
    (["--net", "100mbit,delay=-1"], "delay"),
    (["--sweep-net", ""], "--sweep-net"),
    (["--methods", ""], "--methods"),
    (["--methods", "magic"], "unknown method"),
    (["--methods", "acpsgd:rank="], "rank"),
    (["--methods", "topk:density=2"], "density"),
    (["--model", "nosuch"], "unknown model"),
    (["--input-shape", "a"], "--input-shape"),
    (["--input-shape", "0,0"], "--input-shape"),
    (["--model-arg", "noeq"], "--model-arg"),
]

SIM_CASES: list[tuple[list[str], str]] = [
    (["simulate", "--profile", PROFILE, "--workers", "0"], "--workers"),
    (["simulate", "--profile", PROFILE, "--workers", ""], "--workers"),
    (["simulate", "--profile", PROFILE, "--workers", "a"], "--workers"),
    (["simulate", "--profile", PROFILE, "--workers", "1e400"], "--workers"),
    (["simulate", "--profile", PROFILE, "--workers", BIG], "--workers"),
    (["simulate", "--profile", PROFILE, "--net", "fast"], "network rate"),
    (["simulate", "--profile", PROFILE, "--net", ""], "--net"),
    (["simulate", "--profile", PROFILE, "--net", "0gbit"], "rate"),
    (["simulate", "--profile", PROFILE, "--net", "10gbit,delay=nan"], "delay"),
    (["simulate", "--profile", PROFILE, "--net", "10gbit,algo=magic"], "magic"),
    (["simulate", "--profile", PROFILE, "--net", "10gbit,gpus_per_node=0"], "gpus_per_node"),
    (["simulate", "--profile", PROFILE, "--methods", ""], "--methods"),
    (["simulate", "--profile", PROFILE, "--methods", "acpsgd:=4"], "unknown option ''"),
    (["simulate", "--profile", PROFILE, "--methods", "topk:density=2"], "density"),
    (["simulate", "--profile", PROFILE, "--bucket-mb", "nan"], "--bucket-mb"),
    (["simulate", "--profile", PROFILE, "--bucket-mb", "0"], "--bucket-mb"),
    (["simulate", "--profile", "/nonexistent/profile.json"], "does not exist"),
    (["simulate"], "--profile"),
    (["advise", "--profile", PROFILE, "--net", "10gbit", "--workers", "0"], "--workers"),
    (["advise", "--profile", PROFILE, "--net", "10gbit", "--workers", BIG], "--workers"),
    (["advise", "--profile", PROFILE, "--net", "10gbit", "--workers", "abc"], "--workers"),
    (["advise", "--profile", PROFILE, "--net", "nan", "--workers", "8"], "nan"),
    (["advise", "--profile", PROFILE, "--net", "10gbit", "--workers", "8", "--bucket-mb", "inf"], "--bucket-mb"),
    (["advise", "--profile", PROFILE, "--net", "10gbit", "--workers", "8", "--methods", "magic"], "magic"),
    (["advise", "--net", "10gbit", "--workers", "8"], "--profile"),
    (["advise", "--model", "mlp", "--net", "10gbit", "--workers", "8", "--device", "tpu"], "--device"),
    (["profile", "--model", "mlp", "--batch-size", "0"], "--batch-size"),
    (["profile", "--model", "mlp", "--iters", "0"], "--iters"),
    (["profile", "--model", "mlp", "--warmup", "-1"], "--warmup"),
]

LOWRANK_CASES: list[tuple[list[str], str]] = [
    ([], "subcommand"),
    (["nosuch"], "nosuch"),
    (["summary"], "--model"),
    (["summary", "--model", "nosuch"], "unknown model"),
    (["summary", "--model", "resnet18", "--rank-ratio", "0"], "--rank-ratio"),
    (["summary", "--model", "resnet18", "--rank-ratio", "nan"], "--rank-ratio"),
    (["summary", "--model", "resnet18", "--rank-ratio", "inf"], "--rank-ratio"),
    (["summary", "--model", "resnet18", "--rank-ratio", "1e400"], "--rank-ratio"),
    (["summary", "--model", "resnet18", "--rank-ratio", "2"], "--rank-ratio"),
    (["summary", "--model", "resnet18", "--full-rank", "("], "("),
    (["summary", "--model", "resnet18", "--model-arg", "noeq"], "--model-arg"),
    (["summary", "--model", "resnet18", "--model-arg", "=1"], "--model-arg"),
    (["summary", "--model", "resnet18", "--model-arg", "num_classes=0"], "num_classes"),
    (["summary", "--model", "resnet18", "--model-arg", "num_classes=-1"], "num_classes"),
]

ALL_CASES = (
    [([*_TRAIN, *a], f) for a, f in TRAIN_CASES]
    + [(["bench", *a], f) for a, f in BENCH_CASES]
    + SIM_CASES
    + [(["lowrank", *a], f) for a, f in LOWRANK_CASES]
    + [(["demo", "--nproc", "0"], "--nproc"), (["demo", "--methods", "magic"], "magic"), (["fly"], "fly")]
)


class WorkStarted(Exception):
    """Raised by the tripwires: validation let a malformed command line through."""


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lowcomm.sim import ComputeCosts, LayerProfile, Profile

    prof = Profile(model="toy", batch_size=32, optimizer_s=2e-3, costs=ComputeCosts(1e-9, 1e-11, 1e-8, 2e-9, 3e-9),
                   layers=[LayerProfile(f"l{i}", 5e-3, 1e-2, [[1024, 1024], [1024]]) for i in range(4)])
    path = tmp_path_factory.mktemp("fuzz") / "toy.json"
    prof.save(path)
    return str(path)


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every entry point that starts training, benchmarking or profiling raises instead, in a
    scratch working directory (default output paths such as ``runs/demo`` land there)."""
    monkeypatch.chdir(tmp_path)
    import lowcomm.bench.harness
    import lowcomm.runtime.train_cli
    import lowcomm.runtime.trainer
    import lowcomm.sim.profiler

    def started(*args: Any, **kwargs: Any) -> Any:
        raise WorkStarted("a malformed command line got past validation and started work")

    monkeypatch.setattr(lowcomm.runtime.train_cli, "launch_workers", started)
    monkeypatch.setattr(lowcomm.runtime.trainer, "run_training", started)
    monkeypatch.setattr(lowcomm.bench.harness, "run_bench", started)
    monkeypatch.setattr(lowcomm.sim.profiler, "profile_model", started)


def _argv(argv: list[str], profile: str) -> list[str]:
    return [profile if a == PROFILE else a for a in argv]


def test_there_are_at_least_fifty_cases() -> None:
    assert len(ALL_CASES) >= 50


@pytest.mark.usefixtures("tripwires")
@pytest.mark.parametrize("argv, fragment", ALL_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_malformed_command_line_is_one_line_and_exit_2(
    argv: list[str], fragment: str, profile_path: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(_argv(argv, profile_path))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("lowcomm: error:") and "Traceback" not in err
    assert fragment in lines[0]
    assert list(tmp_path.iterdir()) == []  # refused before writing anything


# What a user sees: a real process, its stderr as printed.
SUBPROCESS_CASES = [
    [*_TRAIN, "--lr", "nan"],
    [*_TRAIN, "--nproc", "2", "--gamma", "0", "--schedule", "step"],
    [*_TRAIN, "--method", "acpsgd:rank="],
    ["bench", "--timeout", "inf"],
    ["simulate", "--profile", PROFILE, "--net", "0gbit"],
    ["lowrank", "summary", "--model", "resnet18", "--model-arg", "num_classes=0"],
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", SUBPROCESS_CASES, ids=" ".join)
def test_malformed_command_line_in_a_real_process_prints_one_line(argv: list[str], profile_path: str,
                                                                   tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "lowcomm", *_argv(argv, profile_path)], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("lowcomm: error:"), proc.stderr
    assert proc.stdout == ""

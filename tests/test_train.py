"""End-to-end `lowcomm train`: summary keys, exact resume, clear refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowcomm.cli import main
from lowcomm.runtime import checkpoint
from lowcomm.runtime.records import rank_log_path

FAST = ["--model", "mlp", "--data", "mnist1d", "--nproc", "2", "--batch-size", "128", "--lr", "0.05",
        "--threads", "1", "--quiet", "--no-progress"]


def _final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    manifest = checkpoint.latest(str(ckpt_dir))
    assert manifest is not None
    return checkpoint.load_rank(str(ckpt_dir), manifest["step"], 0)["model"]


def test_train_writes_documented_summary_keys(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = [*FAST, "--model", "cnn1d", "--batch-size", "64", "--epochs", "2", "--json", str(out)]
    assert main(["train", *argv]) == 0
    s = json.loads(out.read_text())
    for key in ("method", "world_size", "model", "data", "epochs", "final_test_accuracy", "params",
                "bytes_sent_per_worker", "iter_time_s_median", "breakdown_s"):
        assert key in s, key
    assert s["world_size"] == 2 and s["method"] == "ssgd"
    assert s["final_test_accuracy"] > 0.2  # 10 classes: chance is 0.1
    params_bytes = 4 * s["params"]
    # ssgd: one ring all-reduce of every gradient per step: 2 (P-1)/P * bytes = bytes for P = 2
    assert s["bytes_per_worker_per_iter"] == params_bytes
    assert set(s["breakdown_s"]) >= {"data", "forward", "backward", "comm_wait", "compress", "optimizer"}


def test_log_all_ranks_gives_every_rank_its_own_step_records(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    assert main(["train", *FAST, "--steps", "3", "--no-eval", "--log", str(log), "--log-all-ranks"]) == 0
    for path in (log, tmp_path / "steps.rank1.jsonl"):  # rank 0 where a reader of its log looks
        steps = [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"]
        assert [r["step"] for r in steps] == [1, 2, 3] and all(r["iter_time_s"] > 0 for r in steps)
    assert rank_log_path("a/b.jsonl", 0) == "a/b.jsonl" and rank_log_path("a/b", 3) == "a/b.rank3"


def test_interrupted_and_resumed_run_matches_uninterrupted_run(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*FAST, "--epochs", "2"]
    assert main(["train", *common, "--checkpoint-dir", str(straight)]) == 0
    # 16 steps per epoch: stop at step 20, inside epoch 2, then resume to the end.
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--stop-after-steps", "20"]) == 0
    assert checkpoint.latest(str(resumed))["step"] == 20
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    a, b = _final_weights(straight), _final_weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(("method", "stop"), [("ssgd", 5), ("powersgd:start_iter=2", 5), ("ssgd", 1)])
def test_four_rank_run_resumed_after_ddp_rebuilt_its_buckets_matches_bit_for_bit(tmp_path: Path, method: str,
                                                                                   stop: int) -> None:
    # DDP syncs a resumed run's first step in its initial bucket layout (parameter order) where
    # the straight run used the rebuilt one (backward order); a ring over 4 ranks then adds in
    # another order unless the hook replays the recorded layout (lowcomm.comm.hooks.replay).
    # Small buckets: several of them, so the replay splits DDP's single initial bucket. Stopped
    # after step 1, DDP has not rebuilt yet: the layout recorded is the one it is about to build.
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*FAST, "--nproc", "4", "--batch-size", "64", "--epochs", "1", "--bucket-cap-mb", "0.02",
              "--method", method]
    assert main(["train", *common, "--checkpoint-dir", str(straight)]) == 0
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--stop-after-steps", str(stop)]) == 0
    layout = checkpoint.load_rank(str(resumed), stop, 0)["method"]["ddp_buckets"]
    assert len(layout) > 1 and layout[0][0].startswith("fc.")  # rebuilt: the last layer first
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    a, b = _final_weights(straight), _final_weights(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_fp16_amp_run_resumes_exactly_with_its_loss_scale(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*FAST, "--epochs", "2", "--amp", "fp16"]
    assert main(["train", *common, "--checkpoint-dir", str(straight)]) == 0
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--stop-after-steps", "20"]) == 0
    saved = checkpoint.load_rank(str(resumed), 20, 1)["scaler"]
    assert saved is not None and saved["scale"] > 0  # the GradScaler's state is checkpointed
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    a, b = _final_weights(straight), _final_weights(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nosuchnet"], "unknown model 'nosuchnet'"),
        (["--data", "imagenet22k"], "unknown dataset"),
        (["--method", "magic"], "unknown method 'magic'"),
        (["--nproc", "0"], "--nproc must be an integer from 1"),
        (["--batch-size", "0"], "--batch-size must be an integer from 1"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--log-all-ranks"], "--log-all-ranks needs --log FILE"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_unknown_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fly"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_runs_the_benchmark_on_embedded_data(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    argv = ["demo", "--nproc", "2", "--epochs", "1", "--methods", "ssgd", "--net", "none", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "demo.json").read_text())
    (row,) = [r for r in result["runs"] if r["method"] == "ssgd"]
    assert row["status"] == "ok" and row["final_test_accuracy"] > 0.1
    assert (out / "demo.png").exists()


def test_bad_data_dir_with_several_workers_is_one_line_and_exit_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--nproc", "2", "--data", "cifar10", "--data-dir", str(tmp_path / "missing"), "--quiet"]
    assert main(argv) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "cifar10: expected cifar-10-batches-py" in err[0]

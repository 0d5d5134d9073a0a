"""The federated engine: rounds over real gloo ranks, one reduce per round, plans that change
times but not results, exact resume with client state on disk, and a dead worker named.

Small on purpose (a 40-16-16-10 MLP, 5000 MNIST-1D samples, a few rounds): the behaviour is
the same at 1000 clients, which ``benchmarks/fl_vs_flower.py`` measures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lowcomm.comm import accounting
from lowcomm.fl.config import FLConfig
from lowcomm.fl.runner import run_fl
from lowcomm.testing import run_distributed
from lowcomm.testing.faults import run_and_kill

# float32 sums of a few hundred terms added in another order: a few ulps of the result
SUM_ORDER_RTOL = 1e-5


def _cfg(tmp: Path | None = None, **kw: Any) -> FLConfig:
    base: dict[str, Any] = dict(clients=24, per_round=8, nproc=2, algorithm="fedavg", model="mlp",
                                model_args={"hidden": 16}, partition="iid", rounds=3, batch_size=8,
                                lr=0.1, quiet=True, samples_per_client=40, threads=1)
    base.update(kw)
    cfg = FLConfig(**base)
    if tmp is not None and cfg.checkpoint_dir is None:
        cfg.checkpoint_dir = str(tmp / "ckpt")
    cfg.validate()
    return cfg


def _play(cfg: FLConfig) -> dict[str, Any] | None:
    summary = run_fl(cfg)
    if summary is None:
        return None
    summary["ledger"] = accounting.ledger().as_dict()
    return summary


def _final_global(ckpt_dir: str) -> torch.Tensor:
    from lowcomm.runtime import checkpoint

    manifest = checkpoint.latest(ckpt_dir)
    assert manifest is not None
    return checkpoint.load_rank(ckpt_dir, manifest["step"], 0)["global"]


def test_fedavg_learns_and_one_reduce_per_round_carries_the_sums(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, rounds=4)
    summary, other = run_distributed(_play, 2, cfg)
    assert other is None
    accs = [h["test_accuracy"] for h in summary["history"]]
    assert len(accs) == 4 and accs[-1] > 0.2  # 10 classes: chance is 0.1
    ledger = summary["ledger"]["by_tag"]
    assert ledger["fl.aggregate"]["calls"] == 4 and ledger["fl.model"]["calls"] == 4
    n = summary["params"]
    # fedavg's contribution: the weighted delta (n floats) and the weight (1 float)
    assert ledger["fl.aggregate"]["payload_bytes"] == 4 * 4 * (n + 1)
    # per round, averaged over the 2 workers: rank 0 broadcasts the plan (8 int64) and the
    # model (n floats) and receives the reduce (sends (P-1)/P of it), rank 1 sends the whole
    # reduce; both all-gather their timing rows (3 + 2 * 8 float64)
    rank0 = 8 * 8 + 4 * n + 4 * (n + 1) // 2 + 8 * 19
    rank1 = 4 * (n + 1) + 8 * 19
    assert summary["history"][0]["bytes_per_worker"] == (rank0 + rank1) / 2
    assert summary["partition_stats"]["size_min"] >= 1
    assert {"round", "round_time_s", "plan", "bytes_per_worker", "elapsed_s"} <= set(summary["history"][0])


def test_one_worker_and_two_workers_reach_the_same_model(tmp_path: Path) -> None:
    one = _cfg(tmp_path / "a", nproc=1)
    two = _cfg(tmp_path / "b", nproc=2)
    run_distributed(_play, 1, one)
    run_distributed(_play, 2, two)
    a, b = _final_global(one.checkpoint_dir or ""), _final_global(two.checkpoint_dir or "")
    torch.testing.assert_close(a, b, rtol=SUM_ORDER_RTOL, atol=1e-6)


def test_slowdown_and_plans_change_times_not_results(tmp_path: Path) -> None:
    even = _cfg(tmp_path / "even", schedule="even")
    fitted = _cfg(tmp_path / "fit", schedule="fitted", warmup_rounds=1, slowdown=[1.0, 2.0])
    s_even, _ = run_distributed(_play, 2, even)
    s_fit, _ = run_distributed(_play, 2, fitted)
    assert [h["plan"]["kind"] for h in s_fit["history"]] == ["even", "fitted", "fitted"]
    assert s_fit["history"][-1]["predicted_makespan_s"] is not None
    torch.testing.assert_close(_final_global(even.checkpoint_dir or ""), _final_global(fitted.checkpoint_dir or ""),
                               rtol=SUM_ORDER_RTOL, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn", "fedopt:server=adam"])
def test_resume_continues_exactly_with_client_state_on_disk(tmp_path: Path, algorithm: str) -> None:
    # the even split: a fitted plan follows measured times, and another placement sums the
    # clients in another order (equal up to rounding only, see the slowdown test)
    straight = _cfg(tmp_path / "straight", algorithm=algorithm, rounds=4, per_round=12, schedule="even")
    run_distributed(_play, 2, straight)
    split = _cfg(tmp_path / "split", algorithm=algorithm, rounds=4, per_round=12, stop_after_rounds=2,
                 schedule="even")
    first, _ = run_distributed(_play, 2, split)
    assert first["rounds"] == 2
    split.stop_after_rounds = None
    split.resume = True
    second, _ = run_distributed(_play, 2, split)
    assert second["rounds"] == 4
    assert torch.equal(_final_global(straight.checkpoint_dir or ""), _final_global(split.checkpoint_dir or ""))
    straight_hist = json.loads(json.dumps(first["history"][:2]))
    assert [h["test_accuracy"] for h in second["history"][:2]] == [h["test_accuracy"] for h in straight_hist]


def test_resume_refuses_another_experiment(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, rounds=1)
    run_distributed(_play, 1, _cfg(tmp_path, rounds=1, nproc=1))
    other = _cfg(tmp_path, rounds=2, nproc=1, lr=0.2, resume=True, checkpoint_dir=cfg.checkpoint_dir)
    from lowcomm.errors import UsageError

    with pytest.raises(UsageError, match="--lr"):
        run_fl(other)


def test_cross_silo_trains_one_client_per_worker(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, clients=2, per_round=2, cross_silo=True, rounds=2)
    summary, _ = run_distributed(_play, 2, cfg)
    assert [h["plan"]["clients_per_worker"] for h in summary["history"]] == [[1, 1], [1, 1]]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lowcomm", "fl", *args], capture_output=True, text=True,
                          timeout=timeout)


SMALL = ["--clients", "24", "--per-round", "8", "--model-arg", "hidden=16", "--partition", "iid",
         "--batch-size", "8", "--lr", "0.1", "--samples-per-client", "40"]


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_cli_writes_the_summary_with_the_memory_of_all_processes(tmp_path: Path, start: str) -> None:
    out = tmp_path / "fl.json"
    plot = tmp_path / "fl.png"
    r = _cli(*SMALL, "--nproc", "2", "--rounds", "2", "--json", str(out), "--plot", str(plot), "--no-progress",
             "--start", start)
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["command"] == "fl" and s["world_size"] == 2 and len(s["history"]) == 2
    assert s["peak_memory"]["processes"] >= 3  # the launcher and two workers
    assert s["peak_memory"]["pss_bytes"] > 0 and s["peak_memory"]["rss_bytes"] >= s["peak_memory"]["pss_bytes"]
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("args, words", [
    (["--per-round", "30"], "--per-round 30 is more than --clients 24"),
    (["--slowdown", "1,2,3"], "one factor >= 1 per worker"),
    (["--algorithm", "fedsgd"], "fedavg"),
    (["--partition", "dirichlet:beta=1"], "alpha"),
    (["--resume"], "--checkpoint-dir"),
])
def test_cli_misuse_is_one_line_and_exit_2(args: list[str], words: str) -> None:
    r = _cli(*SMALL, "--nproc", "2", "--rounds", "1", *args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")
def test_a_worker_killed_mid_run_stops_the_run_and_resume_finishes_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*SMALL, "--rounds", "30", "--eval-every", "10", "--checkpoint-dir", str(ckpt),
            "--algorithm", "scaffold", "--quiet"]
    result = run_and_kill(args, nproc=2, rank=1, log_path=tmp_path / "log.jsonl", after_steps=2,
                          command=("fl",), event="round")
    assert result.returncode not in (0, None), result.stderr  # None: still running at the hang guard
    assert "worker rank 1" in result.stderr
    assert not result.leftover_pids
    out = tmp_path / "fl.json"
    r = _cli(*args, "--nproc", "2", "--resume", "--json", str(out))
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert [h["round"] for h in s["history"]] == list(range(30))


def _run_on_two_machines(cfg: FLConfig) -> str:
    import os

    from lowcomm.errors import UsageError

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # torchrun's view of 2 machines with 1 worker each
    try:
        run_fl(cfg)
    except UsageError as e:
        return str(e)
    return "ran"


def test_client_state_across_machines_needs_a_shared_state_dir(tmp_path: Path) -> None:
    # a client moves between machines from round to round: its state must be where all see it
    cfg = _cfg(None, algorithm="scaffold", rounds=1)
    messages = run_distributed(_run_on_two_machines, 2, cfg)
    assert all("--state-dir" in m for m in messages)
    shared = _cfg(None, algorithm="scaffold", rounds=1, state_dir=str(tmp_path / "shared"))
    assert run_distributed(_run_on_two_machines, 2, shared) == ["ran", "ran"]

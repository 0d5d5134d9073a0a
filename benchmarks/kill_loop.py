"""SIGKILL one worker of ``lowcomm train --nproc N`` mid-training, many times: no run may hang.

Usage: python benchmarks/kill_loop.py [--kills 10] [--nproc 2] [--hang-guard 60] [--json out.json]

Each repetition starts MLP training on MNIST-1D with a checkpoint every step, waits until
rank 0's JSONL log holds ``--after-steps`` step records (never a sleep), SIGKILLs one worker
(ranks taken in turn, rank 0 included: it logs and commits checkpoints) and waits at most
``--hang-guard`` seconds for the command to exit. Then it resumes from the checkpoint for a
few steps, to check that what the kill left is loadable.

Prints one JSON document: kills, hangs, non-zero exits, how often the killed rank was the one
named, resumes that succeeded, and the seconds from kill to exit (max and each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lowcomm.runtime import checkpoint
from lowcomm.testing.faults import run_and_kill, step_records

TRAIN = ["--model", "mlp", "--data", "mnist1d", "--batch-size", "32", "--lr", "0.05", "--schedule", "constant",
         "--threads", "1", "--quiet", "--no-progress", "--no-eval"]


def one(work: Path, nproc: int, rank: int, after_steps: int, hang_guard_s: float) -> dict[str, Any]:
    """Kill worker ``rank`` once, then resume 4 steps; return what happened."""
    ck = work / "ck"
    r = run_and_kill([*TRAIN, "--steps", "1000000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1"],
                     nproc=nproc, rank=rank, log_path=work / "killed.jsonl", after_steps=after_steps,
                     hang_guard_s=hang_guard_s)
    row: dict[str, Any] = {"rank": rank, "returncode": r.returncode, "exit_s": r.exit_s, "hung": r.hung,
                              "rank_named": r.rank_named, "leftover_workers": len(r.leftover_pids)}
    manifest = checkpoint.latest(str(ck))
    row["manifest_step"] = manifest["step"] if manifest else None
    if manifest:
        log = work / "resumed.jsonl"
        cmd = [sys.executable, "-m", "lowcomm", "train", "--nproc", str(nproc), *TRAIN,
               "--steps", str(manifest["step"] + 4), "--checkpoint-dir", str(ck), "--resume", "--log", str(log)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        steps = [s["step"] for s in step_records(log)]
        row["resumed_ok"] = done.returncode == 0 and steps == [manifest["step"] + i for i in range(1, 5)]
        if not row["resumed_ok"]:
            row["resume_stderr_tail"] = done.stderr[-500:]
    if not r.rank_named or r.hung:
        row["stderr_tail"] = r.stderr[-500:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--after-steps", type=int, default=10, help="logged steps before the kill")
    ap.add_argument("--hang-guard", type=float, default=60.0, help="seconds from kill to exit counted as a hang")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for i in range(args.kills):
        with tempfile.TemporaryDirectory(prefix="lowcomm-kill-") as tmp:
            rows.append(one(Path(tmp), args.nproc, i % args.nproc, args.after_steps, args.hang_guard))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    exits = [r["exit_s"] for r in rows if r["exit_s"] is not None]
    result = {
        "kills": len(rows),
        "hangs": sum(bool(r["hung"]) for r in rows),
        "nonzero_exits": sum(r["returncode"] not in (0, None) for r in rows),
        "killed_rank_named": sum(bool(r["rank_named"]) for r in rows),
        "leftover_workers": sum(r["leftover_workers"] for r in rows),
        "resumed_ok": sum(bool(r.get("resumed_ok")) for r in rows),
        "max_exit_s": round(max(exits), 2) if exits else None,
        "exit_s": [round(e, 2) for e in exits],
        "nproc": args.nproc,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": platform.python_version()},
        "runs": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    # the requirement: every kill ends the command (non-zero, the rank named, no worker left)
    # within the guard (60 s by default), and every run resumes from its last checkpoint
    n = len(rows)
    met = (result["hangs"] == 0 and result["nonzero_exits"] == n and result["killed_rank_named"] == n
           and result["leftover_workers"] == 0 and result["resumed_ok"] == n)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())

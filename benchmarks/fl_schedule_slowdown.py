"""The fitted scheduler against the even split on emulated heterogeneous workers (issue 15).

Why: the issue's target is that with ``--slowdown 1,3`` (worker 1 three times slower) the
fitted scheduler's round time is >= 1.3x better than the even split's. It is a timing, so no
unit test can check it; this script runs ``lowcomm fl`` twice with everything equal but
``--schedule`` (``even``, then ``fitted``) and compares the median round time over the rounds
after the warm-up (both policies split evenly during the warm-up, so those rounds say
nothing). Round time is the engine's ``round_time_s`` (plan, broadcast, local training,
reduce, timings); the test evaluation is not in it, and is run only after the last round.

Expected: an even split waits for the slow worker, ``3 x W/2 = 1.5 W`` (W: the fast
worker's time for all clients); longest job first gives the fast worker ~3/4 of the work,
``0.75 W``: about 2x on training time, less the fixed per-round costs.

    .venv/bin/python benchmarks/fl_schedule_slowdown.py                      # the issue's setup
    .venv/bin/python benchmarks/fl_schedule_slowdown.py --clients 40 --per-round 20 --rounds 4 \\
        --out /tmp/smoke.json                                                 # smoke run

Run it alone on the machine: other processes on the cores distort the times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: machine, git commit)

REPO = acc.REPO
RESULTS = REPO / "benchmarks" / "results" / "fl_schedule_slowdown.json"
TARGET = 1.3
POLICIES = ("even", "fitted")
TIMING_KEYS = ("round", "round_time_s", "train_makespan_s", "predicted_makespan_s", "plan")


def command(args: argparse.Namespace, policy: str, json_path: Path) -> list[str]:
    """``lowcomm fl`` with the given policy, everything else from ``args``."""
    return [sys.executable, "-m", "lowcomm", "fl", "--clients", str(args.clients),
            "--per-round", str(args.per_round), "--nproc", str(args.nproc), "--algorithm", "fedavg",
            "--model", "mlp", "--model-arg", f"hidden={args.hidden}", "--data", "mnist1d",
            "--samples-per-client", str(args.samples_per_client), "--partition", args.partition,
            "--rounds", str(args.rounds), "--local-epochs", str(args.local_epochs),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
            "--slowdown", args.slowdown, "--schedule", policy, "--warmup-rounds", str(args.warmup_rounds),
            "--eval-every", str(args.rounds), "--threads", "1", "--quiet", "--json", str(json_path)]


def run(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """One run; its summary with the history cut to the timing keys."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fl.json"
        cmd = command(args, policy, out)
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{policy} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads(out.read_text())
    summary["history"] = [{k: h.get(k) for k in TIMING_KEYS} for h in summary["history"]]
    return summary


def after_warmup(summary: dict[str, Any], warmup: int, key: str) -> list[float]:
    """``key`` of the rounds after the warm-up."""
    return [float(h[key]) for h in summary["history"][warmup:] if h.get(key) is not None]


def compare(runs: dict[str, dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median round and training times after the warm-up, the speed-up, the prediction error."""
    med = {p: statistics.median(after_warmup(runs[p], warmup, "round_time_s")) for p in POLICIES}
    train = {p: statistics.median(after_warmup(runs[p], warmup, "train_makespan_s")) for p in POLICIES}
    fitted = runs["fitted"]["history"][warmup:]
    errors = [abs(h["predicted_makespan_s"] - h["train_makespan_s"]) / h["train_makespan_s"]
              for h in fitted if h.get("predicted_makespan_s") is not None and h["train_makespan_s"] > 0]
    speedup = med["even"] / med["fitted"]
    return {"round_time_s_median": med, "train_makespan_s_median": train, "speedup": speedup,
            "train_speedup": train["even"] / train["fitted"],
            "prediction_rel_error_median": statistics.median(errors) if errors else None,
            "target": TARGET, "met": speedup >= TARGET}


def markdown(doc: dict[str, Any]) -> str:
    """One paragraph for docs/fl.md."""
    c, s = doc["comparison"], doc["setup"]
    m = doc["machine"]
    err = c["prediction_rel_error_median"]
    return (f"`--slowdown {s['slowdown']}`, {s['per_round']} of {s['clients']} clients per round on "
            f"{s['nproc']} workers, median over rounds {s['warmup_rounds'] + 1}-{s['rounds']}: even split "
            f"{c['round_time_s_median']['even']:.3f} s per round, fitted "
            f"{c['round_time_s_median']['fitted']:.3f} s: **{c['speedup']:.2f}x** (target {TARGET}x: "
            f"{'met' if c['met'] else 'NOT met'}; training makespan {c['train_speedup']:.2f}x"
            + (f", predicted makespan within {100 * err:.0f} % (median)" if err is not None else "")
            + f"). Machine: {m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores; commit "
            f"{acc.short_commit(doc.get('git_commit'))}.")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=1000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--slowdown", default="1,3")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--samples-per-client", type=int, default=40)
    p.add_argument("--partition", default="dirichlet:alpha=0.5")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.rounds <= args.warmup_rounds:
        p.error("--rounds must exceed --warmup-rounds (the comparison uses the rounds after it)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both policies, write the JSON, print the paragraph; exit 1 if the target is missed."""
    args = _args(argv)
    runs = {p: run(args, p) for p in POLICIES}
    comparison = compare(runs, args.warmup_rounds)
    doc = {"setup": {k: v for k, v in vars(args).items() if k != "out"}, "machine": acc.machine(),
           "git_commit": acc._git_commit(), "comparison": comparison, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(markdown(doc))
    return 0 if comparison["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Large batch: LARS at global batch 4096 against SGD at batch 128 on MNIST-1D, same epochs.

Why: issue 14's target is "LARS at batch 4096 within 1.5 points of SGD at batch 128 on MNIST-1D,
same epochs". MNIST-1D is generated with 75,000 samples (``--data-arg num_samples=75000``:
60,000 training and 15,000 test sequences, the mnist1d package's 80/20 split), so that batch
4096 still gives 14 steps per epoch. Both rows train ``cnn1d`` for the same number of epochs
with ``lowcomm train`` (every row's full command is recorded with its result):

* ``sgd-b128``: the trainer's SGD recipe (lr 0.1, momentum 0.9, weight decay 5e-4, cosine);
* ``lars-b4096``: ``--optimizer lars`` (trust coefficient ``--lars-eta``), lr ``--lars-lr``,
  linear warm-up over ``--warmup-epochs`` then polynomial decay (power 2), the norm and bias
  parameters without trust ratio and decay; 32x fewer steps;
* ``sgd-b4096`` (control, not part of the target): plain SGD at batch 4096 with the linear
  scaling rule (lr 0.1 * 32 = 3.2) and the same warm-up + poly: what LARS adds over it.

World size: one worker (``--nproc 1``) holding the whole global batch. With ssgd the update of P
workers at 4096/P each is the same average gradient (up to summation order), and on a 2-core
machine one process is the only way to keep the runs short; ``--nproc`` changes it.

Results: ``benchmarks/results/largebatch.json`` (each run saved as it ends; runs already there
are skipped unless ``--force``); the table goes into ``docs/largebatch.md`` between
``<!-- largebatch:begin -->`` and ``<!-- largebatch:end -->``; ``--table-only`` re-renders it.
The first run generates and caches the 75k-sample data set (minutes; later runs reuse it).

    .venv/bin/python benchmarks/largebatch.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: result file, doc block, machine helpers)

REPO = acc.REPO
RESULTS = REPO / "benchmarks" / "results" / "largebatch.json"
DOC = REPO / "docs" / "largebatch.md"
BLOCK = "largebatch"
TARGET_POINTS = 1.5  # LARS at 4096 within 1.5 points of SGD at 128
ROWS = ("sgd-b128", "lars-b4096", "sgd-b4096")
NUM_SAMPLES = 75000


def row_args(row: str, args: argparse.Namespace) -> list[str]:
    """The ``lowcomm train`` options that make ``row`` (the rest is common to both rows)."""
    if row == "sgd-b128":
        return ["--batch-size", str(128 // args.nproc), "--optimizer", "sgd", "--lr", "0.1", "--schedule", "cosine"]
    if row == "sgd-b4096":  # the control: linear scaling (0.1 * 4096 / 128) and the same warm-up + poly
        return ["--batch-size", str(4096 // args.nproc), "--optimizer", "sgd", "--lr", "3.2", "--schedule", "poly",
                "--poly-power", "2", "--lr-warmup-epochs", f"{args.warmup_epochs:g}"]
    return ["--batch-size", str(4096 // args.nproc), "--optimizer", f"lars:eta={args.lars_eta:g}",
            "--lr", f"{args.lars_lr:g}", "--schedule", "poly", "--poly-power", "2",
            "--lr-warmup-epochs", f"{args.warmup_epochs:g}"]


def command(row: str, seed: int, args: argparse.Namespace) -> list[str]:
    """The user's command line of one run (without ``--json``)."""
    return ["lowcomm", "train", "--nproc", str(args.nproc), "--model", args.model, "--data", "mnist1d",
            "--data-arg", f"num_samples={NUM_SAMPLES}", "--epochs", str(args.epochs), "--seed", str(seed),
            "--momentum", "0.9", "--weight-decay", "5e-4", *row_args(row, args), "--quiet", "--no-progress"]


def run_one(row: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train once; the record (status ``failed`` with the error's tail if it did not finish)."""
    cmd = command(row, seed, args)
    rec: dict[str, Any] = {"row": row, "seed": seed, "command": " ".join(cmd), "machine": acc.machine(),
                           "git_commit": acc._git_commit()}
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "lowcomm", *cmd[1:], "--json", str(summary)],
                              capture_output=True, text=True, cwd=REPO, timeout=args.timeout)
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0 or not summary.exists():
            rec.update(status="failed", error=(proc.stderr or proc.stdout)[-2000:])
            return rec
        s = json.loads(summary.read_text())
    rec.update(status="ok", final_test_accuracy=s["final_test_accuracy"], steps=s.get("steps"),
               epochs=s.get("epochs"), history=[h.get("test_accuracy") for h in s.get("history", [])])
    return rec


def render(doc: dict[str, Any]) -> str:
    """The Markdown block: per row the accuracy of each seed, the mean, and the target."""
    runs = [r for r in doc.get("runs", {}).values() if r.get("status") == "ok"]
    if not runs:
        return "_No result recorded yet: run `python benchmarks/largebatch.py`._"
    acc_of: dict[str, dict[int, float]] = {}
    for r in runs:
        acc_of.setdefault(r["row"], {})[r["seed"]] = 100 * r["final_test_accuracy"]
    means = {row: statistics.mean(v.values()) for row, v in acc_of.items()}
    lines = ["| row | command (options that differ) | test accuracy per seed (%) | mean (%) | vs SGD b128 |",
             "|---|---|---|---:|---:|"]
    cmds = {r["row"]: r["command"] for r in runs}
    for row in ROWS:
        if row not in acc_of:
            continue
        seeds = ", ".join(f"{acc_of[row][s]:.2f} (seed {s})" for s in sorted(acc_of[row]))
        diff = means[row] - means["sgd-b128"] if "sgd-b128" in means else None
        opts = _differing(cmds[row])
        lines.append(f"| {row} | `{opts}` | {seeds} | {means[row]:.2f} | "
                     f"{'' if diff is None else f'{diff:+.2f} points'} |")
    if "sgd-b128" in means and "lars-b4096" in means:
        gap = means["sgd-b128"] - means["lars-b4096"]
        shared = sorted(set(acc_of["sgd-b128"]) & set(acc_of["lars-b4096"]))
        verdict = "met" if gap <= TARGET_POINTS else "**not met**"
        lines += ["", f"Target (LARS at 4096 within {TARGET_POINTS} points of SGD at 128, same epochs): "
                      f"{verdict} -- gap {gap:+.2f} points over the mean of {len(shared)} seed(s)."]
    some = runs[0]
    m = some.get("machine", {})
    lines += ["", f"Common: `{_common(some['command'])}`. Machine: {m.get('cpu')} ({m.get('cpu_count')} cores), "
                  f"torch {m.get('torch')}, commit {acc.short_commit(some.get('git_commit'))}; "
                  f"wall time per run: " + ", ".join(f"{r['row']} seed {r['seed']} {r['wall_s']:.0f} s"
                                                     for r in sorted(runs, key=lambda r: (r['row'], r['seed']))) + "."]
    return "\n".join(lines)


_ROW_FLAGS = ("--batch-size", "--optimizer", "--lr", "--schedule", "--poly-power", "--lr-warmup-epochs")


def _differing(cmd: str) -> str:
    words = cmd.split()
    out = []
    for i, w in enumerate(words):
        if w in _ROW_FLAGS and i + 1 < len(words):
            out += [w, words[i + 1]]
    return " ".join(out)


def _common(cmd: str) -> str:
    words = cmd.split()
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in _ROW_FLAGS or w == "--seed":
            skip = True
            continue
        out.append(w)
    return " ".join(out)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--model", default="cnn1d")
    ap.add_argument("--nproc", type=int, default=1, help="workers (the global batches are divided among them)")
    ap.add_argument("--lars-lr", type=float, default=4.0)
    ap.add_argument("--lars-eta", type=float, default=0.02)
    ap.add_argument("--warmup-epochs", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--force", action="store_true", help="re-run runs already in --out")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    args = ap.parse_args(argv)
    if args.nproc < 1 or 128 % args.nproc:
        ap.error("--nproc must divide 128 (the small batch)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    doc: dict[str, Any] = acc.load(args.out) if args.out.exists() else {}
    doc.setdefault("benchmark", "largebatch")
    doc.setdefault("runs", {})
    if not args.table_only:
        for seed in args.seeds:
            for row in args.rows:
                key = f"{row}/{seed}"
                if key in doc["runs"] and doc["runs"][key].get("status") == "ok" and not args.force:
                    continue
                rec = run_one(row, seed, args)
                print(f"{key}: {rec.get('status')} {rec.get('final_test_accuracy')} ({rec['wall_s']} s)",
                      file=sys.stderr, flush=True)
                doc["runs"][key] = rec
                acc.save(args.out, doc)
    body = render(doc)
    acc.write_doc(args.doc, BLOCK, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

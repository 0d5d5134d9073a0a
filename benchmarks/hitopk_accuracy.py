"""hitopk against topk, gtopk and ssgd on MNIST-1D: accuracy and inter-node bytes (issue 14).

Why this exists: hierarchical top-k sends ``1/G`` of topk's bytes across nodes, but it keeps
``k`` values per shard of each *node's* sum instead of per worker, so its convergence may
differ from topk's; the issue asks for the accuracy next to the bytes. Every run is what a
user types on an emulated cluster of 2 nodes of 2 workers (the launcher sets torchrun's
``LOCAL_WORLD_SIZE=2``; the accounting layer splits the counted bytes by link)::

    lowcomm train --nproc 4 --gpus-per-node 2 --model cnn1d --data mnist1d --epochs 15 \\
        --seed S --method M --quiet --no-progress --json FILE

with the trainer's defaults for everything else. Accuracy and counted bytes are
deterministic (no timing is recorded here; the time per iteration is
``benchmarks/hitopk_bench.py``'s, on the shaped network).

Each run is stored in ``benchmarks/results/hitopk_accuracy.json`` under ``method/seed`` as
soon as it ends (atomic write); runs already there with the same command are skipped, a
failed one is retried. ``--table-only`` re-renders the block between
``<!-- hitopk-acc:begin -->`` and ``<!-- hitopk-acc:end -->`` in ``docs/hierarchical.md``.

Usage (from the repository root)::

    .venv/bin/python benchmarks/hitopk_accuracy.py                  # 4 methods x 3 seeds
    .venv/bin/python benchmarks/hitopk_accuracy.py --seeds 0 --methods hitopk topk
    .venv/bin/python benchmarks/hitopk_accuracy.py --table-only

The bookkeeping (machine, atomic save, doc block) is ``benchmarks/accuracy.py``'s.
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
import accuracy as acc  # noqa: E402  (the sibling script: machine, result file, doc block)

RESULTS = acc.REPO / "benchmarks" / "results" / "hitopk_accuracy.json"
DOC = acc.REPO / "docs" / "hierarchical.md"
BLOCK = "hitopk-acc"
METHODS = ("ssgd", "topk", "gtopk", "hitopk")
SEEDS = (0, 1, 2)
EPOCHS = 15
NPROC, GPUS_PER_NODE = 4, 2
MODEL, DATA = "cnn1d", "mnist1d"


def run_key(method: str, seed: int) -> str:
    """The JSON key of one run."""
    return f"{method}/{seed}"


def train_command(method: str, seed: int, summary: Path, epochs: int = EPOCHS) -> list[str]:
    """The user's command line."""
    return [sys.executable, "-m", "lowcomm", "train", "--nproc", str(NPROC), "--gpus-per-node", str(GPUS_PER_NODE),
            "--model", MODEL, "--data", DATA, "--epochs", str(epochs), "--seed", str(seed), "--method", method,
            "--quiet", "--no-progress", "--json", str(summary)]


def shown_command(cmd: list[str]) -> str:
    """What the user types (``lowcomm train ...``), the summary file named ``FILE``."""
    return " ".join(["lowcomm", *cmd[3:-1], "FILE"])


def parse_run(summary: dict[str, Any], stderr: str) -> dict[str, Any]:
    """One run's record: accuracy per epoch and the counted bytes per worker and iteration."""
    traffic = summary.get("traffic", {})
    return {
        "status": "ok",
        "final_test_accuracy": summary["final_test_accuracy"],
        "accuracy_by_epoch": [h["test_accuracy"] for h in summary.get("history", []) if "test_accuracy" in h],
        "bytes_per_worker_per_iter": summary["bytes_per_worker_per_iter"],
        "inter_node_bytes_per_worker_per_iter": summary.get("inter_node_bytes_per_worker_per_iter"),
        "inter_wire_bytes_total": traffic.get("inter_wire_bytes"),
        "wire_bytes_total": summary["bytes_sent_per_worker"],
        "gpus_per_node": summary.get("gpus_per_node"),
        "steps": summary["steps"],
        "params": summary["params"],
        "optimizer": summary.get("optimizer"),
        "method_info": summary.get("method_info", {}),
        "notices": acc.notices(stderr),
    }


def run_one(method: str, seed: int, work: Path, epochs: int = EPOCHS) -> dict[str, Any]:
    """Train once; the record (status ``failed`` with the error's tail if it did not finish)."""
    summary = work / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = train_command(method, seed, summary, epochs)
    env = {"command": shown_command(cmd), "machine": acc.machine(), "git_commit": acc._git_commit()}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=acc.REPO, capture_output=True, text=True)
    wall = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0 or not summary.exists():
        return {"status": "failed", "error": proc.stderr[-2000:], "returncode": proc.returncode,
                "wall_s": wall, **env}
    return {**parse_run(json.loads(summary.read_text()), proc.stderr), "wall_s": wall, **env}


def load(path: Path) -> dict[str, Any]:
    """The result document (an empty one when the file does not exist yet)."""
    if path.exists():
        return acc.load(path)
    return {"benchmark": "hitopk_accuracy", "recipe": "lowcomm train defaults on 2 nodes x 2 workers; "
            "see benchmarks/hitopk_accuracy.py", "runs": {}}


def plan(doc: dict[str, Any], methods: list[str], seeds: list[int], epochs: int = EPOCHS) -> list[tuple[str, int]]:
    """The runs still missing, failed, or measured with another command (seed-major)."""
    todo = []
    for seed in seeds:
        for m in methods:
            r = doc["runs"].get(run_key(m, seed), {})
            if r.get("status") != "ok" or r.get("command") != shown_command(train_command(m, seed, Path("F"), epochs)):
                todo.append((m, seed))
    return todo


# --- rendering -------------------------------------------------------------------------------
def _ok(runs: dict[str, Any], method: str) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for key, r in runs.items():
        m, seed = key.rsplit("/", 1)
        if m == method and r.get("status") == "ok":
            out.append((int(seed), r))
    return sorted(out)


def _kb(b: float | None) -> str:
    return "–" if b is None else f"{b / 1e3:,.1f} kB"


def render(doc: dict[str, Any]) -> str:
    """The Markdown block: one row per method (mean over the seeds that ran, each seed, the
    difference to ssgd, bytes per worker and iteration in total and on inter-node links)."""
    runs = doc["runs"]
    base = _ok(runs, "ssgd")
    base_mean = statistics.mean(100 * r["final_test_accuracy"] for _, r in base) if base else None
    topk = _ok(runs, "topk")
    topk_inter = statistics.median(r["inter_node_bytes_per_worker_per_iter"] for _, r in topk) if topk else None
    lines = [
        "| method | test accuracy % (mean) | per seed | vs ssgd | bytes / worker / iter | inter-node bytes / worker / iter | inter-node vs topk |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    arms = sorted({k.rsplit("/", 1)[0] for k in runs} - set(METHODS))  # explored settings, after the defaults
    for m in [*METHODS, *arms]:
        rs = _ok(runs, m)
        if not rs:
            lines.append(f"| `{m}` | not run | – | – | – | – | – |")
            continue
        accs = [100 * r["final_test_accuracy"] for _, r in rs]
        mean = statistics.mean(accs)
        sd = f" ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else ""
        diff = f"{mean - base_mean:+.2f}" if base_mean is not None else "–"
        total = statistics.median(r["bytes_per_worker_per_iter"] for _, r in rs)
        inter = statistics.median(r["inter_node_bytes_per_worker_per_iter"] for _, r in rs)
        vs = f"{inter / topk_inter:.3f}×" if topk_inter else "–"
        seeds = " / ".join(f"{a:.1f}" for a in accs)
        lines.append(f"| `{m}` | {mean:.2f}{sd} | {seeds} (seeds {', '.join(str(s) for s, _ in rs)}) | {diff} | "
                     f"{_kb(total)} | {_kb(inter)} | {vs} |")
    any_run = next((r for rs in runs.values() for r in [rs] if r.get("status") == "ok"), None)
    foot = ""
    if any_run is not None:
        mach = any_run["machine"]
        cmd = shown_command(train_command("M", 0, Path("FILE"))).replace("--seed 0", "--seed S")
        foot = (f"\n\nCommand: `{cmd}` (seeds {', '.join(map(str, SEEDS))}); bytes are medians over the "
                "steps of the accounting layer's counts (inter-node: its link classes, see "
                f"[Bytes per link](#bytes-per-link)), {any_run['steps']} steps; rows with options are the "
                f"settings tried while choosing hitopk's defaults. Machine: {mach.get('cpu')}, "
                f"{mach.get('cpu_count')} cores, torch {mach.get('torch')}; commit "
                f"{acc.short_commit(any_run.get('git_commit'))}.")
    return "\n".join(lines) + foot + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the missing runs, then re-render the doc block."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help=f"default: {' '.join(METHODS)}; NAME:OPTIONS (one of them with options) adds an arm")
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    args = ap.parse_args(argv)
    bad = [m for m in args.methods if m.split(":")[0] not in METHODS]
    if bad:
        ap.error(f"unknown method {bad[0]!r}; valid: {', '.join(METHODS)} (optionally with :OPTIONS)")
    doc = load(args.out)
    if not args.table_only:
        todo = plan(doc, args.methods, args.seeds)
        with tempfile.TemporaryDirectory() as tmp:
            for i, (m, seed) in enumerate(todo, 1):
                print(f"[{i}/{len(todo)}] {m} seed {seed}", flush=True)
                rec = run_one(m, seed, Path(tmp))
                doc["runs"][run_key(m, seed)] = rec
                acc.save(args.out, doc)
                print(f"  {rec['status']}: {rec.get('final_test_accuracy')} in {rec['wall_s']} s", flush=True)
    acc.write_doc(args.doc, BLOCK, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

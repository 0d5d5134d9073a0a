"""Accuracy benchmark: every compressor at its defaults against ``ssgd`` (issue 12).

Why this exists: a user adopts gradient compression only if it reaches ``ssgd``'s accuracy
with the trainer's defaults, not with a recipe tuned per method. So every run here is
exactly what a new user types::

    lowcomm train --nproc 4 --model M [--model-arg ...] --data D --epochs E --seed S \\
        --method NAME --quiet --no-progress --json FILE

and nothing else (no lr, batch, momentum or schedule flag: the trainer's defaults, and the
optimizer settings the method itself moves, which the trainer prints as notices and this
script records). The matrix is workloads x lengths x seeds x methods, where the methods are
``ssgd`` plus every codec registered in ``lowcomm.compress.codec.CODECS`` (read from the
registry, so a new codec joins the benchmark by being registered).

Each run is stored in ``benchmarks/results/accuracy.json`` under
``workload/epochs/method/seed`` as soon as it ends (atomic write), and runs already there
are skipped: the matrix can be filled over several invocations, and an interrupted one loses
at most the run in progress. A failed run is stored as failed (shown as such, retried by the
next invocation). ``--table-only`` re-renders ``docs/results_accuracy.md`` from the JSON.

Usage (from the repository root)::

    .venv/bin/python benchmarks/accuracy.py                          # the whole matrix
    .venv/bin/python benchmarks/accuracy.py --workloads mnist1d-cnn1d-c256 --epochs 15 \\
        --seeds 0 --methods ssgd topk                                 # a slice of it
    .venv/bin/python benchmarks/accuracy.py --table-only             # re-render the doc

Bytes are wire bytes sent per worker as counted by ``lowcomm.comm.accounting`` (ring model):
"per step" is the mean over the last epoch's training steps (steady state, after any
warm-up), "total" is everything a worker sent in the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "accuracy.json"
DOC = REPO / "docs" / "results_accuracy.md"
BLOCK = "accuracy"


@dataclass(frozen=True)
class Workload:
    """A model on a dataset: what ``--model``, ``--model-arg`` and ``--data`` select."""

    key: str
    model: str
    data: str
    model_args: tuple[str, ...]
    label: str


WORKLOADS: dict[str, Workload] = {w.key: w for w in [
    Workload("mnist1d-cnn1d-c64", "cnn1d", "mnist1d", ("channels=64",), "MNIST-1D, cnn1d channels=64"),
    Workload("mnist1d-cnn1d-c256", "cnn1d", "mnist1d", ("channels=256",), "MNIST-1D, cnn1d channels=256"),
    Workload("digits-cnn2d", "cnn2d", "digits", (), "sklearn digits, cnn2d"),
]}
LENGTHS = (15, 40)
SEEDS = (0, 1, 2)
NPROC = 4
#: The issue's targets: points below ssgd's mean allowed, per workload and length.
TARGETS: dict[str, dict[int, float]] = {"mnist1d-cnn1d-c256": {40: 1.0, 15: 2.0}}
FULL_N = 3  # the targets are stated for the mean of 3 seeds


def methods() -> list[str]:
    """``ssgd`` first, then every registered codec (its name is also its ``--method``)."""
    from lowcomm.compress.codec import CODECS

    return ["ssgd", *[n for n in CODECS.names() if n != "ssgd"]]


def run_key(workload: str, epochs: int, method: str, seed: int) -> str:
    """The JSON key of one run."""
    return f"{workload}/{epochs}/{method}/{seed}"


# --- running --------------------------------------------------------------------------------


def train_command(w: Workload, epochs: int, method: str, seed: int, summary: Path, log: Path) -> list[str]:
    """The user's command line (``--log`` only adds per-step records for the bytes)."""
    cmd = [sys.executable, "-m", "lowcomm", "train", "--nproc", str(NPROC), "--model", w.model]
    for arg in w.model_args:
        cmd += ["--model-arg", arg]
    return cmd + ["--data", w.data, "--epochs", str(epochs), "--seed", str(seed), "--method", method,
                  "--quiet", "--no-progress", "--json", str(summary), "--log", str(log)]


def notices(stderr: str) -> list[str]:
    """The trainer's notices and warnings (what it changed for the method, and why)."""
    out = []
    for line in stderr.splitlines():
        line = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
        if (line.startswith("lowcomm:") and not line.startswith("lowcomm: error")) or line.startswith("warning:"):
            out.append(line)
    return list(dict.fromkeys(out))


def last_epoch_bytes(steps: list[dict[str, Any]]) -> float | None:
    """Mean wire bytes per step over the last epoch's steps (the steady state)."""
    steps = [s for s in steps if s.get("event") == "step"]
    if not steps:
        return None
    last = max(s["epoch"] for s in steps)
    sent = [s["bytes"] for s in steps if s["epoch"] == last]
    return sum(sent) / len(sent)


def parse_run(summary: dict[str, Any], steps: list[dict[str, Any]], stderr: str) -> dict[str, Any]:
    """One run's record, from the trainer's summary JSON, its step log and its stderr."""
    return {
        "status": "ok",
        "final_test_accuracy": summary["final_test_accuracy"],
        "accuracy_by_epoch": [h["test_accuracy"] for h in summary.get("history", []) if "test_accuracy" in h],
        "bytes_per_step_last_epoch": last_epoch_bytes(steps),
        "bytes_total": summary["bytes_sent_per_worker"],
        "steps": summary["steps"],
        "params": summary["params"],
        "optimizer": summary.get("optimizer"),
        "method_info": summary.get("method_info", {}),
        "notices": notices(stderr),
    }


def _git_commit() -> str | None:
    """HEAD, with ``+dirty`` when tracked files differ from it (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def short_commit(commit: str | None) -> str:
    """``5bc26337cdc0`` (``+dirty`` kept: the tree had uncommitted changes)."""
    if not commit:
        return "?"
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def machine() -> dict[str, Any]:
    """Where a run ran: timings (and only timings) depend on it."""
    from importlib.metadata import version

    info: dict[str, Any] = {"platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
                            "python": platform.python_version(), "torch": version("torch")}
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = os.getloadavg()[0]
    return info


def run_one(w: Workload, epochs: int, method: str, seed: int, work: Path) -> dict[str, Any]:
    """Train once; the record (status ``failed`` with the error's tail if it did not finish)."""
    summary, log = work / "summary.json", work / "steps.jsonl"
    for p in (summary, log):
        p.unlink(missing_ok=True)
    cmd = train_command(w, epochs, method, seed, summary, log)
    shown = ["lowcomm", *cmd[3:-4], "--json", "FILE"]  # the user's command (the step log is ours)
    env = {"command": " ".join(shown), "machine": machine(), "git_commit": _git_commit()}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0 or not summary.exists():
        return {"status": "failed", "error": proc.stderr[-2000:], "returncode": proc.returncode,
                "wall_s": wall, **env}
    steps = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
    return {**parse_run(json.loads(summary.read_text()), steps, proc.stderr), "wall_s": wall, **env}


# --- the result file -------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    """The result document (an empty one when the file does not exist yet)."""
    if path.exists():
        return dict(json.loads(path.read_text()))
    return {"benchmark": "accuracy", "recipe": "lowcomm train defaults; see benchmarks/accuracy.py",
            "runs": {}}


def save(path: Path, doc: dict[str, Any]) -> None:
    """Write atomically (a crash mid-write must not lose the runs already measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc["runs"] = dict(sorted(doc["runs"].items()))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def plan(doc: dict[str, Any], workloads: Iterable[str], lengths: Iterable[int], seeds: Iterable[int],
         names: Iterable[str], rerun: bool = False) -> list[tuple[str, int, str, int]]:
    """The runs still missing (or failed), seed-major so a cut-short matrix has every method;
    every selected one with ``rerun`` (to measure them again at the current commit)."""
    todo = []
    for seed in seeds:
        for wl in workloads:
            for e in lengths:
                for m in names:
                    if rerun or doc["runs"].get(run_key(wl, e, m, seed), {}).get("status") != "ok":
                        todo.append((wl, e, m, seed))
    return todo


# --- rendering -------------------------------------------------------------------------------


@dataclass
class Cell:
    """One method's runs in one table: per seed and their aggregate."""

    acc: dict[int, float]            # seed -> accuracy in percent (ok runs)
    failed: set[int]
    bytes_step: float | None
    bytes_total: float | None
    notices: list[str]

    @property
    def n(self) -> int:
        return len(self.acc)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.acc.values()) if self.acc else None

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.acc.values()) if self.n > 1 else None


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def cell(runs: dict[str, Any], workload: str, epochs: int, method: str) -> Cell:
    """Collect ``method``'s runs of one (workload, length) table."""
    prefix = f"{workload}/{epochs}/{method}/"
    mine = {int(k[len(prefix):]): r for k, r in runs.items() if k.startswith(prefix)}
    ok = {s: r for s, r in mine.items() if r.get("status") == "ok"}
    step = [r["bytes_per_step_last_epoch"] for r in ok.values() if r.get("bytes_per_step_last_epoch") is not None]
    return Cell(acc={s: 100 * r["final_test_accuracy"] for s, r in sorted(ok.items())},
                failed={s for s, r in mine.items() if r.get("status") != "ok"},
                bytes_step=_mean(step), bytes_total=_mean([r["bytes_total"] for r in ok.values()]),
                notices=list(dict.fromkeys(n for r in ok.values() for n in r.get("notices", []))))


def fmt_acc(c: Cell) -> str:
    """``94.13 ± 0.42``, with ``(n=2)`` when fewer seeds than the targets assume."""
    if c.mean is None:
        return "not run"
    text = f"{c.mean:.2f}" + (f" ± {c.sd:.2f}" if c.sd is not None else "")
    return text + (f" (n={c.n})" if c.n < FULL_N else "")


def fmt_seeds(c: Cell, seeds: list[int]) -> str:
    """Each seed's accuracy in seed order; a missing one says so."""
    def one(s: int) -> str:
        return f"{c.acc[s]:.1f}" if s in c.acc else ("failed" if s in c.failed else "not run")
    return " / ".join(one(s) for s in seeds) if c.acc or c.failed else "–"


def fmt_bytes(b: float | None) -> str:
    """Bytes in kB/MB (decimal)."""
    if b is None:
        return "–"
    return f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB"


def fmt_x(r: float) -> str:
    """A reduction factor: ``2.00×``, ``12.4×``."""
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×"


def ratio(base: float | None, x: float | None) -> float | None:
    """``base / x`` (bytes reduction), ``None`` when either is missing."""
    return base / x if base and x else None


def target_check(c: Cell, base: Cell, tol: float) -> str:
    """The issue's check: within ``tol`` points of ssgd's mean and fewer bytes per step;
    provisional while either side has fewer than 3 seeds."""
    if c.mean is None:
        return "not run"
    if base.mean is None:
        return "no ssgd runs"
    red = ratio(base.bytes_step, c.bytes_step)
    ok = c.mean - base.mean >= -tol and (red is None or red > 1.0)
    verdict = f"{'PASS' if ok else 'FAIL'} (≥ −{tol:g})"
    n = min(c.n, base.n)
    return verdict + (f", provisional: n={n}" if n < FULL_N else "")


def _row(method: str, c: Cell, base: Cell, seeds: list[int], tol: float | None) -> str:
    is_base = method == "ssgd"
    gap = "–" if is_base or c.mean is None or base.mean is None else f"{c.mean - base.mean:+.2f}"
    r_step, r_total = ratio(base.bytes_step, c.bytes_step), ratio(base.bytes_total, c.bytes_total)
    red = "–" if is_base or r_step is None or r_total is None else f"{fmt_x(r_step)} / {fmt_x(r_total)}"
    cells = [f"`{method}`", fmt_acc(c), fmt_seeds(c, seeds), gap, fmt_bytes(c.bytes_step), red]
    if tol is not None:
        cells.append("baseline" if is_base else target_check(c, base, tol))
    return "| " + " | ".join(cells) + " |"


def table_seeds(runs: dict[str, Any], workload: str, epochs: int) -> list[int]:
    """The default seeds plus any other seed present in this table's runs."""
    prefix = f"{workload}/{epochs}/"
    extra = {int(k.rsplit("/", 1)[1]) for k in runs if k.startswith(prefix)}
    return sorted(set(SEEDS) | extra)


def table_methods(runs: dict[str, Any], workload: str, epochs: int, names: list[str]) -> list[str]:
    """The benchmark's methods, then any other method with runs here (never dropped silently)."""
    prefix = f"{workload}/{epochs}/"
    present = [k[len(prefix):].rsplit("/", 1)[0] for k in runs if k.startswith(prefix)]
    return names + sorted(set(present) - set(names))


def render_table(runs: dict[str, Any], workload: str, epochs: int, names: list[str]) -> str:
    """The Markdown table of one (workload, length), with its notices below it."""
    tol = TARGETS.get(workload, {}).get(epochs)
    seeds = table_seeds(runs, workload, epochs)
    ms = table_methods(runs, workload, epochs, names)
    cells = {m: cell(runs, workload, epochs, m) for m in ms}
    base = cells.get("ssgd") or cell(runs, workload, epochs, "ssgd")
    head = ["method", "test acc % (mean ± sd)", f"per seed ({' / '.join(map(str, seeds))})", "gap vs ssgd (pts)",
            "bytes/worker/step", "bytes reduction step / total"]
    if tol is not None:
        head.append(f"target (within {tol:g} pt of ssgd)")
    align = ["---", "---:", "---", "---:", "---:", "---:"] + (["---"] if tol is not None else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += [_row(m, cells[m], base, seeds, tol) for m in ms]
    return "\n".join(lines) + _notice_lines(cells)


def _notice_lines(cells: dict[str, Cell]) -> str:
    items = [f"- `{m}`: " + "; ".join(f"`{n}`" for n in c.notices) for m, c in cells.items() if c.notices]
    return ("\n\nNotices printed by the trainer:\n\n" + "\n".join(items)) if items else ""


def _machines(runs: dict[str, Any]) -> str:
    seen: dict[str, int] = {}
    for r in runs.values():
        m, commit = r.get("machine", {}), short_commit(r.get("git_commit"))
        desc = (f"{m.get('cpu') or m.get('platform', '?')}, {m.get('cpu_count', '?')} cores, "
                f"torch {m.get('torch', '?')}, commit {commit}")
        seen[desc] = seen.get(desc, 0) + 1
    return "\n".join(f"- {d} ({n} runs)" for d, n in seen.items()) or "- (no runs yet)"


def render_all(doc: dict[str, Any], names: list[str]) -> str:
    """Every table of the matrix, in workload and length order, with where they ran."""
    runs = doc["runs"]
    parts = ["_Generated by `benchmarks/accuracy.py` from `benchmarks/results/accuracy.json`; "
             "do not edit by hand._", "Measured on:\n\n" + _machines(runs)]
    for key, w in WORKLOADS.items():
        for e in sorted(set(LENGTHS) | {int(k.split("/")[1]) for k in runs if k.startswith(key + "/")}):
            parts.append(f"### {w.label}, {e} epochs\n\n{render_table(runs, key, e, names)}")
    return "\n\n".join(parts)


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the part between ``<!-- name:begin -->`` and ``<!-- name:end -->``
    replaced by ``body`` (idempotent); refuses a document without exactly one such block."""
    pattern = re.compile(rf"(<!-- {re.escape(name)}:begin -->\n)(.*?)(<!-- {re.escape(name)}:end -->)", re.S)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one <!-- {name}:begin --> ... <!-- {name}:end --> block")
    return pattern.sub(lambda m: m.group(1) + body.strip("\n") + "\n" + m.group(3), text)


def write_doc(doc_path: Path, name: str, body: str) -> None:
    """Rewrite the generated block of ``doc_path`` (the hand-written rest is kept)."""
    doc_path.write_text(replace_block(doc_path.read_text(), name, body))


# --- command line ----------------------------------------------------------------------------


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--epochs", nargs="+", type=int, default=list(LENGTHS))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--methods", nargs="+", default=None,
                    help="default: ssgd + every registered codec (NAME:OPTIONS also accepted)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    ap.add_argument("--rerun", action="store_true", help="run the selected runs again even if stored")
    return ap.parse_args(argv)


def run_matrix(args: argparse.Namespace, doc: dict[str, Any], names: list[str]) -> None:
    """Run every missing run of the selection, saving after each."""
    todo = plan(doc, args.workloads, args.epochs, args.seeds, names, args.rerun)
    print(f"accuracy: {len(todo)} runs to do", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="lowcomm_accuracy_") as tmp:
        for i, (wl, e, m, s) in enumerate(todo, 1):
            rec = run_one(WORKLOADS[wl], e, m, s, Path(tmp))
            doc["runs"][run_key(wl, e, m, s)] = rec
            save(args.out, doc)
            what = (f"{100 * rec['final_test_accuracy']:.1f} %" if rec["status"] == "ok"
                    else f"FAILED (exit {rec['returncode']}): {rec['error'].strip().splitlines()[-1:]}")
            print(f"[{i}/{len(todo)}] {run_key(wl, e, m, s)}: {what}, {rec['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    names = methods()
    chosen = args.methods or names
    # a spec with options (topk:density=0.1) is accepted for side experiments; its rows come
    # after the defaults' rows, under its full spec
    unknown = [m for m in chosen if m.partition(":")[0] not in names]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; the benchmark's methods: {', '.join(names)}")
    doc = load(args.out)
    if not args.table_only:
        run_matrix(args, doc, chosen)
    write_doc(args.doc, BLOCK, render_all(doc, names))
    print(f"wrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

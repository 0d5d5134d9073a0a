"""Semi-synchronous training against synchronous methods on a byte-level LM (issue 19).

Why this exists: Local SGD, DiLoCo and Streaming DiLoCo send far fewer bytes by syncing
every H steps, but change the optimization; the honest comparison is (a) the final
validation loss at equal steps and (b) the training wall-clock to a target validation loss,
on a slow emulated network, beside ``ssgd`` and a compressor (``acpsgd``).

Workload: ``transformer_lm`` on ``--data stdlib`` (the Python standard library's sources,
bytes, no download), AdamW as every method's (inner) optimizer, 4 workers. One invocation
per network runs::

    lowcomm bench --net NET --nproc 4 --model transformer_lm --model-arg ... --data stdlib \\
        --epochs E --batch-size B --methods M1,M2,... --train-arg=--data-arg=max_bytes=... \\
        --train-arg=--optimizer=adamw --train-arg=--lr=LR --work-dir W --json RAW

Every epoch ends with an evaluation on the validation split (``eval_split=valid``: the trainer's
``test_loss`` is then the validation loss); the
default sizes give 250 steps per epoch, so H = 25 syncs land on the evaluations (synchronized
weights are evaluated). Target: ``ssgd``'s final loss times ``1 + TOLERANCE`` (within 2 %);
time to it is the training clock (the workers' per-step times summed from the step log,
evaluation excluded) at the first evaluation at or below it. Bytes per step are
``bytes_sent_per_worker / steps`` (rank 0's ledger: the period average; the median per step of
``lowcomm bench`` is 0 for a method that syncs every H steps). ``lowcomm bench`` emulates the
network with one namespace per worker when run as root, and falls back to loopback
otherwise; the table then says so.

Usage (from the repository root, as root for the namespaces)::

    .venv/bin/python benchmarks/localsgd.py                      # 100mbit and 1gbit, 4 epochs
    .venv/bin/python benchmarks/localsgd.py --nets 100mbit --epochs 4
    .venv/bin/python benchmarks/localsgd.py --smoke              # tiny, loopback, seconds (checks the script)
    .venv/bin/python benchmarks/localsgd.py --table-only         # re-render the doc

Results: ``benchmarks/results/localsgd.json`` (one entry per network/epochs/seed) and the
Markdown between ``<!-- localsgd:begin -->`` and ``<!-- localsgd:end -->`` in
``docs/localsgd.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (result file, doc block, machine helpers)

from lowcomm.bench.runner import training_seconds  # noqa: E402

RESULTS = acc.REPO / "benchmarks" / "results" / "localsgd.json"
DOC = acc.REPO / "docs" / "localsgd.md"
BLOCK = "localsgd"
H = 25
#: DiLoCo's outer settings for a run this short: the paper's momentum 0.9 turns correlated
#: pseudo-gradients (constant inner LR, few syncs) into a ~7x larger steady-state step
#: (lr * 1/(1 - mu)); measured 8.5 % above ssgd's loss at 400 steps on 2 workers, against 2.1 %
#: with these (docs/localsgd.md). The paper's defaults are run too.
OUTER = "outer_lr=0.8,outer_momentum=0.3"
METHODS = (
    "ssgd",
    "acpsgd",
    f"localsgd:sync_every={H}",
    f"diloco:sync_every={H}",
    f"diloco:sync_every={H},{OUTER}",
    f"diloco:sync_every={H},{OUTER},compress=fp16",
    f"streaming_diloco:sync_every={H},fragments=4",
)
SEMI_SYNC = ("localsgd", "diloco", "streaming_diloco")
TOLERANCE = 0.02  # the issue: DiLoCo within 2 % of ssgd's final validation loss
BYTES_TARGET = 20.0  # ... sending >= 20x fewer bytes
SPEEDUP_TARGET = 3.0  # at 100 Mbit/s, the best reaches the target >= 3x sooner than ssgd
NPROC = 4
MODEL_ARGS = ("d_model=128", "nhead=4", "num_layers=4", "max_len=64")
# 4 workers x 4 windows x 32 bytes a step, 250 steps an epoch (an evaluation every 250 steps).
# Why so few tokens a step: the all-reduce's time grows with the parameters and the compute
# with parameters x tokens, so tokens per step alone set how communication-bound the run is.
# Measured on the 2-vCPU VM at 100 Mbit/s (lowcomm bench, 8 timed steps): ssgd 703 ms a step,
# localsgd 130 ms between syncs at batch 4; at batch 8, 733 ms and 294 ms.
BPTT, BATCH, STEPS_PER_EPOCH, LR = 32, 4, 250, 0.003
MAX_BYTES = STEPS_PER_EPOCH * NPROC * BATCH * BPTT + 1
SMOKE = {
    "model_args": ("d_model=16", "nhead=2", "num_layers=2", "max_len=16"),
    "bptt": 16,
    "batch": 4,
    "max_bytes": 2 * 8 * 4 * 16 + 1,
    "epochs": 2,
    "nets": ["none"],
    "nproc": 2,
    "methods": [
        "ssgd",
        "localsgd:sync_every=4",
        "diloco:sync_every=4",
        "streaming_diloco:sync_every=4,fragments=2",
    ],
}


def bench_command(a: argparse.Namespace, net: str, raw: Path, work: Path) -> list[str]:
    """The ``lowcomm bench`` command line of one invocation."""
    cmd = [
        sys.executable,
        "-m",
        "lowcomm",
        "bench",
        "--net",
        net,
        "--nproc",
        str(a.nproc),
        "--model",
        "transformer_lm",
        "--data",
        "stdlib",
        "--epochs",
        str(a.epochs),
        "--batch-size",
        str(a.batch),
        "--methods",
        ",".join(a.methods),
        "--no-compute-only",
        "--no-predict",
        "--timeout",
        f"{a.timeout:g}",
        f"--train-arg=--data-arg=max_bytes={a.max_bytes}",
        f"--train-arg=--data-arg=bptt={a.bptt}",
        "--train-arg=--data-arg=eval_split=valid",
        "--train-arg=--optimizer=adamw",
        f"--train-arg=--lr={a.lr:g}",
        f"--train-arg=--seed={a.seed}",
        "--work-dir",
        str(work),
        "--json",
        str(raw),
        "--quiet",
    ]
    for m in a.model_args:
        cmd += ["--model-arg", m]
    if a.compute:
        cmd += ["--compute", a.compute]
    return cmd


def record(raw: dict[str, Any], command: list[str], work: Path) -> dict[str, Any]:
    """What is kept: each row's loss curve with its training clock, bytes, the network, the machine."""
    net = raw.get("network") or {}
    runs = []
    for r in raw.get("runs", []):
        row = {
            k: r.get(k)
            for k in (
                "method",
                "status",
                "reason",
                "bytes_sent_per_worker",
                "iter_time_s_median",
                "params",
                "method_info",
            )
        }
        log = Path(r["log"]) if r.get("log") else None
        clock = training_seconds(log.with_name(log.stem + ".steps.jsonl")) if log else {}
        row["curve"] = [
            {
                "step": h.get("step"),
                "test_loss": h.get("test_loss"),
                "wall_s": h.get("wall_s"),
                "train_s": clock.get(int(h.get("step") or 0)),
            }
            for h in r.get("history", [])
        ]
        runs.append(row)
    return {
        "command": " ".join(["lowcomm", *command[3:]]).replace(str(work), "WORK"),
        "machine": raw.get("machine", {}),
        "git_commit": acc._git_commit(),
        "world_size": raw.get("world_size"),
        "threads_per_worker": raw.get("threads_per_worker"),
        "network": {
            k: net.get(k)
            for k in (
                "requested",
                "label",
                "emulated",
                "note",
                "measured_bits_per_s",
                "rtt_ms",
                "error",
            )
            if k in net
        },
        "runs": runs,
    }


def analyse(rec: dict[str, Any]) -> dict[str, Any]:
    """Target loss, each method's final loss, bytes per step, time to target and ratios."""
    ok = [r for r in rec["runs"] if r.get("status") == "ok" and r["curve"]]
    ref = next((r for r in ok if r["method"] == "ssgd"), None)
    target = ref["curve"][-1]["test_loss"] * (1 + TOLERANCE) if ref else None
    rows = []
    for r in rec["runs"]:
        curve = r.get("curve") or []
        steps = curve[-1]["step"] if curve else None
        reach = next(
            (
                c["train_s"]
                for c in curve
                if target is not None and c["test_loss"] is not None and c["test_loss"] <= target
            ),
            None,
        )
        rows.append(
            {
                "method": r["method"],
                "status": r.get("status"),
                "reason": r.get("reason"),
                "final": curve[-1]["test_loss"] if curve else None,
                "steps": steps,
                "time_s": reach,
                "train_s": curve[-1]["train_s"] if curve else None,
                "bytes_step": r["bytes_sent_per_worker"] / steps
                if steps and r.get("bytes_sent_per_worker") is not None
                else None,
            }
        )
    base = next((x for x in rows if x["method"] == "ssgd"), None)
    for x in rows:
        x["speedup"] = (
            base["time_s"] / x["time_s"] if base and base["time_s"] and x["time_s"] else None
        )
        x["fewer_bytes"] = (
            base["bytes_step"] / x["bytes_step"]
            if base and base["bytes_step"] and x["bytes_step"]
            else None
        )
        x["loss_ratio"] = (
            x["final"] / base["final"] if base and base["final"] and x["final"] else None
        )
    return {"target": target, "rows": rows}


def checks(rec: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """The issue's targets, PASS/FAIL, for this invocation."""
    rows = {x["method"]: x for x in a["rows"]}
    out = []
    for x in a["rows"]:
        if x["method"].split(":")[0] == "diloco" and "compress=" not in x["method"]:
            ok = (
                x["loss_ratio"] is not None
                and x["loss_ratio"] <= 1 + TOLERANCE
                and (x["fewer_bytes"] or 0) >= BYTES_TARGET
            )
            out.append(
                f"`{x['method']}` within {100 * TOLERANCE:g} % of ssgd's final loss and ≥ {BYTES_TARGET:g}x "
                f"fewer bytes: **{'PASS' if ok else 'FAIL'}**"
            )
    if str(rec["network"].get("requested")) == "100mbit":
        semi = [x for x in a["rows"] if x["method"].split(":")[0] in SEMI_SYNC and x["speedup"]]
        best = max(semi, key=lambda x: x["speedup"], default=None)
        acp = rows.get("acpsgd")
        sooner = best is not None and (
            acp is None or acp["time_s"] is None or best["time_s"] < acp["time_s"]
        )
        ok = best is not None and best["speedup"] >= SPEEDUP_TARGET and sooner
        name = f"`{best['method']}`" if best else "none of them"
        out.append(
            f"best semi-synchronous method ({name}) reaches the target ≥ {SPEEDUP_TARGET:g}x sooner than "
            f"ssgd and sooner than acpsgd: **{'PASS' if ok else 'FAIL'}**"
        )
    return out


def _f(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def render_one(key: str, rec: dict[str, Any]) -> str:
    """The table of one invocation: final loss at equal steps, bytes, time to target, checks."""
    a = analyse(rec)
    net, m = rec.get("network", {}), rec.get("machine", {})
    where = (
        f"emulated {net.get('label') or net.get('requested')}"
        if net.get("emulated")
        else f"**loopback, not an emulated {net.get('requested')} network** ({net.get('note') or net.get('error')})"
    )
    head = (
        f"Target: validation loss {a['target']:.4f} (`ssgd`'s final × {1 + TOLERANCE:g})."
        if a["target"]
        else "No successful `ssgd` run: no target."
    )
    lines = [
        "| method | final val. loss (ppl) | vs ssgd | bytes/worker/step (mean) | fewer bytes | "
        "time to target (s) | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for x in a["rows"]:
        if x["status"] != "ok":
            lines.append(f"| `{x['method']}` | failed: {x.get('reason') or '?'} | | | | | |")
            continue
        ppl = f"{x['final']:.4f} ({math.exp(x['final']):.2f})" if x["final"] is not None else "–"
        lines.append(
            f"| `{x['method']}` | {ppl} | {_f(x['loss_ratio'], '.3f')} | {acc.fmt_bytes(x['bytes_step'])} | "
            f"{_f(x['fewer_bytes'], '.1f')}x | {_f(x['time_s'], '.1f') if x['time_s'] else 'not reached'} | "
            f"{_f(x['speedup'], '.2f')}x |"
        )
    load = m.get("load_avg_1m_at_start")
    setting = (
        f"Network: {where}. Machine: {m.get('cpu') or m.get('platform', '?')}, {m.get('cpu_count', '?')} cores, "
        f"torch {m.get('torch', '?')}, load {'?' if load is None else f'{load:.1f}'} at start; "
        f"{rec.get('world_size')} workers. Commit {acc.short_commit(rec.get('git_commit'))}. "
        f"Command: `{rec.get('command')}`."
    )
    return "\n\n".join(
        [f"### {key}", head, "\n".join(lines), *[f"- {c}" for c in checks(rec, a)], setting]
    )


def render_all(doc: dict[str, Any]) -> str:
    """Every invocation's table (or a line saying none ran yet)."""
    parts = [
        "_Generated by `benchmarks/localsgd.py` from `benchmarks/results/localsgd.json`; do not edit by hand._"
    ]
    runs = doc.get("runs", {})
    parts += [render_one(k, runs[k]) for k in sorted(runs)] or ["Not run yet."]
    return "\n\n".join(parts)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--methods",
        type=lambda s: __import__("lowcomm.methods", fromlist=["x"]).split_list(s),
        default=list(METHODS),
        help="comma-separated method specs",
    )
    ap.add_argument("--model-args", nargs="+", default=list(MODEL_ARGS))
    ap.add_argument("--bptt", type=int, default=BPTT)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--max-bytes", type=int, default=MAX_BYTES)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--nproc", type=int, default=NPROC)
    ap.add_argument("--compute", default=None, help="passed to lowcomm bench --compute")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per method")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--rerun", action="store_true", help="run again what --out already holds")
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes on loopback, results to a temp file"
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.model_args, a.bptt, a.batch, a.max_bytes = (
            SMOKE["model_args"],
            SMOKE["bptt"],
            SMOKE["batch"],
            SMOKE["max_bytes"],
        )
        a.epochs, a.nets, a.nproc, a.methods = (
            SMOKE["epochs"],
            SMOKE["nets"],
            SMOKE["nproc"],
            SMOKE["methods"],
        )
        if a.out == RESULTS:
            a.out = Path(tempfile.mkdtemp(prefix="lowcomm_localsgd_")) / "localsgd.json"
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    doc: dict[str, Any] = (
        acc.load(a.out) if a.out.exists() else {"benchmark": "localsgd", "runs": {}}
    )
    if not a.table_only:
        for net in a.nets:
            key = f"{net}/{a.epochs}ep/seed{a.seed}"
            if key in doc["runs"] and not a.rerun:
                print(
                    f"localsgd: {key} already in {a.out}; skipped (--rerun to redo)",
                    file=sys.stderr,
                )
                continue
            with tempfile.TemporaryDirectory(prefix="lowcomm_localsgd_") as tmp:
                raw, work = Path(tmp) / "bench.json", Path(tmp) / "work"
                cmd = bench_command(a, net, raw, work)
                code = subprocess.run(cmd, cwd=acc.REPO).returncode
                if not raw.exists():
                    print(
                        f"localsgd: lowcomm bench exited {code} without a result", file=sys.stderr
                    )
                    continue
                doc["runs"][key] = record(json.loads(raw.read_text()), cmd, work)
            acc.save(a.out, doc)
            print(render_one(key, doc["runs"][key]))
    if a.smoke:
        print(render_all(doc))
        return 0
    acc.write_doc(a.doc, BLOCK, render_all(doc))
    print(f"wrote {a.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

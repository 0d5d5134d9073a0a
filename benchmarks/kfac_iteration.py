"""K-FAC iteration time: lowcomm's KFAC (pipelined, non-pipelined) against kfac-pytorch and SGD.

Why: issue 13's targets are per-iteration speed — lowcomm ≥ 1.3× faster than kfac-pytorch
"in the same run with the same settings", and SPD-KFAC's pipelining ≥ 10 % faster than the
non-pipelined baseline on the emulated 1 Gbit/s cluster — and the overhead over plain SGD.
Every row runs ``benchmarks/kfac_iteration_worker.py`` (the same DDP loop, model, synthetic
data and SGD; only the preconditioner differs) on the same workers, one row after the other.

Scenarios (issue 13): ``loopback2`` — CIFAR ResNet-18, batch 8 per worker, 2 workers, gloo on
loopback; ``1gbit4`` — the same on 4 workers in network namespaces shaped to 1 Gbit/s
(:mod:`lowcomm.bench.netns`; needs root, else it runs on loopback and says so). Both use
``factor_update_steps=5``, ``inv_update_steps=50``, damping 1e-3, eigen form, every rank a
gradient worker, full factors on the wire (kfac-pytorch's default; ``--symmetric`` sends the
upper triangle in both libraries). The timed window is 50 steps after a 35-step warm-up, so it
holds exactly one decomposition step (step 50) and ten factor steps, as a long run averages
them, and no one-time cost (first decomposition at step 0, lowcomm's α-β profiling).

kfac-pytorch is never a dependency: build the benchmark's own environment with
``benchmarks/kfac_env.sh`` and pass its interpreter as ``--python`` (every row then runs on it,
so both libraries share torch). Without kfac-pytorch the kfac-pytorch rows are recorded as
failed with the reason. Results: ``benchmarks/results/kfac_iteration.json`` (each row saved as
it ends; rows already there are skipped unless ``--force``); ``--table-only`` re-renders the
block in ``docs/kfac.md``.

    .venv/bin/python benchmarks/kfac_iteration.py --python /tmp/kfacbench-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: result file, doc block, machine helpers)

REPO = acc.REPO
RESULTS = REPO / "benchmarks" / "results" / "kfac_iteration.json"
DOC = REPO / "docs" / "kfac.md"
BLOCK = "kfac-iter"
WORKER = REPO / "benchmarks" / "kfac_iteration_worker.py"
PORT = 29650  # inside the namespaces

#: scenario -> (workers, --net spec)
SCENARIOS: dict[str, tuple[int, str]] = {"loopback2": (2, "none"), "1gbit4": (4, "1gbit")}
#: row -> worker flags
ROWS: dict[str, list[str]] = {
    "sgd": ["--impl", "sgd"],
    "lowcomm": ["--impl", "lowcomm", "--pipeline", "1", "--defer", "1"],
    "lowcomm-nopipe": ["--impl", "lowcomm", "--pipeline", "0", "--defer", "1"],
    "lowcomm-wait": ["--impl", "lowcomm", "--pipeline", "1", "--defer", "0"],
    "lowcomm-nopipe-wait": ["--impl", "lowcomm", "--pipeline", "0", "--defer", "0"],
    "kfac-pytorch": ["--impl", "kfac-pytorch"],
}
LABELS = {"sgd": "SGD (no preconditioner)",
          "lowcomm": "lowcomm KFAC, pipelined (SPD-KFAC), factors folded when next read",
          "lowcomm-nopipe": "lowcomm KFAC, non-pipelined, factors folded when next read",
          "lowcomm-wait": "lowcomm KFAC, pipelined (SPD-KFAC), each factor step waits",
          "lowcomm-nopipe-wait": "lowcomm KFAC, non-pipelined, each factor step waits (KAISA's way)",
          "kfac-pytorch": "kfac-pytorch (KAISA) 0.4.2"}
#: (row, baseline row, minimum speed-up or None for a comparison without a target): the issue's
#: targets. Pipelining is judged like against like (both modes deferred, both waiting): the
#: deferral (``defer_factor_comm``) is open to either mode, so its gain is shown on its own
TARGETS: dict[str, list[tuple[str, str, float | None]]] = {
    "loopback2": [("lowcomm", "kfac-pytorch", 1.3), ("lowcomm-nopipe", "kfac-pytorch", None),
                  ("lowcomm", "lowcomm-wait", None)],
    "1gbit4": [("lowcomm", "lowcomm-nopipe", 1.1), ("lowcomm-wait", "lowcomm-nopipe-wait", 1.1),
               ("lowcomm", "lowcomm-wait", None), ("lowcomm-nopipe", "lowcomm-nopipe-wait", None),
               ("lowcomm", "kfac-pytorch", 1.3), ("lowcomm-nopipe", "kfac-pytorch", None)]}


def _python_info(python: str) -> dict[str, Any]:
    """torch and kfac-pytorch versions of the interpreter the rows run on."""
    code = ("import json, torch\ntry:\n import importlib.metadata as m; k = m.version('kfac_pytorch')\n"
            "except Exception: k = None\nprint(json.dumps({'torch': torch.__version__, 'kfac_pytorch': k}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-300:]}


def run_row(row: str, nproc: int, cluster: Any, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One row on the current network: the worker's JSON (rank 0) or ``{"status": "failed"}``."""
    from lowcomm.bench.runner import launch_options, redirect_fds
    from lowcomm.runtime.launch import launch_workers

    out = work / f"{row}-{nproc}.json"
    out.unlink(missing_ok=True)
    flags = [*ROWS[row], "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
             "--steps", str(args.steps), "--symmetric", str(int(args.symmetric)), "--out", str(out)]
    log = work / f"{row}-{nproc}.log"
    log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with redirect_fds(log):
        code = launch_workers(flags, nproc, command=[args.python, str(WORKER)], timeout_s=args.timeout,
                              failure_grace_s=10.0, quiet=True, **launch_options(cluster, PORT))
    wall = round(time.perf_counter() - t0, 1)
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        return {"status": "failed", "returncode": code, "error": tail, "wall_s": wall, "flags": flags}
    return {"status": "ok", **json.loads(out.read_text()), "flags": flags, "launch_wall_s": wall}


def run_scenario(name: str, args: argparse.Namespace, doc: dict[str, Any]) -> None:
    from lowcomm.bench import environment, netns

    nproc, net = SCENARIOS[name]
    rows = [r for r in args.rows if args.force or doc["runs"].get(f"{name}/{r}", {}).get("status") != "ok"]
    if not rows:
        return
    spec = netns.parse_net(net)
    work = Path(tempfile.mkdtemp(prefix=f"kfac-iter-{name}-"))
    with environment.network(spec, nproc, lambda m: print(m, file=sys.stderr)) as (cluster, info):
        for row in rows:
            print(f"kfac_iteration: {name} {row} ...", file=sys.stderr, flush=True)
            rec = run_row(row, nproc, cluster, args, work)
            rec.update(network=info, machine=acc.machine(), git_commit=acc._git_commit(),
                       python=_python_info(args.python), scenario=name)
            doc["runs"][f"{name}/{row}"] = rec
            acc.save(args.out, doc)
            shown = f"{rec['s_per_iter']:.3f} s/iter" if rec["status"] == "ok" else "FAILED"
            print(f"kfac_iteration: {name} {row}: {shown}", file=sys.stderr, flush=True)


# --- rendering -------------------------------------------------------------------------------


#: the worker's schedule (``--factor-update-steps``, ``--inv-update-steps`` defaults)
FACTOR_EVERY, INV_EVERY = 5, 50


def step_kinds(v: dict[str, Any]) -> dict[str, float]:
    """Rank 0's mean step time by kind over the timed window: ``plain`` (no factor statistics),
    ``factor`` (statistics collected, no decomposition), ``decomposition`` (both)."""
    kinds: dict[str, list[float]] = {"plain": [], "factor": [], "decomposition": []}
    for i, t in enumerate(v["step_s"], start=v["warmup"]):
        kind = "decomposition" if i % INV_EVERY == 0 else "factor" if i % FACTOR_EVERY == 0 else "plain"
        kinds[kind].append(t)
    return {k: sum(ts) / len(ts) for k, ts in kinds.items() if ts}


def shared_floor(ok: dict[str, dict[str, Any]]) -> float | None:
    """The iteration time of the work both libraries do alike, from their own step times:
    every step as cheap as the cheaper library's plain step (forward, backward, the
    preconditioning products, the update), the decomposition step as the cheaper one's.
    Whatever lowcomm does with its hooks and factor traffic, it cannot go below this."""
    if "kfac-pytorch" not in ok or not any(r.startswith("lowcomm") for r in ok):
        return None
    kinds = [step_kinds(v) for r, v in ok.items() if r.startswith("lowcomm") or r == "kfac-pytorch"]
    if not all("plain" in k and "decomposition" in k for k in kinds):
        return None
    plain = min(k["plain"] for k in kinds)
    decomposition = min(k["decomposition"] for k in kinds)
    n = len(next(iter(ok.values()))["step_s"])
    per_window = n // INV_EVERY or 1
    return ((n - per_window) * plain + per_window * decomposition) / n


def _fmt_s(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def render_scenario(doc: dict[str, Any], name: str) -> str:
    runs = {k.split("/", 1)[1]: v for k, v in doc["runs"].items() if k.startswith(name + "/")}
    if not runs:
        return ""
    ok = {r: v for r, v in runs.items() if v.get("status") == "ok"}
    sgd = ok.get("sgd", {}).get("s_per_iter")
    lines = ["| implementation | s / iteration | × SGD's time | forward+backward (s) | preconditioner (s) "
             "| optimizer (s) | plain / factor / decomposition step (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in ROWS:
        if row not in runs:
            continue
        v = runs[row]
        if v.get("status") != "ok":
            lines.append(f"| {LABELS[row]} | failed: {str(v.get('error', '')).strip().splitlines()[-1:] or '?'} "
                         "| | | | | |")
            continue
        ph = v["phases_mean_s"]
        over = f"{v['s_per_iter'] / sgd:.2f}×" if sgd else "–"
        kinds = step_kinds(v)
        by_kind = " / ".join(_fmt_s(kinds.get(k)) for k in ("plain", "factor", "decomposition"))
        lines.append(f"| {LABELS[row]} | {_fmt_s(v['s_per_iter'])} | {over} | {_fmt_s(ph['forward_backward'])} "
                     f"| {_fmt_s(ph['preconditioner'])} | {_fmt_s(ph['optimizer'])} | {by_kind} |")
    checks = []
    for row, base, need in TARGETS[name]:
        if row in ok and base in ok:
            got = ok[base]["s_per_iter"] / ok[row]["s_per_iter"]
            verdict = "no target" if need is None else f"target ≥ {need}×: {'PASS' if got >= need else 'FAIL'}"
            checks.append(f"- `{row}` vs `{base}`: **{got:.2f}×** faster per iteration ({verdict})")
        else:
            checks.append(f"- `{row}` vs `{base}`: not measured (a row is missing or failed)")
    floor = shared_floor(ok)
    if floor is not None:
        best = ok["kfac-pytorch"]["s_per_iter"] / floor
        checks.append(f"- The work both libraries do alike (every step at the cheaper plain step, the "
                      f"decomposition step at the cheaper one): {floor:.3f} s / iteration, so no change to "
                      f"lowcomm's hooks or factor traffic can make it more than **{best:.2f}×** faster than "
                      f"kfac-pytorch here")
    any_v = next(iter(ok.values()), next(iter(runs.values())))
    net = any_v.get("network", {})
    netline = (f"emulated {net.get('label')} (measured {net['measured_bits_per_s'] / 1e6:.0f} Mbit/s)"
               if net.get("emulated") else f"loopback ({net.get('note', '')})")
    m = any_v.get("machine", {})
    py = any_v.get("python", {})
    nproc = SCENARIOS[name][0]
    spread = [max(v["s_per_iter_by_rank"]) / min(v["s_per_iter_by_rank"]) for v in ok.values()]
    return "\n".join([
        f"### {name}: {nproc} workers, {netline}", "",
        *lines, "",
        *checks, "",
        f"Machine: {m.get('cpu')}, {m.get('cpu_count')} cores, torch {py.get('torch')}, kfac-pytorch "
        f"{py.get('kfac_pytorch') or 'not installed'}; {nproc} workers, 1 torch thread each, gloo "
        f"(its threads share the cores with the compute); load average {m.get('load_avg_1m', 0):.1f} when "
        f"the last row started. Per row: {any_v.get('warmup')} warm-up steps, then the mean over "
        f"{any_v.get('steps')} timed steps (wall-clock between two barriers; the ranks' means differ by at "
        f"most {100 * (max(spread, default=1) - 1):.0f} %). Synthetic CIFAR-shaped input: timing only. "
        f"Commit {acc.short_commit(any_v.get('git_commit'))}.",
    ])


def render_all(doc: dict[str, Any]) -> str:
    parts = [render_scenario(doc, s) for s in SCENARIOS]
    body = "\n\n".join(p for p in parts if p)
    return ("_Generated by `benchmarks/kfac_iteration.py` from `benchmarks/results/kfac_iteration.json`; "
            "do not edit by hand._\n\n" + (body or "Not run yet."))


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter of every row (the kfac-pytorch rows need kfac-pytorch in it)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=35)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--symmetric", action="store_true", help="upper-triangle factors in both libraries")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per row")
    ap.add_argument("--force", action="store_true", help="re-run rows already in --out")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    doc = acc.load(args.out) if args.out.exists() else {"benchmark": "kfac_iteration", "runs": {}}
    if not args.table_only:
        for name in args.scenarios:
            run_scenario(name, args, doc)
    acc.write_doc(args.doc, BLOCK, render_all(doc))
    print(render_all(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

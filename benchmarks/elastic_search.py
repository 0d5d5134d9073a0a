"""Latency-constrained search vs. random sampling, and the latency predictor vs. direct timing.

On a supernet trained by ``benchmarks/elastic_pareto.py --keep FILE``:

1. The latency lookup table is measured on this machine (units of the largest, the smallest
   and ``--table-samples`` random sub-networks, ``--rounds`` interleaved rounds of ``--repeats``
   runs each; a ``--fit`` correction from the largest, the smallest and ``--calibrate`` random
   networks timed whole); then ``--unseen`` other random sub-networks are timed whole (the same
   rounds, interleaved) and compared with the prediction (the table never saw them whole).
2. Three budgets at 25 / 50 / 75 % of the way between the smallest and the largest network's
   predicted latency: ``lowcomm elastic search`` (evolution with OFA's accuracy predictor, or
   ``--score direct``) against the best of ``--random`` random sub-networks under the same
   budget (chosen by the same held-out score, measured directly). Both search under the budget
   less ``--latency-margin`` (predicted), and both answers are verified on this machine
   (``--verify``: the best candidates timed whole, the best one within the full budget kept),
   timed again in a fresh process, and measured on the test set.

Writes ``benchmarks/results/elastic_search_<task>.json``, the tables in ``docs/elastic.md``
(between the ``elastic-search-<task>`` markers) and ``docs/img/elastic_search_<task>.png``.

    .venv/bin/python benchmarks/elastic_search.py --supernet runs/stereo_supernet.pt --task stereo

Run it alone on the machine: the latencies are timings.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: machine, git commit)

REPO = acc.REPO
DOC = REPO / "docs" / "elastic.md"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--supernet", required=True)
    ap.add_argument("--task", default="stereo")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unseen", type=int, default=20)
    ap.add_argument("--table-samples", type=int, default=30)
    ap.add_argument("--random", type=int, default=50)
    ap.add_argument("--score", default="predictor")
    ap.add_argument("--predictor-samples", type=int, default=100)
    ap.add_argument("--population", type=int, default=100)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--valid-size", type=int, default=1000)
    ap.add_argument("--latency-shape", default=None)
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per unit or network per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (min over all of them)")
    ap.add_argument("--fit", choices=("none", "offset", "scale", "affine"), default="scale")
    ap.add_argument("--calibrate", type=int, default=3, help="random networks timed whole for the fit (plus the extremes)")
    ap.add_argument("--verify", type=int, default=5, help="`elastic search --verify`: candidates timed whole per chunk")
    ap.add_argument("--latency-margin", type=float, default=0.05,
                    help="`elastic search --latency-margin`: search under the predicted budget less this fraction")
    ap.add_argument("--latency-only", action="store_true",
                    help="only re-measure the table and the predictor check (the machine idle); keep the recorded "
                         "search, which is then labelled with the table it ran with")
    args = ap.parse_args()

    import torch

    from lowcomm.elastic.latency import LatencyTable, device_name, validate
    from lowcomm.elastic.search_cli import load_for_search

    torch.set_num_threads(args.threads)
    net, blob, bundle = load_for_search(argparse.Namespace(supernet=args.supernet, data_dir=None))
    shape = tuple(int(s) for s in args.latency_shape.split(",")) if args.latency_shape else tuple(bundle.input_shape)
    space = net.space
    with tempfile.TemporaryDirectory() as tmp:
        table_path = Path(tmp) / "latency.json"
        rng = random.Random(args.seed + 100)
        calibration = [space.max_config(), space.min_config()]
        unseen: list[dict[str, Any]] = []
        known = {json.dumps(space.canonical(c), sort_keys=True) for c in calibration}
        while len(unseen) < args.unseen + args.calibrate:
            c = space.canonical(space.sample(rng))
            if json.dumps(c, sort_keys=True) not in known:
                known.add(json.dumps(c, sort_keys=True))
                unseen.append(c)
        calibration += unseen[args.unseen:]
        unseen = unseen[:args.unseen]
        table = LatencyTable.measure(net, space, shape, samples=args.table_samples, seed=args.seed,
                                     threads=args.threads, stat="min", repeats=args.repeats, rounds=args.rounds,
                                     calibrate=calibration if args.fit != "none" else (),
                                     fit=args.fit if args.fit != "none" else "offset")
        table.save(table_path)
        checks = validate(table, net, unseen, shape)
        table_info = {"units": len(table.units), "scale": table.scale, "overhead_ms": table.overhead_ms,
                      "samples": args.table_samples, "fit": args.fit, "calibration_networks": len(table.calibration),
                      "repeats": args.repeats, "rounds": args.rounds, "stat": "min",
                      "allocator": getattr(table.timer, "allocator", None)}
        results = REPO / "benchmarks" / "results" / f"elastic_search_{args.task}.json"
        if args.latency_only:
            doc = json.loads(results.read_text())
            search_table = doc.get("search_table", {**doc["table"], "commit": doc["commit"]})
            doc.update({"machine": acc.machine(), "commit": acc.short_commit(acc._git_commit()), "table": table_info,
                        "latency_checks": checks, "search_table": search_table})
            return finish(doc, results, args.task)
        lo, hi = table.predict(space.min_config()), table.predict(space.max_config())
        budgets = [round(lo + (hi - lo) * f, 3) for f in (0.25, 0.5, 0.75)]
        out = Path(tmp) / "search.json"
        cmd = [sys.executable, "-m", "lowcomm", "elastic", "search", "--supernet", args.supernet,
               "--latency-ms", ",".join(str(b) for b in budgets), "--latency-table", str(table_path),
               "--random", str(args.random), "--score", args.score, "--predictor-samples", str(args.predictor_samples),
               "--population", str(args.population), "--iterations", str(args.iterations),
               "--valid-size", str(args.valid_size), "--threads", str(args.threads), "--seed", str(args.seed),
               "--verify", str(args.verify), "--latency-margin", str(args.latency_margin),
               "--measure", "--json", str(out), "--quiet"]
        if args.latency_shape:
            cmd += ["--latency-shape", args.latency_shape]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        search = json.loads(out.read_text())
        retime(args, search, shape)
    doc = {"machine": acc.machine(), "commit": acc.short_commit(acc._git_commit()), "device": device_name("cpu"),
           "task": args.task, "supernet": blob["model"], "threads": args.threads, "latency_shape": list(shape),
           "table": table_info, "latency_checks": checks, "search": search}
    return finish(doc, results, args.task)


RETIME = """
import json, sys
import torch
from lowcomm.elastic.artifacts import load_supernet
from lowcomm.elastic.latency_timer import WallTimer, time_interleaved
torch.set_num_threads(1)
job = json.loads(sys.argv[1])
net, _ = load_supernet(job["supernet"])
timer = WallTimer(job["repeats"], 5, job["threads"], stat="min")
items = [(net.extract(c), [(1, *job["shape"])]) for c in job["configs"]]
print(json.dumps(time_interleaved(timer, items, job["rounds"], "min")))
"""


def retime(args: argparse.Namespace, search: dict[str, Any], shape: tuple[int, ...]) -> None:
    """Every answer timed again whole in a fresh process (an independent check of the search's
    own timing, which ran after hours of evaluation in one process): ``retimed_ms``."""
    answers = [row[label] for row in search["budgets"] for label in ("search", "random") if label in row]
    job = {"supernet": args.supernet, "configs": [a["config"] for a in answers], "shape": list(shape),
           "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds}
    done = subprocess.run([sys.executable, "-c", RETIME, json.dumps(job)], check=True, capture_output=True, text=True)
    for answer, ms in zip(answers, json.loads(done.stdout.strip().splitlines()[-1])):
        answer["retimed_ms"] = ms


def finish(doc: dict[str, Any], results: Path, task: str) -> int:
    """Write the JSON, the doc block and the plot."""
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(doc, indent=2) + "\n")
    block = markdown(doc)
    print(block)
    if DOC.exists():
        acc.write_doc(DOC, f"elastic-search-{task}", block)
    plot(doc, REPO / "docs" / "img" / f"elastic_search_{task}.png")
    return 0


def _timing(table: dict[str, Any]) -> str:
    if "rounds" not in table:  # recorded before interleaved rounds existed
        return "median of 20 runs"
    text = f"{table['stat']} of {table['rounds']} interleaved rounds x {table['repeats']} runs (networks timed the same way)"
    return text + (f"; CPU memory: {table['allocator']}" if table.get("allocator") else "")


def _fit(table: dict[str, Any]) -> str:
    fit = table.get("fit", "affine")
    if fit == "none":
        return "no correction (the prediction is the sum of unit times)"
    n = table.get("calibration_networks", 2)
    which = "the largest and the smallest" if n == 2 else "the largest, the smallest and random ones"
    return (f"{fit} correction (scale {table['scale']:.3f}, offset {table['overhead_ms']:.3f} ms) fitted on {n} "
            f"networks timed whole ({which}, none of them among the checked)")


def _metric(test: dict[str, float]) -> tuple[str, float, bool]:
    return ("epe", test["epe"], True) if "epe" in test else ("accuracy", test["accuracy"], False)


def _latency(answer: dict[str, Any]) -> str:
    """measured / retimed / predicted, ms (a dash where a run did not record one)."""
    cells = [f"{answer[k]:.2f}" if k in answer else "-" for k in ("measured_ms", "retimed_ms", "predicted_ms")]
    return " / ".join(cells) + " ms"


def markdown(doc: dict[str, Any]) -> str:
    """The two tables for docs/elastic.md."""
    m, s = doc["machine"], doc["search"]
    checks = doc["latency_checks"]
    errs = [abs(c["rel_error"]) for c in checks]
    within = sum(e <= 0.10 for e in errs)
    out = ["_Generated by `benchmarks/elastic_search.py` from `benchmarks/results/elastic_search_"
           f"{doc['task']}.json`; do not edit by hand._", "",
           f"`{doc['supernet']}`; latency at batch 1, input {tuple(doc['latency_shape'])}, {doc['threads']} threads "
           f"on {m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}; commit {doc['commit']}. Lookup table: "
           f"{doc['table']['units']} unit timings, {_timing(doc['table'])}; {_fit(doc['table'])}.", "",
           f"**Latency predictor** on {len(checks)} random sub-networks it never timed whole: {within} of {len(checks)} "
           f"within 10 % (target: all), median error {100 * sorted(errs)[len(errs) // 2]:.1f} %, worst "
           f"{100 * max(errs):.1f} %.", "",
           f"**Search vs. random** ({s['score']['kind']} scoring"
           + (f", predictor on {s['score']['samples']} sub-networks, held-out rank correlation "
              f"{s['score']['holdout_rank_correlation']:.2f}" if s['score']['kind'] == 'predictor' and
              s['score'].get('holdout_rank_correlation') is not None else "")
           + f"; evolution population {s['population']}, {s['iterations']} iterations; random: best of "
             f"{s['random_samples']} under the budget by held-out score"
           + (f"; recorded at commit {doc['search_table']['commit']} with that run's own lookup table, "
              f"{_timing(doc['search_table'])}, {_fit(doc['search_table'])}" if "search_table" in doc else "")
           + "):", "",
           "Latency columns: timed whole in the search (`--verify`: the best candidates timed, the best one "
           "within the budget kept) / timed again in a fresh process / predicted by the table.", "",
           "| budget | search: latency | search: test | random best: latency | random best: test | search wins |",
           "|---:|---:|---:|---:|---:|:---:|"]
    for row in s["budgets"]:
        a, r = row["search"], row["random"]
        name, av, low = _metric(a["test"])
        _, rv, _ = _metric(r["test"])
        fmt = (lambda v: f"EPE {v:.3f}") if name == "epe" else (lambda v: f"{100 * v:.2f} %")
        out.append(f"| {row['budget_ms']:.2f} ms | {_latency(a)} | {fmt(av)} | {_latency(r)} | {fmt(rv)} | "
                   f"{'✓' if row['search_beats_random_on_test'] else '✗'} |")
    return "\n".join(out + _answers_summary(s))


def _answers_summary(search: dict[str, Any]) -> list[str]:
    """How the answers' latencies held up (verified, re-timed, predicted), when recorded."""
    answers = [(row["budget_ms"], row[label]) for row in search["budgets"] for label in ("search", "random")
               if label in row and "retimed_ms" in row[label]]
    if not answers:
        return []
    n = len(answers)
    fits = sum(a["retimed_ms"] <= budget for budget, a in answers)
    close = sum(abs(a["predicted_ms"] - a["retimed_ms"]) <= 0.10 * a["retimed_ms"] for _, a in answers)
    verified = sum(bool(a.get("verify", {}).get("meets_budget")) for _, a in answers)
    changed = sum(bool(a.get("verify", {}).get("changed_answer")) for _, a in answers)
    margin = search.get("latency_margin") or 0.0
    return ["", f"Answers: both searches ran under the predicted budget less {100 * margin:.0f} %; {verified} "
                f"of {n} answers verified within the full budget in the search (the best of the top "
                f"{search.get('verify', 0)} candidates timed whole; {changed} of {n} differ from the unverified "
                f"best), {fits} of {n} within their budget timed again in a fresh process, {close} of {n} "
                f"predicted within 10 % of that timing."]


def plot(doc: dict[str, Any], path: Path) -> None:
    """Predicted vs measured latency; search and random answers per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    checks = doc["latency_checks"]
    xs = [c["measured_ms"] for c in checks]
    a1.scatter(xs, [c["predicted_ms"] for c in checks], s=12)
    lim = [0, max(xs + [c["predicted_ms"] for c in checks]) * 1.05]
    a1.plot(lim, lim, "k--", lw=0.8)
    a1.plot(lim, [v * 1.1 for v in lim], ":", color="gray", lw=0.8)
    a1.plot(lim, [v * 0.9 for v in lim], ":", color="gray", lw=0.8)
    a1.set_xlabel("measured latency (ms)")
    a1.set_ylabel("predicted latency (ms)")
    a1.set_title("latency lookup table, unseen sub-networks")
    rows = doc["search"]["budgets"]
    name = _metric(rows[0]["search"]["test"])[0]
    scale = 1.0 if name == "epe" else 100.0
    for label, marker in (("search", "o"), ("random", "s")):
        a2.plot([r["budget_ms"] for r in rows], [scale * _metric(r[label]["test"])[1] for r in rows], marker + "-",
                label=label if label == "search" else f"best of {doc['search']['random_samples']} random")
    a2.set_xlabel("latency budget (ms)")
    a2.set_ylabel("test EPE (px)" if name == "epe" else "test accuracy (%)")
    a2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())

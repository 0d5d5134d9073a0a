"""Elastic supernet vs. the same architectures trained alone: the metric-latency Pareto front.

1. ``lowcomm elastic train`` trains one supernet with progressive shrinking (``--epochs`` in
   total over the phases, EASNet's phase ratio unless ``--phases``).
2. A latency table is measured on this machine; ``--archs`` sub-networks spanning the latency
   range are chosen (the smallest, the largest and random ones at evenly spaced latency
   quantiles); each is extracted (weights copied, BN re-calibrated) and scored on the test set.
3. Each of those architectures is trained alone from fresh weights (``--scratch``) for the same
   number of epochs as the whole supernet, with the same optimizer and data.
4. Each extracted network is also timed whole (batch 1, ``--latency-shape``).

Writes ``benchmarks/results/elastic_pareto_<task>.json``, the table in ``docs/elastic.md``
(between the ``elastic-pareto-<task>`` markers) and ``docs/img/elastic_pareto_<task>.png``.
Keep the supernet file (``--keep``) for ``benchmarks/elastic_search.py``.

    .venv/bin/python benchmarks/elastic_pareto.py --task stereo       # EASNet's phase ratio
    .venv/bin/python benchmarks/elastic_pareto.py --task stereo --epochs 12 --variant late \
        --phases full:1,kernel:1,depth:1,expand:1,scales:8 --supernet-arg=--sandwich \
        --data-arg train_size=1000 --data-arg test_size=200 --latency-shape 6,128,256 \
        --keep late.pt                                                # the split that met the target
    .venv/bin/python benchmarks/elastic_pareto.py --task classifier

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
LOGS = Path(tempfile.gettempdir()) / "lowcomm-elastic-bench"  # per-step logs, to follow a long run

TASKS: dict[str, dict[str, Any]] = {
    "stereo": {"model": "elastic_stereo", "data": "stereo", "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0,
               "batch_size": 8, "metric": "epe", "lower_is_better": True, "data_args": []},
    "classifier": {"model": "elastic_cnn1d", "data": "mnist1d", "optimizer": "sgd", "lr": 0.05, "weight_decay": 5e-4,
                   "batch_size": 32, "metric": "accuracy", "lower_is_better": False, "data_args": []},
}


def train(args: argparse.Namespace, task: dict[str, Any], work: Path, name: str, *extra: str) -> dict[str, Any]:
    """One ``lowcomm elastic train`` run; its JSON summary."""
    out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "lowcomm", "elastic", "train", "--model", task["model"], "--data", task["data"],
           "--optimizer", task["optimizer"], "--lr", str(task["lr"]), "--weight-decay", str(task["weight_decay"]),
           "--batch-size", str(task["batch_size"]), "--nproc", str(args.nproc), "--seed", str(args.seed),
           "--threads", str(args.threads), "--no-progress", "--quiet", "--json", str(out), *task["data_args"],
           "--log", str(LOGS / f"{args.task}-{name}.jsonl"),
           *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return dict(json.loads(out.read_text()))


def choose(net: Any, table: Any, n: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` architectures spread over the latency range: min, max and random ones nearest to
    evenly spaced predicted latencies (from 400 random samples)."""
    space = net.space
    rng = random.Random(seed)
    pool = {json.dumps(space.canonical(space.sample(rng)), sort_keys=True) for _ in range(400)}
    scored = sorted(((table.predict(json.loads(c)), json.loads(c)) for c in pool), key=lambda t: t[0])
    lo, hi = table.predict(space.min_config()), table.predict(space.max_config())
    chosen = [space.canonical(space.min_config())]
    for i in range(1, n - 1):
        target = lo + (hi - lo) * i / (n - 1)
        best = min(scored, key=lambda t: abs(t[0] - target))[1]
        if best not in chosen:
            chosen.append(best)
    chosen.append(space.canonical(space.max_config()))
    return chosen


LATENCY = {"threads": 1, "stat": "min", "repeats": 10, "rounds": 5}
LATENCY_CALIBRATION = 3  # random networks timed whole for the table's scale fit (none of the rows)


def measure_table(net: Any, shape: tuple[int, ...], seed: int, *, calibrate: int = 0,
                  avoid: list[dict[str, list[int]]] | None = None) -> Any:
    """The lookup table of this machine (units of the extremes and 30 random sub-networks); with
    ``calibrate``, scale-corrected on that many other random networks (none of ``avoid``) timed
    whole, as ``elastic_search.py`` does, so that "predicted" means what the search would predict."""
    from lowcomm.elastic.latency import LatencyTable

    rng = random.Random(seed + 200)
    skip = [net.space.canonical(c) for c in avoid or []]
    others: list[dict[str, list[int]]] = []
    while len(others) < calibrate:
        config = net.space.canonical(net.space.sample(rng))
        if config not in skip:
            others.append(config)
    return LatencyTable.measure(net, net.space, shape, samples=30, seed=seed, threads=LATENCY["threads"],
                                stat=LATENCY["stat"], repeats=LATENCY["repeats"], rounds=LATENCY["rounds"],
                                calibrate=others, fit="scale")


def add_latency(doc: dict[str, Any], supernet: Path) -> None:
    """Time every row's architecture whole and by the table (run alone on the machine)."""
    from lowcomm.elastic.artifacts import load_supernet
    from lowcomm.elastic.latency import device_name

    net, _ = load_supernet(supernet)
    shape = tuple(doc["setup"]["latency_shape"])
    table = measure_table(net, shape, doc["setup"]["seed"], calibrate=LATENCY_CALIBRATION,
                          avoid=[row["config"] for row in doc["rows"]])
    measured = table.time_whole([row["config"] for row in doc["rows"]])  # interleaved, as the units
    for row, ms in zip(doc["rows"], measured):
        row["predicted_ms"] = table.predict(row["config"])
        row["measured_ms"] = ms
    doc["latency"] = {**LATENCY, "device": device_name("cpu"), "batch": 1, "fit": "scale",
                      "calibration_networks": LATENCY_CALIBRATION, "scale": table.scale}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="stereo")
    ap.add_argument("--epochs", type=int, default=16, help="epochs of the whole supernet run (and of each scratch run)")
    ap.add_argument("--phases", default=None)
    ap.add_argument("--subnets", default=None)
    ap.add_argument("--archs", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latency-shape", default=None)
    ap.add_argument("--keep", required=True, help="the trained supernet file (kept for elastic_search.py)")
    ap.add_argument("--data-arg", action="append", default=[])
    ap.add_argument("--supernet-arg", action="append", default=[],
                    help="an extra `lowcomm elastic train` flag for the supernet only, e.g. --supernet-arg=--sandwich")
    ap.add_argument("--same-as", default=None,
                    help="a results JSON: score its architectures, and reuse its from-scratch results where the "
                         "training setup is identical (a recipe change of the supernet only, compared like for like)")
    ap.add_argument("--reuse-supernet", action="store_true",
                    help="--keep already holds this recipe's trained supernet (and KEEP.json its summary): skip training")
    ap.add_argument("--variant", default=None,
                    help="name of this recipe: results, doc block and plot get the suffix -VARIANT")
    ap.add_argument("--latency-only", action="store_true",
                    help="only (re)time the recorded rows' architectures (the machine idle), then write the docs")
    args = ap.parse_args()
    task = dict(TASKS[args.task])
    for item in args.data_arg:
        task["data_args"] = [*task["data_args"], "--data-arg", item]
    name = f"{args.task}-{args.variant}" if args.variant else args.task
    results = REPO / "benchmarks" / "results" / f"elastic_pareto_{name}.json"
    LOGS.mkdir(exist_ok=True)
    sup_path = Path(args.keep)
    if args.latency_only:
        doc = json.loads(results.read_text())
    else:
        doc = train_rows(args, task, sup_path)
        doc["name"] = name
    add_latency(doc, sup_path)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(doc, indent=2) + "\n")
    block = markdown(doc)
    print(block)
    if DOC.exists():
        acc.write_doc(DOC, f"elastic-pareto-{name}", block)
    plot(doc, REPO / "docs" / "img" / f"elastic_pareto_{name}.png")
    return 0


def train_rows(args: argparse.Namespace, task: dict[str, Any], sup_path: Path) -> dict[str, Any]:
    """Train the supernet, choose the architectures, score them extracted and from scratch."""
    import torch

    from lowcomm.elastic.search_cli import SubnetScorer, load_for_search

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        extra = ["--epochs", str(args.epochs), "--out", str(sup_path)]
        if args.phases:
            extra += ["--phases", args.phases]
        if args.subnets:
            extra += ["--subnets", args.subnets]
        extra += args.supernet_arg
        summary = sup_path.with_name(sup_path.name + ".json")
        if args.reuse_supernet:
            sup = dict(json.loads(summary.read_text()))
        else:
            sup = train(args, task, work, "supernet", *extra)
            summary.write_text(json.dumps(sup))
        net, blob, bundle = load_for_search(argparse.Namespace(supernet=str(sup_path), data_dir=None))
        shape = tuple(int(s) for s in args.latency_shape.split(",")) if args.latency_shape else tuple(bundle.input_shape)
        table = measure_table(net, shape, args.seed)  # only to spread the choice over the latency range
        scorer = SubnetScorer(net, bundle, valid_size=1000, bn_batches=10, batch_size=task["batch_size"],
                              seed=args.seed)
        setup = {**task, "epochs": sup["epochs"], "threads": args.threads, "nproc": args.nproc, "seed": args.seed}
        earlier = json.loads(Path(args.same_as).read_text()) if args.same_as else None
        configs = [r["config"] for r in earlier["rows"]] if earlier else choose(net, table, args.archs, args.seed)
        rows = []
        for config in configs:
            extracted = scorer.test(config)
            sub = net.extract(config)
            row = {"config": config, "params": sum(p.numel() for p in sub.parameters()), "extracted": extracted}
            reused = reusable_scratch(earlier, setup, config) if earlier else None
            if reused is not None:
                row.update(reused, scratch_from=f"{Path(args.same_as).name} (commit {earlier['commit']})")
            else:
                scratch = train(args, task, work, f"scratch{len(rows)}", "--epochs", str(sup["epochs"]),
                                "--scratch", json.dumps(config))
                row.update(scratch=scratch_metrics(scratch, task["metric"]), scratch_wall_s=scratch.get("wall_s"))
            rows.append(row)
    return {"machine": acc.machine(), "commit": acc.short_commit(acc._git_commit()),
            "task": args.task, "setup": {**task, "epochs": sup["epochs"], "phases": sup["phases"],
                                         "threads": args.threads, "nproc": args.nproc, "latency_shape": list(shape),
                                         "seed": args.seed, "supernet_args": args.supernet_arg},
            "supernet_wall_s": sup.get("wall_s"), "rows": rows}


#: What must be equal for a from-scratch run of an earlier results file to be this run's.
SCRATCH_SETUP = ("model", "data", "data_args", "optimizer", "lr", "weight_decay", "batch_size", "epochs", "threads",
                 "nproc", "seed")


def reusable_scratch(earlier: dict[str, Any], setup: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
    """The earlier file's from-scratch result of ``config`` if it was trained exactly as this run would train it
    (the from-scratch run does not depend on the supernet's recipe), else None."""
    if any(earlier["setup"].get(k) != setup.get(k) for k in SCRATCH_SETUP):
        return None
    row = next((r for r in earlier["rows"] if r["config"] == config), None)
    return None if row is None else {"scratch": row["scratch"], "scratch_wall_s": row.get("scratch_wall_s")}


def scratch_metrics(summary: dict[str, Any], metric: str) -> dict[str, float]:
    """The from-scratch run's final test metrics, named as the scorer names them."""
    if metric == "epe":
        return {"epe": summary["final_test_metric"], "d1": summary.get("final_test_d1")}
    return {"accuracy": summary["final_test_accuracy"]}


def gap(row: dict[str, Any], metric: str, lower_is_better: bool) -> float:
    """Relative gap of the extracted network to the one trained alone (positive = worse)."""
    e, s = row["extracted"][metric], row["scratch"][metric]
    return (e - s) / s if lower_is_better else (s - e) / s


def markdown(doc: dict[str, Any]) -> str:
    """The table for docs/elastic.md."""
    t, m = doc["setup"], doc["machine"]
    metric, low = t["metric"], t["lower_is_better"]
    fmt = (lambda v: f"{v:.3f} px") if metric == "epe" else (lambda v: f"{100 * v:.2f} %")
    rows = doc["rows"]
    lat = [r["measured_ms"] for r in rows]
    phases = ", ".join(f"{p['name']} {p['epochs']}" for p in t["phases"])
    out = ["_Generated by `benchmarks/elastic_pareto.py` from `benchmarks/results/elastic_pareto_"
           f"{doc.get('name', doc['task'])}.json`; do not edit by hand._", "",
           f"`{t['model']}` on `{t['data']}`: supernet trained {t['epochs']} epochs in all ({phases})"
           + (f" with `{' '.join(t['supernet_args'])}`" if t.get("supernet_args") else "") + "; each "
           f"architecture alone from scratch for the same {t['epochs']} epochs; {t['optimizer']} lr {t['lr']}, batch "
           f"{t['batch_size']} per worker, seed {t['seed']}, {t['nproc']} worker(s). Latency: batch 1, input "
           f"{tuple(t['latency_shape'])}, {doc['latency']['threads']} thread(s), {doc['latency']['stat']} of "
           f"{doc['latency'].get('rounds', 1)} round(s) x {doc['latency']['repeats']} runs"
           + (f"; predicted by the lookup table scaled by {doc['latency']['scale']:.3f}, fitted on "
              f"{doc['latency']['calibration_networks']} other random networks timed whole"
              if "scale" in doc["latency"] else "; predicted: the lookup table's sum, uncorrected")
           + f". Machine: {m['cpu']}, "
           f"{m['cpu_count']} cores, torch {m['torch']}; commit {doc['commit']}.", "",
           f"| architecture | parameters | latency measured (predicted) | extracted {metric} | from scratch {metric} | "
           f"gap (target ≤ 5 %) |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        g = gap(r, metric, low)
        out.append(f"| `{json.dumps(r['config'], separators=(',', ':'))}` | {r['params']:,} | {r['measured_ms']:.2f} ms "
                   f"({r['predicted_ms']:.2f}) | {fmt(r['extracted'][metric])} | {fmt(r['scratch'][metric])} | "
                   f"{100 * g:+.1f} % {'✓' if g <= 0.05 else '✗'} |")
    within = sum(gap(r, metric, low) <= 0.05 for r in rows)
    out += ["", f"Latency range {max(lat) / min(lat):.2f}x (target ≥ 3x); {within} of {len(rows)} extracted "
                f"networks within 5 % of the same architecture trained alone."]
    return "\n".join(out)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Metric against measured latency, extracted and from scratch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = doc["setup"]["metric"]
    scale = 1.0 if metric == "epe" else 100.0
    rows = sorted(doc["rows"], key=lambda r: r["measured_ms"])
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["measured_ms"] for r in rows]
    ax.plot(xs, [scale * r["extracted"][metric] for r in rows], "o-", label="extracted from the supernet")
    ax.plot(xs, [scale * r["scratch"][metric] for r in rows], "s--", label="same architecture, trained alone")
    ax.set_xlabel(f"latency (ms, batch 1, {doc['latency']['threads']} thread(s), {doc['latency']['device']})")
    ax.set_ylabel("test EPE (px)" if metric == "epe" else "test accuracy (%)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())

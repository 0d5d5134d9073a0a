"""lee18 in full (issue 20): per-layer shard update and model-parallel FC against DDP and DeAR.

What it runs: ``lowcomm bench`` (each worker in its own shaped network namespace when root,
loopback otherwise) at ``--nproc`` workers, once per workload, with the methods

    ssgd, dear, lee18:update=step,fc=data_parallel, lee18:update=layer,fc=data_parallel,
    lee18:update=step,fc=model_parallel, lee18:update=layer,fc=model_parallel

(``update=`` is helper lee-shard's per-layer update; ``fc=`` the model-parallel FC layers,
:mod:`lowcomm.parallel.lee18_fc`). Workloads, all synthetic input (timing only):

* ``vgg16_imagenet`` (138 M parameters, 124 M of them in the FC head) and ``resnet50``
  (``resnet50_imagenet``, 2048x1000 head), 224x224, compute emulated from the shipped V100
  profile re-spread to the batch (:func:`lowcomm.sim.gpu_profiles.build_profile`): the
  parameters, gradients and collectives are real, the layers wait what a V100 would take;
* ``vgg16`` (CIFAR form, 32x32, 512-wide head), compute emulated from this machine's own
  profile divided by ``--scale`` (there is no GPU profile of the CIFAR form).

Beside each measured row: the simulator's prediction for the same profile, network and
method (:func:`lowcomm.sim.predict.predict_iteration_time`). The JSON goes to ``--out``, the
tables into ``docs/scheduling.md`` between ``<!-- lee18-vgg:begin -->`` and
``<!-- lee18-vgg:end -->``. ``--table-only`` re-renders the doc from ``--out``.

    .venv/bin/python benchmarks/lee18_vgg.py                       # the full matrix (lead)
    .venv/bin/python benchmarks/lee18_vgg.py --smoke --out /tmp/s.json --doc /tmp/s.md   # minutes

Run it alone on the machine: timings beside other work are not results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: machine, commit, doc block helpers)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "lee18_vgg.json"
DOC = ROOT / "docs" / "scheduling.md"
BLOCK = "lee18-vgg"
METHODS = [
    "ssgd",
    "dear",
    "lee18:update=step,fc=data_parallel",
    "lee18:update=layer,fc=data_parallel",
    "lee18:update=step,fc=model_parallel",
    "lee18:update=layer,fc=model_parallel",
]


@dataclass(frozen=True)
class Workload:
    """One model as the bench runs it; ``gpu_model`` names a shipped GPU profile (else scale=K)."""

    label: str
    model: str
    input_shape: str
    gpu_model: str | None
    model_args: tuple[str, ...] = ()


WORKLOADS = {
    "vgg16_imagenet": Workload("VGG-16 (ImageNet form, 138.4 M)", "vgg16_imagenet", "3,224,224", "vgg16",
                               ("num_classes=1000",)),
    "resnet50": Workload("ResNet-50 (ImageNet form, 25.6 M)", "resnet50_imagenet", "3,224,224", "resnet50",
                         ("num_classes=1000",)),
    "vgg16": Workload("VGG-16 (CIFAR form, 15.2 M)", "vgg16", "3,32,32", None),
}


def gpu_profile(w: Workload, device: str, batch: int, work: Path) -> Path:
    """The shipped GPU profile of ``w`` re-spread to ``batch``, written for ``--compute``."""
    from lowcomm.sim.gpu_profiles import build_profile

    path = work / f"{device}-{w.model}-b{batch}.json"
    assert w.gpu_model is not None
    build_profile(device, w.gpu_model, batch_size=batch).save(path)
    return path


def predictions(profile_path: Path, methods: list[str], nproc: int, net: str) -> dict[str, float]:
    """The simulator's iteration time per method for the profile the run emulated."""
    from lowcomm.sim.network import NetworkModel
    from lowcomm.sim.predict import predict_iteration_time
    from lowcomm.sim.profile import Profile

    prof = Profile.load(profile_path)
    network = NetworkModel.preset(net) if net != "none" else NetworkModel.preset("10gbit")
    return {m: predict_iteration_time(prof, m, workers=nproc, network=network).iter_time_s for m in methods}


def run_workload(key: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One ``lowcomm bench`` over every method for workload ``key``; its JSON plus predictions."""
    w = WORKLOADS[key]
    out = work / f"{key}.json"
    profile = gpu_profile(w, args.device, args.batch_size, work) if w.gpu_model else None
    compute = f"emulated:{profile}" if profile else f"emulated:scale={args.scale:g}"
    cmd = [sys.executable, "-m", "lowcomm", "bench", "--nproc", str(args.nproc), "--model", w.model,
           "--input-shape", w.input_shape, "--batch-size", str(args.batch_size),
           "--methods", ",".join(args.methods), "--net", args.net, "--compute", compute,
           "--iters", str(args.iters), "--warmup", str(args.warmup), "--no-predict", "--no-compute-only",
           "--json", str(out), "--quiet", "--work-dir", str(work / key)]
    cmd += [a for kv in w.model_args for a in ("--model-arg", kv)]  # the profile's 1000 classes
    subprocess.run(cmd, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    used = profile
    if used is None:  # the bench's own profile of this machine (scale=K): read its path back
        used = next((Path(r["compute_profile"]["source"]) for r in result["runs"]
                     if isinstance(r.get("compute_profile"), dict) and r["compute_profile"].get("source")), None)
    result["lee18_vgg"] = {
        "workload": key, "label": w.label, "compute": compute,
        "predicted_iter_time_s": predictions(used, args.methods, args.nproc, args.net) if used else {},
    }
    return result


def fmt_mb(b: float | None) -> str:
    """Megabytes per worker per iteration."""
    return "—" if b is None else f"{b / 1e6:.1f}"


def render(doc: dict[str, Any]) -> str:
    """The Markdown block: one table per workload, with where and how it ran."""
    parts = ["_Generated by `benchmarks/lee18_vgg.py` from `benchmarks/results/lee18_vgg.json`; "
             "do not edit by hand._"]
    m = doc.get("machine", {})
    parts.append(f"Machine: {m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores, torch {m.get('torch', '?')}, "
                 f"1-minute load {m.get('load_avg_1m', 0):.1f} at the start, commit {acc.short_commit(doc.get('commit'))}; "
                 f"{doc['nproc']} workers, batch "
                 f"{doc['batch_size']} per worker, network {doc['net']}, {doc['iters']} timed iterations. "
                 "Predicted: the simulator on the same profile "
                 f"({'10gbit for loopback' if doc['net'] == 'none' else doc['net']}).")
    for res in doc["results"].values():
        info = res["lee18_vgg"]
        pred = info["predicted_iter_time_s"]
        runs = {r["method"]: r for r in res["runs"]}
        base = runs.get("ssgd", {}).get("iter_time_s_median")
        lines = [f"### {info['label']}", "", f"Compute `{info['compute'].split('/')[-1]}`.", "",
                 "| method | iter s | speed-up vs DDP | MB/worker/iter | FC model-parallel | predicted iter s |",
                 "|---|---:|---:|---:|---|---:|"]
        for name in doc["methods"]:
            r = runs.get(name)
            if r is None or r.get("status") != "ok":
                lines.append(f"| `{name}` | failed | | | | |")
                continue
            t = r["iter_time_s_median"]
            fc = ", ".join((r.get("method_info") or {}).get("fc_model_parallel") or []) or "—"
            speed = f"{base / t:.2f}x" if base else "—"
            p = pred.get(name)
            lines.append(f"| `{name}` | {t:.3f} | {speed} | {fmt_mb(r.get('bytes_per_worker_per_iter'))} | {fc} | "
                         f"{'—' if p is None else f'{p:.3f}'} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the matrix (or re-render), write the JSON and the doc block."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--net", default="1gbit", help="RATE or none (loopback)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="v100", help="GPU of the shipped profiles (v100, a100, h100)")
    ap.add_argument("--scale", type=float, default=20.0, help="CIFAR VGG-16: this machine's profile / K")
    ap.add_argument("--smoke", action="store_true", help="2 workers, CIFAR VGG-16 only, 2 iterations, loopback")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.nproc, args.workloads, args.iters, args.warmup, args.net = 2, ["vgg16"], 2, 1, "none"
    if not args.table_only:
        doc: dict[str, Any] = {"machine": acc.machine(), "commit": acc._git_commit(), "nproc": args.nproc, "batch_size": args.batch_size,
                               "net": args.net, "iters": args.iters, "methods": args.methods, "results": {}}
        with tempfile.TemporaryDirectory(prefix="lowcomm_lee18_vgg_") as tmp:
            for key in args.workloads:
                doc["results"][key] = run_workload(key, args, Path(tmp))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
    doc = json.loads(args.out.read_text())
    body = render(doc)
    if args.doc.exists() and f"<!-- {BLOCK}:begin -->" in args.doc.read_text():
        acc.write_doc(args.doc, BLOCK, body)
    else:
        args.doc.write_text(f"<!-- {BLOCK}:begin -->\n{body}\n<!-- {BLOCK}:end -->\n")
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

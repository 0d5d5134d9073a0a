"""Optimizer update time: LARS and LAMB on torch's multi-tensor kernels vs a per-parameter loop.

Why: issue 14's target is "fused update >= 2x faster than the per-parameter loop", measured on
ResNet-50's parameters (``resnet50_imagenet``: torchvision's structure, 161 tensors, 25.6 M
elements). Only the optimizer step is timed: the gradients are fixed random tensors set once,
so forward/backward cost nothing and both paths update the same values. Param groups are the
trainer's (:func:`lowcomm.optim.builders.param_groups` with the norm/bias group excluded from
adaptation and decay), so the per-group split is part of what is measured.

Each row: ``--warmup`` untimed steps, then ``--steps`` timed steps (``torch.cuda.synchronize``
around each on CUDA, so queued kernels are counted); the median step time is recorded, with
the 10th/90th percentiles. On CPU the multi-tensor kernels are C++ loops over the tensors
(no one-launch fusion), so the gain there is the Python and dispatch overhead saved; on CUDA
each ``_foreach`` op is one launch for many tensors.

Results: ``benchmarks/results/optim_update.json`` (CPU) or ``optim_update_cuda.json`` (CUDA);
the table goes into ``docs/largebatch.md`` between ``<!-- optim-update:begin -->`` and
``<!-- optim-update:end -->`` (CUDA: the ``optim-update-cuda`` block), so a GPU run keeps the
CPU figures beside it; ``--table-only`` re-renders it from the JSON. Timings depend on the machine (recorded with each result): run
it alone on an otherwise idle machine.

    .venv/bin/python benchmarks/optim_update.py                 # CPU (or --device cuda)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: result file, doc block, machine helpers)

REPO = acc.REPO
RESULTS = REPO / "benchmarks" / "results" / "optim_update.json"
RESULTS_CUDA = REPO / "benchmarks" / "results" / "optim_update_cuda.json"
DOC = REPO / "docs" / "largebatch.md"
BLOCK = "optim-update"
BLOCK_CUDA = "optim-update-cuda"
TARGET = 2.0  # fused >= 2x faster than the per-parameter loop
OPTIMIZERS = ("lars", "lamb")
PATHS = ("foreach", "loop")


def make_optimizer(name: str, params: list[dict[str, Any]], foreach: bool) -> torch.optim.Optimizer:
    """The trainer's defaults for each (LR values do not change the time)."""
    from lowcomm.optim import LAMB, LARS

    if name == "lars":
        return LARS(params, lr=0.1, momentum=0.9, eta=0.001, foreach=foreach)
    return LAMB(params, lr=1e-3, foreach=foreach)


def model_params(device: torch.device, model: str) -> tuple[list[dict[str, Any]], int, int]:
    """The trainer's param groups of ``model`` on ``device``, each with a fixed random gradient."""
    from lowcomm.models import MODELS
    from lowcomm.optim.builders import param_groups

    torch.manual_seed(0)
    net = MODELS.get(model)().to(device)
    for p in net.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    groups = param_groups(net, 5e-5, no_decay_norm_bias=True)
    tensors = sum(len(g["params"]) for g in groups)
    numel = sum(p.numel() for g in groups for p in g["params"])
    return groups, tensors, numel


def time_row(name: str, path: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Median/p10/p90 step time of one optimizer and code path, in milliseconds."""
    groups, tensors, numel = model_params(device, args.model)
    opt = make_optimizer(name, groups, foreach=path == "foreach")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        opt.step()
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"optimizer": name, "path": path, "median_ms": statistics.median(times), "p10_ms": q[0],
            "p90_ms": q[-1], "steps": args.steps, "warmup": args.warmup, "tensors": tensors, "numel": numel}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in OPTIMIZERS:
        for path in PATHS:
            row = time_row(name, path, args, device)
            print(f"{name:5s} {path:8s} {row['median_ms']:9.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})",
                  file=sys.stderr, flush=True)
            rows.append(row)
    machine = acc.machine()
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    shown = " ".join(["python benchmarks/optim_update.py", *(argv_shown(args))])
    return {"benchmark": "optim_update", "model": args.model, "device": device.type,
            "threads": torch.get_num_threads(), "machine": machine, "git_commit": acc._git_commit(),
            "command": shown, "rows": rows}


def argv_shown(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out


def render(doc: dict[str, Any]) -> str:
    """The Markdown block: one line per optimizer, foreach vs loop, speedup and the target."""
    if not doc.get("rows"):
        return "_No result recorded yet: run `python benchmarks/optim_update.py` on an idle machine._"
    by = {(r["optimizer"], r["path"]): r for r in doc["rows"]}
    some = doc["rows"][0]
    m = doc.get("machine", {})
    where = m.get("gpu") or m.get("cpu") or "unknown CPU"
    lines = [
        f"ResNet-50 parameters ({doc['model']}: {some['tensors']} tensors, {some['numel'] / 1e6:.1f} M elements), "
        f"one optimizer step, median of {some['steps']} steps after {some['warmup']} warm-up steps; "
        f"{doc['device']} ({where}, {doc['threads']} threads, torch {m.get('torch', '?')}, "
        f"commit {acc.short_commit(doc.get('git_commit'))}).",
        "",
        "| optimizer | multi-tensor (`_foreach`) | per-parameter loop | speedup | target (fused >= 2x) |",
        "|---|---:|---:|---:|---|",
    ]
    for name in OPTIMIZERS:
        f, lp = by.get((name, "foreach")), by.get((name, "loop"))
        if f is None or lp is None:
            continue
        speed = lp["median_ms"] / f["median_ms"]
        verdict = "met" if speed >= TARGET else "**not met**"
        lines.append(f"| {name.upper()} | {f['median_ms']:.2f} ms | {lp['median_ms']:.2f} ms | "
                     f"{speed:.2f}x | {verdict} |")
    lines += ["", f"Command: `{doc.get('command', 'python benchmarks/optim_update.py')}`."]
    return "\n".join(lines)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--model", default="resnet50_imagenet", help="a lowcomm.models name (shapes only)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default: {RESULTS.name}, or {RESULTS_CUDA.name} for a CUDA run")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--table-only", action="store_true", help="only re-render --doc from --out")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.out is None:
        args.out = RESULTS_CUDA if cuda else RESULTS
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.table_only:
        doc = acc.load(args.out) if args.out.exists() else {}
    else:
        doc = run(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        import json

        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    body = render(doc)
    acc.write_doc(args.doc, BLOCK_CUDA if doc.get("device") == "cuda" else BLOCK, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

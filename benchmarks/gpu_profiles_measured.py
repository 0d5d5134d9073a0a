"""Measure the simulator's GPU compute profiles on a real GPU (``lowcomm.sim`` profiles).

Why: the shipped V100/A100/H100 profiles were *derived* from published throughput
(``lowcomm.sim.gpu_profiles``) because no GPU was at hand; issue 18 asks to replace them by
measured ones whenever a GPU is. This script profiles the same four models at the same batches
with :func:`lowcomm.sim.profiler.profile_model` (per-layer forward/backward from hooks, a
device synchronize at each hook) on ``--device cuda`` and writes one profile JSON per model.

The hooks' synchronizes stall the launch queue, so the hooked step is slower than a plain one.
The plain step (no hooks) is timed too, with CUDA events, and the layer times are scaled by
plain / hooked so that the profile's forward + backward is the real step's; the JSON's
``notes`` keep both figures. Precision: float32 weights, TF32 matrix units on (as in the
published tf32 figures the derived profiles used). Inputs are synthetic (random images /
tokens): compute time does not depend on the values.

    python benchmarks/gpu_profiles_measured.py --device cuda --out-dir DIR [--prefix h100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from lowcomm.sim.gpu_profiles import MODELS, shipped_names  # noqa: E402
from lowcomm.sim.profile import Profile  # noqa: E402
from lowcomm.sim.profiler import profile_model  # noqa: E402


def plain_step_s(model: nn.Module, batch: Callable[[], tuple[Any, Any]],
                 loss_fn: Callable[[Any, Any], torch.Tensor], iters: int) -> float:
    """Median forward + backward seconds with no hooks, timed with CUDA events."""
    x, y = batch()
    times = []
    for k in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        model.zero_grad(set_to_none=True)
        start.record()
        loss_fn(model(x), y).backward()
        end.record()
        torch.cuda.synchronize()
        if k >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # language models: (B, T, V) against (B, T)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.cross_entropy(out, target)


def _inputs(name: str, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name in ("resnet50", "vgg16"):
        return (torch.randn(b, 3, 224, 224, generator=g).to(device),
                torch.randint(0, 1000, (b,), generator=g).to(device))
    if name == "bert-base":
        vocab, seq = 30522, 128
    else:
        from lowcomm import models

        vocab, seq = models.info("lstm_lm").output_size, 35
    return (torch.randint(0, vocab, (b, seq), generator=g).to(device),
            torch.randint(0, vocab, (b, seq), generator=g).to(device))


def measure(name: str, device: torch.device, iters: int, warmup: int, gpu: str) -> Profile:
    """One model's measured profile (and its Pufferfish form where the shipped one has it)."""
    spec = MODELS[name]
    x, y = _inputs(name, spec.batch_size, device)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return x, y

    def one(model: nn.Module, label: str, kernels: bool) -> tuple[Profile, str]:
        torch.manual_seed(0)
        prof = profile_model(model, batch, _loss, model_name=label, batch_size=spec.batch_size,
                             device=device, iters=iters, warmup=warmup, measure_kernels=kernels)
        plain = plain_step_s(model, batch, _loss, iters)
        hooked = prof.forward_s + prof.backward_s
        scale = plain / hooked
        for layer in prof.layers:
            layer.forward_s *= scale
            layer.backward_s *= scale
        note = (f"forward+backward {plain * 1e3:.2f} ms without hooks (CUDA events, median of "
                f"{iters}); {hooked * 1e3:.2f} ms with the profiler's per-layer synchronizes; "
                f"layer times scaled by {scale:.3f}")
        return prof, note

    prof, note = one(spec.make().to(device), spec.model_name, True)
    prof.device = gpu
    prof.notes = (f"measured by benchmarks/gpu_profiles_measured.py on {gpu}, torch "
                  f"{torch.__version__}, fp32 weights with TF32 matrix units; {spec.describe}; "
                  f"batch {spec.batch_size}; synthetic inputs; {note}; optimizer = SGD momentum "
                  f"step timed on the device")
    if spec.factorize:
        from lowcomm.lowrank import factorize

        torch.manual_seed(0)
        small = factorize(spec.make(), inplace=True).to(device)
        fact, fnote = one(small, f"{spec.model_name}:pufferfish", False)
        fact.costs, fact.compressors, fact.device = prof.costs, prof.compressors, gpu
        fact.notes = f"Pufferfish hybrid, measured; {fnote}"
        prof.factorized = fact
    return prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--prefix", default="h100", help="file prefix: PREFIX-MODEL.json")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profiles_measured.py: CUDA is not available; run it on a GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    for name in args.models.split(","):
        if f"{args.prefix}-{name}" not in shipped_names():
            print(f"note: {args.prefix}-{name} is not a shipped profile name", file=sys.stderr)
        prof = measure(name, device, args.iters, args.warmup, gpu)
        prof.save(args.out_dir / f"{args.prefix}-{name}.json")
        row = {"profile": f"{args.prefix}-{name}", "batch": prof.batch_size,
               "forward_ms": prof.forward_s * 1e3, "backward_ms": prof.backward_s * 1e3,
               "optimizer_ms": prof.optimizer_s * 1e3,
               "samples_per_s": prof.batch_size / prof.compute_s}
        if prof.factorized is not None:
            row["factorized_compute_ms"] = prof.factorized.compute_s * 1e3
        summary.append(row)
        print(json.dumps(row), flush=True)
    (args.out_dir / "summary.json").write_text(json.dumps({"device": gpu, "torch": torch.__version__,
                                                         "rows": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

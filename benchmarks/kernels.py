"""Every compressor's kernels against their memory (and matmul) bound, one thread, one process.

For each registered compressor and each model's real gradient shapes (ResNet-18 CIFAR form,
11.2 M elements; ResNet-50 ImageNet form, 25.6 M), fused in one buffer as a DDP bucket
would be, this times with ``torch.set_num_threads(1)``:

* ``encode``: what a hook does before sending (``codec.accumulate`` then ``codec.encode``,
  the codec as ``lowcomm train`` runs it: velocity, error feedback, momentum, packing);
* ``decode``: what it does with the collective's result at P = 4 and 16 workers (the
  remaining rounds' ``advance`` and ``decode``; the P workers' payloads are made locally,
  no process group: as :func:`lowcomm.sim.profiler.measure_compressors` does), written into
  the buffer it encoded, as the DDP hook and the engine write it;
* ``feedback``: the state's share of ``encode``: the encode minus the same codec's encode
  without state (error feedback and velocity off, Signum's momentum replaced by the plain
  payload), a difference of two medians.

Each figure is set against a bound measured in the same run: the bytes the kernel must at
least read and write (:mod:`lowcomm.bench.kernel_bound`, formulas there) over the measured
copy bandwidth, and for powersgd/acpsgd the larger of that and the matmul FLOPs over a
measured matmul rate. Target: every kernel within 3x of its bound (issue 18).

    python benchmarks/kernels.py --json out.json --markdown out.md [--models resnet18]
        [--compressors signsgd,signum] [--worlds 4,16] [--reps 3] [--device cuda]

``--device cuda`` times the codecs' device paths (the buffer on the GPU; the device is
synchronized before and after every timed call) against the GPU's measured copy bandwidth and
matmul rate; there, kernels of a few microseconds are bound by launch latency, not bytes.

Timings depend on the machine and its load: compare figures of one run with each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

from lowcomm.bench.kernel_bound import copy_bandwidth_bytes_per_s, kernel_bytes, kernel_flops, matmul_flops_per_s
from lowcomm.compress.codec import CODECS, Codec, Layout, Message, codec_class
from lowcomm.compress.feedback import Direct
from lowcomm.compress.gathered import PayloadCodec
from lowcomm.compress.steady import compressing, primed, received, step_offsets

TARGET = 3.0
MODELS = ("resnet18", "resnet50")


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """The real per-parameter shapes: ResNet-18 in its CIFAR form, ResNet-50 in its ImageNet form."""
    from lowcomm.models import resnet

    model = resnet.resnet18() if name == "resnet18" else resnet.resnet50_imagenet()
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


#: untimed calls before the timed ones: a training loop's steady state. The first calls of a
#: kernel that returns fresh tensors fault their pages in from the OS until glibc's malloc
#: has raised its mmap threshold past their size (measured: QSGD's ResNet-18 encode 7.3 ms
#: on its second call, 4.3 ms from its fourth on); one warm-up caught that transient.
WARMUP = 3

def _no_sync() -> None:
    return None


#: waits for the device's queued work (set for ``--device cuda``): timings include the kernels
_sync: Callable[[], None] = _no_sync


def timed(fn: Callable[[], float | None], setup: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after :data:`WARMUP` untimed ones; ``setup``
    runs untimed before each. ``fn`` may return its own measured seconds (None: the call is timed)."""
    samples = []
    for i in range(reps + WARMUP):
        setup()
        _sync()
        t0 = time.perf_counter()
        own = fn()
        _sync()
        dt = time.perf_counter() - t0 if own is None else own
        if i >= WARMUP:
            samples.append(dt)
    return statistics.median(samples)


def stateless(cls: type[Codec], world: int, offset: int = 0, prime: tuple[torch.Tensor, Layout, torch.Tensor] | None = None) -> Codec:
    """The codec with its state off: no error feedback, no velocity, no Signum momentum."""
    opts = cls.Options()
    changes = {f: False for f in ("error_feedback", "momentum_correction")
               if dataclasses.is_dataclass(opts) and f in {x.name for x in dataclasses.fields(opts)}}
    codec = cls(dataclasses.replace(opts, **changes) if changes else opts, world=world)
    if isinstance(codec, PayloadCodec) and type(codec.encoder) is not Direct:
        codec.encoder = Direct(codec.compressor, store=codec.memory)
    if prime is not None:
        return primed(codec, *prime, world, offset)
    return compressing(codec, offset)


def time_encode(codec: Codec, x: torch.Tensor, layout: Layout, finite: torch.Tensor, reps: int) -> float:
    buf = torch.empty_like(x)

    def run() -> None:
        codec.accumulate(buf, layout, finite)
        codec.encode(buf, layout, finite)
    return timed(run, lambda: buf.copy_(x), reps)


def time_decode(cls: type[Codec], x: torch.Tensor, layout: Layout, finite: torch.Tensor, world: int,
                reps: int, offset: int = 0) -> float:
    codec = primed(cls(world=world).as_trained(), x, layout, finite, world, offset)
    buf = torch.empty_like(x)
    state: dict[str, Message] = {}

    def setup() -> None:
        buf.copy_(x)
        codec.accumulate(buf, layout, finite)
        state["msg"] = codec.encode(buf, layout, finite)

    def run() -> float:
        msg, spent = state["msg"], 0.0
        while not msg.final:
            rec = received(msg, world)
            _sync()
            t0 = time.perf_counter()
            msg = codec.advance(msg, rec)
            _sync()
            spent += time.perf_counter() - t0
        rec = received(msg, world)
        _sync()
        t0 = time.perf_counter()
        codec.decode(msg, rec, buf)  # into the buffer it encoded, as the DDP hook and the engine do
        _sync()
        return spent + time.perf_counter() - t0
    return timed(run, setup, reps)


def row(compressor: str, kernel: str, model: str, world: int, seconds: float, nbytes: int, flops: float,
        bandwidth: float, flop_rate: float, numel: int) -> dict[str, Any]:
    bound = nbytes / bandwidth
    if flops:
        bound = max(bound, flops / flop_rate)
    ms, bound_ms = 1e3 * seconds, 1e3 * bound
    ratio = ms / bound_ms if bound_ms > 0 else math.nan
    return {"compressor": compressor, "kernel": kernel, "model": model, "world": world, "ms": round(ms, 3),
            "bound_ms": round(bound_ms, 3), "ratio_to_bound": round(ratio, 2), "target": TARGET,
            "within_target": bool(ratio <= TARGET), "bytes": nbytes, "flops": flops, "numel": numel}


def measure(model: str, names: list[str], worlds: list[int], reps: int, bandwidth: float,
            flop_rate: float, device: torch.device | None = None) -> list[dict[str, Any]]:
    shapes = model_shapes(model)
    pnames = [f"p{i}" for i in range(len(shapes))]
    layout = Layout.of(pnames, shapes, {n: i for i, n in enumerate(pnames)})
    numel = layout.numel
    device = device or torch.device("cpu")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    rows = []
    for name in names:
        cls = codec_class(name)
        enc_world = worlds[0]
        nb = kernel_bytes(name, numel, world=enc_world, shapes=shapes)
        fl = kernel_flops(name, shapes, rank=4, world=enc_world)
        offsets = step_offsets(cls)
        full = statistics.mean(time_encode(primed(cls(world=enc_world).as_trained(), x, layout, finite, enc_world, o),
                                           x, layout, finite, reps) for o in offsets)
        rows.append(row(name, "encode", model, enc_world, full, nb["encode"], fl.get("encode", 0.0),
                        bandwidth, flop_rate, numel))
        if nb["feedback"]:
            bare = statistics.mean(time_encode(stateless(cls, enc_world, o, (x, layout, finite)), x, layout, finite, reps)
                                   for o in offsets)
            rows.append(row(name, "feedback", model, enc_world, max(0.0, full - bare), nb["feedback"], 0.0,
                            bandwidth, flop_rate, numel))
        for w in worlds:
            nbw = kernel_bytes(name, numel, world=w, shapes=shapes)
            dec = statistics.mean(time_decode(cls, x, layout, finite, w, reps, o) for o in offsets)
            rows.append(row(name, "decode", model, w, dec, nbw["decode"], fl.get("decode", 0.0),
                            bandwidth, flop_rate, numel))
        print(f"  {model} {name}: " + ", ".join(f"{r['kernel']}@{r['world']} {r['ms']:.1f} ms "
                                                 f"({r['ratio_to_bound']:.1f}x)"
                                                 for r in rows if r["compressor"] == name and r["model"] == model),
              file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [f"Kernels, {header.get('device', 'cpu')}, one thread: copy bandwidth {header['copy_bandwidth_GBps']:.2f} GB/s (read+write), "
             f"matmul {header['matmul_GFLOPs']:.1f} GFLOP/s, load average {header['loadavg']}; "
             f"target: ratio <= {TARGET:g}x.", "",
             "| compressor | kernel | model | P | ms | bound ms | ratio to bound | target |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = "ok" if r["within_target"] else "MISS"
        lines.append(f"| {r['compressor']} | {r['kernel']} | {r['model']} | {r['world']} | {r['ms']:.1f} | "
                     f"{r['bound_ms']:.1f} | {r['ratio_to_bound']:.2f}x | <= {TARGET:g}x {ok} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows (and the measured bandwidths) here")
    ap.add_argument("--markdown", help="write the Markdown table here")
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--compressors", default="all", help="comma list of registered compressors, or all")
    ap.add_argument("--worlds", default="4,16", help="worker counts of the decode (first: the encode's)")
    ap.add_argument("--reps", type=int, default=3, help="timed repeats per figure (median)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the buffers live")
    args = ap.parse_args(argv)
    valid = CODECS.names()
    names = valid if args.compressors == "all" else [c for c in args.compressors.split(",") if c]
    models = [m for m in args.models.split(",") if m]
    try:
        worlds = [int(w) for w in args.worlds.split(",") if w]
    except ValueError:
        worlds = []
    bad = ([f"compressor {c!r} (valid: {', '.join(valid)})" for c in names if c not in valid]
           + [f"model {m!r} (valid: {', '.join(MODELS)})" for m in models if m not in MODELS]
           + ([] if worlds and all(w >= 1 for w in worlds) else [f"worlds {args.worlds!r} (integers >= 1)"])
           + ([] if args.reps >= 1 else [f"reps {args.reps} (>= 1)"])
           + ([] if args.device == "cpu" or torch.cuda.is_available() else ["device 'cuda' (CUDA is not available here)"]))
    if bad:
        print("kernels.py: invalid " + "; ".join(bad), file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, names, models, worlds)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, names: list[str], models: list[str], worlds: list[int]) -> int:
    global _sync
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        _sync = torch.cuda.synchronize
    # on a GPU a 1024^3 product is a few microseconds of launch: time one that fills the chip
    bandwidth = copy_bandwidth_bytes_per_s(1 << 26 if cuda else 1 << 24, device=device)
    flop_rate = matmul_flops_per_s(8192 if cuda else 1024, device=device)
    header = {"copy_bandwidth_GBps": bandwidth / 1e9, "matmul_GFLOPs": flop_rate / 1e9, "threads": 1,
              "loadavg": " ".join(f"{v:.2f}" for v in os.getloadavg()), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    print(f"copy {header['copy_bandwidth_GBps']:.2f} GB/s, matmul {header['matmul_GFLOPs']:.1f} GFLOP/s",
          file=sys.stderr, flush=True)
    rows = [r for m in models for r in measure(m, names, worlds, args.reps, bandwidth, flop_rate, device)]
    write_outputs(args, markdown(rows, header), {**header, "target": TARGET, "rows": rows})
    return 0


def write_outputs(args: argparse.Namespace, table: str, payload: dict[str, Any]) -> None:
    """Print the Markdown ``table``; write it to ``--markdown`` and ``payload`` to ``--json`` if given."""
    print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table)


if __name__ == "__main__":
    sys.exit(main())

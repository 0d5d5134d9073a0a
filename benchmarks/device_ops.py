"""Operations each compressor's device path dispatches per step: a GPU's launch count, counted on a CPU.

Why: on a GPU the codecs' paths are bound by kernel launches and host-side solver calls, not
by bytes (docs/kernels.md, one H100: 18-180x the HBM bound). Timing that needs a GPU; the
number of operations a step dispatches does not. This runs each codec's device path on the
CPU (``lowcomm.compress.base.device_paths``: torch only, no host reads, the code a CUDA
tensor takes) through one steady-state step per step kind on a model's real gradient shapes
fused in one buffer (as ``benchmarks/kernels.py`` does), and counts with a
``TorchDispatchMode`` every ATen operation that reaches a kernel. View operations (view,
slice, split, transpose, ...) launch nothing and are not counted; a multi-tensor
(``_foreach_*``) operation counts once, though CUDA may launch a few kernels for it.
``linalg_qr`` is listed apart: on CUDA it loops over its batch in cuSOLVER, two solver calls
per matrix, each with host-side work. So are the operations whose output size or value the
host must wait for (``SYNCING``: ``torch.unique``, ``nonzero``, boolean-mask indexing, a
Python read of a value), each a full wait for the GPU's queue on CUDA.

    python benchmarks/device_ops.py [--models resnet18,resnet50] [--compressors acpsgd,powersgd]
        [--world 4] [--json out.json] [--markdown out.md]

Counts are exact and machine-independent for a given torch version and codec code.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import MODELS, model_shapes, write_outputs  # noqa: E402

from lowcomm.compress.base import device_paths  # noqa: E402
from lowcomm.compress.codec import CODECS, Layout, codec_class  # noqa: E402
from lowcomm.compress.steady import primed, received, step_offsets  # noqa: E402

#: operations that only make a new view of existing memory (no kernel)
VIEWS = frozenset({"view", "_unsafe_view", "split", "split_with_sizes", "slice", "select", "unsqueeze",
                   "squeeze", "transpose", "t", "as_strided", "alias", "expand", "detach", "unbind",
                   "permute", "reshape", "lift_fresh", "diagonal", "view_as_real", "view_as_complex"})


#: operations that wait for the device: a data-dependent output size, or a value read on the host
SYNCING = frozenset({"_unique2", "unique_dim", "unique_consecutive", "_unique", "nonzero", "masked_select",
                     "_local_scalar_dense", "bincount"})


class Dispatched(TorchDispatchMode):
    """Counts ATen operations by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> int:
        return sum(n for name, n in self.counts.items() if name not in VIEWS)

    def syncs(self) -> int:
        return sum(n for name, n in self.counts.items() if name in SYNCING)


def count(name: str, model: str, world: int) -> dict[str, Any]:
    """Operations of one steady-state step of ``name`` on ``model``'s gradients, averaged over
    the codec's step kinds (ACP-SGD: a P- and a Q-step)."""
    shapes = model_shapes(model)
    pnames = [f"p{i}" for i in range(len(shapes))]
    layout = Layout.of(pnames, shapes, {n: i for i, n in enumerate(pnames)})
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    finite = torch.ones((), dtype=torch.bool)
    cls = codec_class(name)
    enc, dec, qr, syncs = [], [], [], []
    for offset in step_offsets(cls):
        codec = primed(cls(world=world).as_trained(), x, layout, finite, world, offset)
        buf, out = x.clone(), torch.empty_like(x)
        with Dispatched() as e:
            codec.accumulate(buf, layout, finite)
            msg = codec.encode(buf, layout, finite)
        with Dispatched() as d:
            while not msg.final:
                msg = codec.advance(msg, received(msg, world))
            codec.decode(msg, received(msg, world), out)
        enc.append(e.launches())
        dec.append(d.launches())
        qr.append(e.counts["linalg_qr"] + d.counts["linalg_qr"])
        syncs.append(e.syncs() + d.syncs())
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {"compressor": name, "model": model, "world": world, "encode_ops": mean(enc),
            "decode_ops": mean(dec), "step_ops": mean(enc) + mean(dec), "qr_calls": mean(qr),
            "host_waits": mean(syncs),
            "tensors": len(shapes)}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| compressor | model | tensors | encode ops | decode ops (P = {}) | per step | QR calls | host waits |".format(
        rows[0]["world"] if rows else "?"), "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['compressor']} | {r['model']} | {r['tensors']} | {r['encode_ops']:g} | "
                     f"{r['decode_ops']:g} | {r['step_ops']:g} | {r['qr_calls']:g} | {r['host_waits']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--compressors", default="all", help="comma list of registered compressors, or all")
    ap.add_argument("--world", type=int, default=4, help="workers the decode sums over (>= 1)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", help="write the Markdown table here")
    args = ap.parse_args(argv)
    valid = CODECS.names()
    names = valid if args.compressors == "all" else [c for c in args.compressors.split(",") if c]
    models = [m for m in args.models.split(",") if m]
    bad = ([f"compressor {c!r} (valid: {', '.join(valid)})" for c in names if c not in valid]
           + [f"model {m!r} (valid: {', '.join(MODELS)})" for m in models if m not in MODELS]
           + ([] if args.world >= 1 else [f"world {args.world} (>= 1)"]))
    if bad:
        print("device_ops.py: invalid " + "; ".join(bad), file=sys.stderr)
        return 2
    rows = []
    with device_paths():
        for model in models:
            for name in names:
                rows.append(count(name, model, args.world))
                print(f"  {model} {name}: {rows[-1]['step_ops']:g} ops, {rows[-1]['qr_calls']:g} QR", file=sys.stderr)
    write_outputs(args, markdown(rows), {"torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

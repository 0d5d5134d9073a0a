"""How much faster a device computes split fine-tuning's step than this machine: the ``K`` of
``lowcomm split --compute emulated:scale=K``, measured instead of estimated.

Why: on a CPU a split step computes for ~0.7 s, so the link's share (what the factorization
shrinks) is small; ``--compute emulated:scale=K`` shows what a machine ``K`` times faster sees
(docs/split.md). This script times the same computation on any device: one training step
(forward, backward, AdamW) of the whole MiniLM classifier (all-MiniLM-L6-v2's configuration,
6 layers, hidden 384, FFN 1536; random weights: the time does not depend on the values) at
the split benchmark's batch (32 sequences x 48 tokens). The split's two sides together run
these layers, so ``K = this machine's step / the device's step``.

    python benchmarks/split_gpu_speed.py --device cpu  --json cpu.json   # here
    python benchmarks/split_gpu_speed.py --device cuda --json gpu.json   # on a GPU machine

CUDA steps are timed with events (median after warm-up); float32 weights, TF32 matrix units
on, as a fine-tuning script would run on a Hopper GPU by default in many stacks (``--no-tf32``
to time strict fp32 instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lowcomm.split.bert import BertClassifier, BertConfig  # noqa: E402

#: all-MiniLM-L6-v2's config.json (the installed package's, as read by lowcomm.split)
MINILM = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                    intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
                    layer_norm_eps=1e-12, hidden_act="gelu")


def step_times(device: torch.device, batch: int, tokens: int, warmup: int, iters: int) -> list[float]:
    """Seconds of each timed training step."""
    torch.manual_seed(0)
    model = BertClassifier(MINILM, 3).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, tokens), generator=g).to(device)
    mask = torch.ones_like(ids)
    y = torch.randint(0, 3, (batch,), generator=g).to(device)
    cuda = device.type == "cuda"
    out = []
    for k in range(warmup + iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(ids, mask), y).backward()
        opt.step()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            dt = time.perf_counter() - t0
        if k >= warmup:
            out.append(dt)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: all cores)")
    ap.add_argument("--no-tf32", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("split_gpu_speed.py: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = not args.no_tf32
    torch.backends.cudnn.allow_tf32 = not args.no_tf32
    times = step_times(device, args.batch_size, args.max_len, args.warmup, args.iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    row = {"device": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "tf32": not args.no_tf32, "batch": args.batch_size, "tokens": args.max_len,
           "step_ms_median": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3,
           "iters": args.iters}
    print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

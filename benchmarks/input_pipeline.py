"""Input pipeline: decoding epoch (epoch 1, fills the cache) vs cached epoch (epoch 2).

Usage (from the repository root; a timing run: run it alone on the machine)::

    .venv/bin/python benchmarks/input_pipeline.py \\
        --json benchmarks/results/input_pipeline.json --doc docs/input_pipeline.md
    .venv/bin/python benchmarks/input_pipeline.py --render   # table from the JSON only

Makes an ImageFolder tree in a temporary folder (``--images`` training images of
``--source-px`` square pixels, half PNG, half JPEG, in 10 classes, plus 10 % for ``val``;
smooth gradients and shapes with mild noise, so the files compress like photographs rather
than like noise) and measures, for ``--data-cache`` none/memory/disk and ``--data-workers``
0/2, the wall-clock of epoch 1 and epoch 2:

* ``data``: the trainer's batches alone (:class:`lowcomm.runtime.workload.Batches` over the
  bundle behind :func:`~lowcomm.runtime.workload.cache_samples`), no model. Epoch 1 includes
  building the loader (a memory cache's probe decode, starting the workers).
* ``train``: ``lowcomm train --data imagefolder`` with a small model (``mlp`` on the
  flattened crop, ``--no-eval``), epoch times from the run's per-epoch wall clock; and
  ``train: data wait``, the training loop's ``data`` phase of those epochs (summed from the
  step log): waiting for the next batch, moving it to the device, and the batch augmentation
  (after the cache, so the same in both epochs).

Each cached configuration starts from an empty cache (a fresh folder / process). Disk
entries are read back from the page cache (the files were just written), as the images
themselves are in epoch 1; a cold local disk would be slower for both. Each figure is the
median of ``--reps`` runs. Only the standard library is imported at the top, so that
:func:`table` can render the JSON cheaply (``--render``). The target (issue 14): cached epoch >= 3x faster than the
decoding epoch on the data path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET = 3.0
MARK = "input-bench"
CLASSES = 10
CONFIGS = [(cache, workers) for cache in ("none", "memory", "disk") for workers in (0, 2)]


def make_tree(root: Path, images: int, px: int, seed: int = 0) -> dict[str, Any]:
    """The ImageFolder tree: ``images`` training and ``images // 10`` validation files."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:px, 0:px].astype(np.float32) / px
    nbytes = 0
    for split, n in (("train", images), ("val", max(CLASSES, images // 10))):
        for k in range(n):
            c = k % CLASSES
            folder = root / split / f"class{c:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            a, b, base = rng.uniform(-1, 1, 3), rng.uniform(-1, 1, 3), rng.uniform(0.2, 0.8, 3)
            img = base + 0.3 * (a * xx[..., None] + b * yy[..., None])
            for _ in range(3):  # a few flat rectangles
                x0, y0 = rng.integers(0, px - 8, 2)
                w, h = rng.integers(6, px // 2, 2)
                img[y0:y0 + h, x0:x0 + w] = rng.uniform(0, 1, 3)
            pixels = np.clip(img * 255 + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
            path = folder / (f"{k:05d}.png" if k % 2 else f"{k:05d}.jpg")
            if k % 2:
                Image.fromarray(pixels).save(path)
            else:
                Image.fromarray(pixels).save(path, quality=90)
            nbytes += path.stat().st_size
    return {"train_images": images, "val_images": max(CLASSES, images // 10), "classes": CLASSES,
            "source_px": px, "formats": "half PNG, half JPEG at quality 90", "bytes_on_disk": nbytes}


def data_epochs(root: Path, cache: str, workers: int, crop: int, batch: int, scratch: Path) -> tuple[float, float]:
    """(epoch 1 s, epoch 2 s) of the trainer's batches alone, from an empty cache."""
    from lowcomm import data
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.workload import Batches, cache_samples

    spec = f"disk:{tempfile.mkdtemp(dir=scratch)}" if cache == "disk" else cache
    cfg = TrainConfig(data="imagefolder", data_dir=str(root), data_args={"image_size": crop},
                      data_cache=spec, data_workers=workers, batch_size=batch)
    times = []
    start = time.perf_counter()
    bundle = cache_samples(cfg, data.create("imagefolder", data_dir=root, image_size=crop))
    batches = Batches(bundle.train, batch, 0, 1, seed=0, workers=workers)
    for epoch in range(2):
        for _x, _y in batches.epoch(epoch):
            pass
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    batches.close()
    return times[0], times[1]


def train_epochs(root: Path, cache: str, workers: int, crop: int, batch: int,
                 scratch: Path) -> tuple[float, float, float, float]:
    """(epoch 1 s, epoch 2 s, epoch 1 data wait s, epoch 2 data wait s) of ``lowcomm train``
    with a small model, from an empty cache. The data wait is the trainer's ``data`` phase
    (waiting for the next batch, moving it to the device, the augmentation), summed over the epoch."""
    spec = f"disk:{tempfile.mkdtemp(dir=scratch)}" if cache == "disk" else cache
    out, log = scratch / "summary.json", scratch / "steps.jsonl"
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "lowcomm", "train", "--data", "imagefolder", "--data-dir", str(root),
            "--data-arg", f"image_size={crop}", "--model", "mlp", "--model-arg", f"input_dim={3 * crop * crop}",
            "--epochs", "2", "--batch-size", str(batch), "--no-eval", "--no-progress", "--quiet",
            "--data-cache", spec, "--data-workers", str(workers), "--json", str(out), "--log", str(log)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"lowcomm train failed:\n{done.stderr[-3000:]}")
    walls = [r["wall_s"] for r in json.loads(out.read_text())["history"]]
    waits = [0.0, 0.0]
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "step":
            waits[r["epoch"]] += r.get("data_s", 0.0)
    return walls[0], walls[1] - walls[0], waits[0], waits[1]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every (path, cache, workers) row, medians of ``args.reps`` runs."""
    from lowcomm.bench.environment import machine

    info = machine()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lowcomm-input-bench-") as tmp:
        root, scratch = Path(tmp) / "images", Path(tmp) / "scratch"
        scratch.mkdir()
        dataset = make_tree(root, args.images, args.source_px)
        dataset["image_size"] = args.image_size
        for path in ("data", "train"):
            for cache, workers in CONFIGS:
                runs: list[tuple[float, ...]] = [(data_epochs if path == "data" else train_epochs)(
                    root, cache, workers, args.image_size, args.batch_size, scratch) for _ in range(args.reps)]
                kinds = [("data", 0)] if path == "data" else [("train", 0), ("train: data wait", 2)]
                for name, at in kinds:
                    e1, e2 = [r[at] for r in runs], [r[at + 1] for r in runs]
                    row: dict[str, Any] = {"path": name, "cache": cache, "workers": workers, "epoch1_s": statistics.median(e1),
                           "epoch2_s": statistics.median(e2), "epoch1_runs_s": e1, "epoch2_runs_s": e2}
                    row["speedup"] = row["epoch1_s"] / max(row["epoch2_s"], 1e-9)
                    rows.append(row)
                    print(f"{name:16s} cache={cache:6s} workers={workers}: epoch 1 {row['epoch1_s']:.2f} s, "
                          f"epoch 2 {row['epoch2_s']:.2f} s, {row['speedup']:.1f}x", file=sys.stderr, flush=True)
    return {"machine": info, "dataset": dataset, "batch_size": args.batch_size, "reps": args.reps,
            "model": "mlp (hidden 100) on the flattened crop, --no-eval", "target_speedup": TARGET, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """The Markdown block between the ``input-bench`` markers."""
    m, d = result["machine"], result["dataset"]
    lines = [
        "",
        f"Machine: {m.get('cpu', 'unknown CPU')}, {m.get('cpu_count')} cores, torch {m.get('torch')} "
        f"(load average {m.get('load_avg_1m_at_start', float('nan')):.1f} at the start). Data: "
        f"{d['train_images']} training images of {d['source_px']}x{d['source_px']} px ({d['formats']}, "
        f"{d['bytes_on_disk'] / 2**20:.1f} MiB with val), crop {d['image_size']}, batch {result['batch_size']}, "
        f"median of {result['reps']} runs. Target: cached epoch >= {result['target_speedup']:g}x faster "
        "than the decoding epoch.",
        "",
        "| path | --data-cache | --data-workers | epoch 1 (decode) s | epoch 2 s | epoch 1 / epoch 2 | target |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        if r["cache"] == "none":
            verdict = "— (no cache)"
        elif r["path"] == "train":
            verdict = "— (model time included)"
        else:
            verdict = "met" if r["speedup"] >= result["target_speedup"] else "missed"
        lines.append(f"| {r['path']} | {r['cache']} | {r['workers']} | {r['epoch1_s']:.2f} | {r['epoch2_s']:.2f} "
                     f"| {r['speedup']:.1f}x | {verdict} |")
    return "\n".join(lines) + "\n"


def write_doc(doc: Path, block: str) -> None:
    """Replace the marked block of ``doc`` with ``block``."""
    import re

    text = doc.read_text()
    pattern = re.compile(rf"(<!-- {MARK}:begin -->)(.*?)(<!-- {MARK}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc}: no <!-- {MARK}:begin/end --> block")
    doc.write_text(pattern.sub(lambda m: m.group(1) + block + m.group(3), text))


def main() -> int:
    """Measure (or ``--render`` the existing JSON), write JSON and the doc table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4000, help="training images (default 4000)")
    ap.add_argument("--source-px", type=int, default=96, help="square size of the image files")
    ap.add_argument("--image-size", type=int, default=64, help="the dataset's crop (image_size)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--doc", default=None, help="rewrite this doc's input-bench table")
    ap.add_argument("--render", action="store_true",
                    help="no measurement: the table of benchmarks/results/input_pipeline.json into docs/input_pipeline.md")
    args = ap.parse_args()
    if args.render:
        result = json.loads((REPO / "benchmarks/results/input_pipeline.json").read_text())
        write_doc(REPO / "docs/input_pipeline.md", table(result))
        return 0
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.doc:
        write_doc(Path(args.doc), table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

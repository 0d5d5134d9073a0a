"""A picture of the procedural stereo data: left view, right view, disparity, occlusions.

Why this exists: the ``stereo`` dataset is the embedded default of ``lowcomm elastic train``
on stereo, and a reader judging the EPE numbers in ``docs/elastic.md`` should see what the
scenes look like (random-dot stereograms, slanted textured planes, textured shapes at several
depths) and where the right camera cannot see the left view (occluded pixels, which keep their
true disparity in the ground truth, as in Scene Flow).

Usage (from the repository root)::

    .venv/bin/python benchmarks/stereo_samples.py [--out docs/img/stereo_samples.png]

One row per scene kind (``dots``, ``planes``, ``shapes``, ``mixed``), at the dataset's default
size (64x128, ``max_disp`` 32). Deterministic: the same picture on every machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from lowcomm.data.stereo_render import occlusion_mask, render, sample_layers

KINDS = ("dots", "planes", "shapes", "mixed")


def main() -> None:
    """Render one scene per kind and save the grid."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/stereo_samples.png"))
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--max-disp", type=float, default=32)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, w, maxd = args.height, args.width, args.max_disp
    fig, axes = plt.subplots(len(KINDS), 4, figsize=(13, 1.9 * len(KINDS) + 0.4))
    for row, kind in enumerate(KINDS):
        layers = sample_layers(np.random.default_rng([11, row]), 1, height=h, width=w,
                               max_disp=maxd, kind=kind)
        left, right, disparity = render(layers, h, w)
        hidden = occlusion_mask(layers, disparity)[0]
        panels = [
            (left[0].transpose(1, 2, 0), {}, "left"),
            (right[0].transpose(1, 2, 0), {}, "right"),
            (disparity[0], {"cmap": "magma", "vmin": 0, "vmax": maxd}, "disparity (px)"),
            (hidden, {"cmap": "gray"}, f"occluded in right ({hidden.mean():.0%})"),
        ]
        for col, (img, style, title) in enumerate(panels):
            ax = axes[row, col]
            shown = ax.imshow(img, interpolation="nearest", **style)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(title if row == 0 or col == 3 else "", fontsize=9)
            if col == 0:
                ax.set_ylabel(kind, fontsize=10)
            if col == 2:
                fig.colorbar(shown, ax=ax, fraction=0.025, pad=0.02)
    fig.suptitle(f"lowcomm procedural stereo ({h}x{w}, disparity in [1, {maxd:g}))", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The bench's PNG plots, drawn from the result dict alone (matplotlib, Agg: no display needed).

- ``<path>``: time per iteration by phase, one panel per network; in a time-to-accuracy run
  (``--epochs``, the demo) test accuracy against training time sits above it, with the target
  (99 % of ssgd's final accuracy) as a horizontal line and each method's time to it marked;
- ``<stem>_speedup.png`` (network sweeps): per-iteration speed-up over ssgd against bandwidth;
- ``<stem>_accuracy.png`` (time-to-accuracy runs): the accuracy panels alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowcomm.bench import tta
from lowcomm.bench.report import network_label, networks, runs_for
from lowcomm.runtime.timing import PHASES

_PHASE_COLORS = {
    "data": "#bbbbbb",
    "forward": "#4c72b0",
    "backward": "#55a868",
    "comm_wait": "#c44e52",
    "compress": "#dd8452",
    "optimizer": "#8172b2",
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_curves(result: dict[str, Any]) -> bool:
    return any(r.get("accuracy_curve") for r in result.get("runs", []))


def plot(result: dict[str, Any], path: str | Path) -> list[Path]:
    """Write ``path`` (breakdown; with accuracy panels above it in a time-to-accuracy run),
    for a sweep also ``<stem>_speedup.png``, for a time-to-accuracy run also
    ``<stem>_accuracy.png``. Returns the files written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    curves = _has_curves(result)
    if curves:
        tta.annotate(result)
    written = [plot_breakdown(result, path, with_accuracy=curves)]
    if len(networks(result)) > 1:
        written.append(plot_speedup(result, path.with_name(path.stem + "_speedup.png")))
    if curves:
        written.append(plot_accuracy(result, path.with_name(path.stem + "_accuracy.png")))
    return written


def _subtitle(result: dict[str, Any]) -> str:
    return (f"{result.get('model')} ({result.get('data_label', result.get('data'))}), "
            f"{result.get('world_size')} workers, batch {result.get('batch_size')}/worker"
            + (f", compute emulated ({result['compute']})" if str(result.get("compute", "real")) != "real" else ""))


def breakdown_axis(ax: Any, result: dict[str, Any], net: dict[str, Any]) -> None:
    """Stacked median phase times per method on ``ax``, lower bound marked; the per-iteration
    speed-up is written over the bars only in timing runs (in a time-to-accuracy run the
    speed-up that counts is the one to the target, on the accuracy panel)."""
    runs = [r for r in runs_for(result, net) if r.get("status") != "failed"]
    names = [r["method"] + ("\n(compute only)" if r["method"] == "nocomm" else "") for r in runs]
    x = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for phase in PHASES:
        vals = [float((r.get("breakdown_s") or {}).get(phase, 0.0)) for r in runs]
        if not any(vals):
            continue
        ax.bar(x, vals, bottom=bottom, color=_PHASE_COLORS.get(phase), label=phase.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    its = [r.get("iter_time_s_median") or 0.0 for r in runs]
    ax.scatter(x, its, marker="_", s=600, color="black", label="median iteration", zorder=3)
    lbs = [(i, r["lower_bound_s"]) for i, r in enumerate(runs) if r.get("lower_bound_s")]
    if lbs:
        ax.scatter([i for i, _ in lbs], [v for _, v in lbs], marker="v", color="black", facecolors="none",
                   s=60, label="lower bound", zorder=3)
    if not result.get("epochs"):
        for i, r in enumerate(runs):
            if r.get("speedup_vs_ssgd") and r["method"] != "nocomm":
                ax.annotate(f"{r['speedup_vs_ssgd']:.2f}x", (i, its[i]), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("seconds per iteration (median)")
    ax.set_title(network_label(net), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    failed = [r["method"] for r in runs_for(result, net) if r.get("status") == "failed"]
    if failed:
        ax.text(0.99, 0.98, "failed: " + ", ".join(failed), transform=ax.transAxes, ha="right", va="top",
                fontsize=8, color="#c44e52")


def accuracy_axis(ax: Any, result: dict[str, Any], net: dict[str, Any]) -> None:
    """Test accuracy against the training clock on ``ax``, one curve per method, the target as
    a horizontal line and each method's time to it marked (a star and its seconds)."""
    info = net.get("tta")
    colors = _plt().get_cmap("tab10")
    for i, r in enumerate(runs_for(result, net)):
        hist = tta.history_of(r)
        pts = [(c, 100 * float(h["test_accuracy"])) for c, h in zip(tta.training_clock(hist), hist)
               if c is not None and h.get("test_accuracy") is not None]
        if not pts:
            continue
        label = r["method"]
        if info and r.get("time_to_target_s") is None and r.get("best_test_accuracy") is not None:
            label += f" (not reached, best {100 * r['best_test_accuracy']:.1f}%)"
        color = colors(i % 10)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=color, label=label)
        t = r.get("time_to_target_s")
        if info and t is not None:
            acc = next((a for c, a in pts if c >= t), pts[-1][1])
            ax.scatter([t], [acc], marker="*", s=140, color=color, edgecolors="black", linewidths=0.5, zorder=4)
            ax.axvline(t, color=color, lw=0.8, ls=":", alpha=0.8)
            speed = r.get("tta_speedup_vs_ssgd")
            text = (f"{t:.0f} s" if t >= 10 else f"{t:.1f} s") + (f" ({speed:.1f}x)" if speed and r["method"] != info["reference"] else "")
            ax.annotate(text, (t, acc), textcoords="offset points", xytext=(4, -12), fontsize=7, color=color)
    if info:
        ax.axhline(100 * info["target"], color="black", lw=0.9, ls="--",
                   label=f"target {100 * info['target']:.1f}% ({100 * info['fraction']:.0f}% of "
                         f"{info['reference']}'s final)")
    ax.set_xlim(left=0)
    ax.set_xlabel(f"seconds ({tta.clock_label(info)})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(network_label(net), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write (120 dpi) and close a figure: every plot here ends the same way."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_breakdown(result: dict[str, Any], path: Path, *, with_accuracy: bool = False) -> Path:
    """Stacked median phase times per method, one panel per network, lower bound marked; with
    ``with_accuracy`` the time-to-accuracy panels above them."""
    plt = _plt()
    nets = networks(result)
    width = max(6.0, 1.1 * 5 + 1.2 * len(result.get("runs", [])) / max(1, len(nets))) * len(nets) ** 0.8
    nrows = 2 if with_accuracy else 1
    fig, axes = plt.subplots(nrows, len(nets), figsize=(max(width, 7.5 * len(nets) ** 0.8) if with_accuracy else width,
                                                         4.8 * nrows), squeeze=False)
    for col, net in enumerate(nets):
        if with_accuracy:
            accuracy_axis(axes[0][col], result, net)
        breakdown_axis(axes[nrows - 1][col], result, net)
    axes[nrows - 1][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    head = "Time to accuracy and time per iteration by phase" if with_accuracy else "Time per iteration by phase"
    fig.suptitle(f"{head} — {_subtitle(result)}", fontsize=10)
    return _save(plt, fig, path)


def plot_speedup(result: dict[str, Any], path: Path) -> Path:
    """Per-iteration speed-up over ssgd against measured bandwidth, one line per method."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    methods: list[str] = []
    for r in result.get("runs", []):
        if r["method"] not in methods and r["method"] not in ("ssgd",):
            methods.append(r["method"])
    for m in methods:
        pts = []
        for net in networks(result):
            bw = net.get("measured_bits_per_s")
            for r in runs_for(result, net):
                if r["method"] == m and r.get("speedup_vs_ssgd") and bw:
                    pts.append((bw / 1e6, r["speedup_vs_ssgd"]))
        if pts:
            pts.sort()
            i = methods.index(m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vDP*Xh<>p"[i % 12],
                    color=plt.get_cmap("tab20")(i % 20), ls=":" if m == "nocomm" else "-",
                    label="nocomm (compute only)" if m == "nocomm" else m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="ssgd")
    ax.set_xscale("log")
    ax.set_xlabel("measured link bandwidth (Mbit/s, log scale)")
    ax.set_ylabel("speed-up per iteration over ssgd (x)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(
        f"Speed-up vs bandwidth — {result.get('model')}, {result.get('world_size')} workers", fontsize=10
    )
    return _save(plt, fig, path)


def plot_accuracy(result: dict[str, Any], path: Path) -> Path:
    """Test accuracy against training time, one curve per method, target and times marked."""
    plt = _plt()
    tta.annotate(result)
    nets = networks(result)
    fig, axes = plt.subplots(1, len(nets), figsize=(7.5 * len(nets) ** 0.8, 4.8), squeeze=False)
    for ax, net in zip(axes[0], nets):
        accuracy_axis(ax, result, net)
    fig.suptitle(f"Time to accuracy — {_subtitle(result)}", fontsize=10)
    return _save(plt, fig, path)


__all__ = ["accuracy_axis", "breakdown_axis", "plot", "plot_accuracy", "plot_breakdown", "plot_speedup"]

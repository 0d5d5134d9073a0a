"""Turn a bench result (the JSON dict) into a terminal table, Markdown, and PNG plots.

Everything here reads only the result dict, so a recorded ``--json`` file can be re-rendered
later (``benchmarks/`` does that for the docs) without re-running anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from lowcomm.bench import tta
from lowcomm.bench.netns import format_rate

COLUMNS = (
    ("method", "method"),
    ("iter ms", "iter_time_s_median"),
    ("samples/s", "samples_per_s"),
    ("MB/worker/iter", "bytes_per_worker_per_iter"),
    ("speed-up vs ssgd", "speedup_vs_ssgd"),
    ("bound ms", "lower_bound_s"),
    ("iter/bound", "bound_ratio"),
    ("compute ms", "_compute"),
    ("comm wait ms", "_comm_wait"),
    ("compress ms", "_compress"),
)


#: time-to-accuracy runs (``--epochs``, the demo): final accuracy, training time (evaluation
#: excluded), time to the target (99% of ssgd's final accuracy) and the speed-up to it
TTA_COLUMNS = (("test acc %", "final_test_accuracy"), ("train s", "_train_s"), ("to target s", "_tta"),
               ("speed-up to target", "tta_speedup_vs_ssgd"))
#: timing columns a time-to-accuracy table leaves out: the per-iteration speed-up is not the one
#: that counts when accuracy differs, and such runs have no compute-only run for the bounds
NOT_IN_TTA = ("samples_per_s", "speedup_vs_ssgd", "lower_bound_s", "bound_ratio", "schedule_bound_s",
              "schedule_bound_ratio")
#: each method's own limit, its schedule on an ideal link (lowcomm.bench.schedule_bound)
SCHEDULE_BOUND_COLUMNS = (("sched bound ms", "schedule_bound_s"), ("iter/sched bound", "schedule_bound_ratio"))
#: bytes the worker's emulated interface really transmitted (payload + TCP/IP headers)
TX_COLUMN = ("MB sent (IP)", "measured_tx_bytes_per_iter")
#: bytes one worker sent over inter-node links (emulated nodes of several workers)
INTER_COLUMN = ("inter-node MB", "inter_node_bytes_per_worker_per_iter")
#: the simulator's prediction and its error, after the measured time
PREDICTION_COLUMNS = (("pred ms", "predicted_iter_time_s"), ("pred err", "prediction_error"))
#: ``--repeat``: how far apart the method's runs were, (slowest - fastest) / the row's time
SPREAD_COLUMN = ("run spread", "repeat_spread")


def columns(result: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The table's columns. Optional ones appear when some run has them: measured interface
    bytes next to the counted MB, the simulator's prediction next to the measured time, and
    for time-to-accuracy runs final accuracy, training time and time to the target instead
    of the per-iteration speed-up and the bounds. Each method's schedule bound follows the
    universal bound when the simulator gave one."""
    runs = result.get("runs", [])
    cols = list(COLUMNS)
    if any(r.get("measured_tx_bytes_per_iter") is not None for r in runs):
        cols.insert(cols.index(("MB/worker/iter", "bytes_per_worker_per_iter")) + 1, TX_COLUMN)
    if (result.get("nproc_per_node") or 1) > 1 and any(r.get(INTER_COLUMN[1]) is not None for r in runs):
        cols.insert(cols.index(("MB/worker/iter", "bytes_per_worker_per_iter")) + 1, INTER_COLUMN)
    if any(len(r.get("repeat_iter_times_s") or ()) > 1 for r in runs):
        cols.insert(cols.index(("iter ms", "iter_time_s_median")) + 1, SPREAD_COLUMN)
    if any(r.get("predicted_iter_time_s") is not None for r in runs):
        at = cols.index(("iter ms", "iter_time_s_median")) + 1
        cols[at:at] = PREDICTION_COLUMNS
    if any(r.get("schedule_bound_s") is not None for r in runs):
        at = cols.index(("iter/bound", "bound_ratio")) + 1
        cols[at:at] = SCHEDULE_BOUND_COLUMNS
    if not result.get("epochs"):
        return tuple(cols)
    return tuple(c for c in cols if c[1] not in NOT_IN_TTA) + TTA_COLUMNS


def _fmt(key: str, run: dict[str, Any]) -> str:
    if run.get("status") == "failed":
        return "" if key != "method" else run["method"]
    b = run.get("breakdown_s") or {}
    if key == "_compute":
        v: Any = sum(b.get(p, 0.0) for p in ("forward", "backward"))
    elif key == "_comm_wait":
        v = b.get("comm_wait")
    elif key == "_compress":
        v = b.get("compress")
    elif key == "_train_s":
        clock = [c for c in tta.training_clock(tta.history_of(run)) if c is not None]
        v = clock[-1] if clock else None
    elif key == "_tta":
        return tta.cell(run)
    else:
        v = run.get(key)
    if v is None:
        return "-"
    if key == "method":
        role = " (compute only)" if v == "nocomm" or run.get("compute_reference") == v else ""
        emulated = " (compute emulated)" if str(run.get("compute", "real")) != "real" else ""
        return str(v) + role + emulated
    if key in ("bytes_per_worker_per_iter", "measured_tx_bytes_per_iter", "inter_node_bytes_per_worker_per_iter"):
        return f"{v / 1e6:.3g}"
    if key == "prediction_error":
        return f"{100 * v:+.0f}%"
    if key == "repeat_spread":
        return f"{100 * v:.0f}% of {len(run.get('repeat_iter_times_s') or ())}"
    if key == "samples_per_s":
        return f"{v:.1f}"
    if key in ("speedup_vs_ssgd", "bound_ratio", "schedule_bound_ratio", "tta_speedup_vs_ssgd"):
        return f"{v:.2f}x"
    if key == "final_test_accuracy":
        return f"{100 * v:.1f}"
    if key == "_train_s":
        return f"{v:.1f}"
    return f"{v * 1e3:.1f}"  # seconds shown as milliseconds


def network_label(net: dict[str, Any]) -> str:
    """``'100 Mbit/s emulated (measured 95.9 Mbit/s, RTT 0.01 ms)'`` or the loopback note."""
    meas = net.get("measured_bits_per_s")
    rtt = net.get("rtt_ms")
    measured = f"measured {format_rate(meas)}" if meas else "not measured"
    if rtt is not None:
        measured += f", RTT {rtt:.3g} ms"
    if net.get("error"):
        return f"{net.get('requested')}: FAILED ({net['error']})"
    if net.get("emulated"):
        return f"{net.get('label', net.get('requested'))} emulated ({measured})"
    why = f"; {net['note']}" if net.get("note") else ""
    return f"loopback, not emulated ({measured}{why})"


def title(result: dict[str, Any], net: dict[str, Any] | None = None) -> str:
    """Table title: model, data, workers, batch and the network as measured."""
    net = net or result.get("network") or {}
    g = result.get("nproc_per_node") or 1
    workers = f"{result.get('world_size')} workers" + (f" ({result.get('nodes')} nodes x {g})" if g > 1 else "")
    return (
        f"{result.get('model')} ({result.get('data_label', result.get('data'))}), "
        f"{workers}, batch {result.get('batch_size')}/worker — "
        f"{network_label(net) if net else ''}"
    )


def runs_for(result: dict[str, Any], net: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows measured on ``net`` (a result holds one block of rows per network)."""
    return [r for r in result.get("runs", []) if r.get("net", net.get("requested")) == net.get("requested")]


def networks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every network of a result, also for results written before several were allowed."""
    return list(result.get("networks") or ([result["network"]] if result.get("network") else []))


def rows(runs: Iterable[dict[str, Any]], cols: tuple[tuple[str, str], ...] = COLUMNS) -> list[list[str]]:
    """Formatted table cells, one list per run (shared by the console and markdown tables)."""
    return [[_fmt(k, r) for _, k in cols] for r in runs]


def failures(runs: Iterable[dict[str, Any]]) -> list[str]:
    """One line per failed run with its reason: failures are reported, never dropped."""
    return [f"{r['method']}: FAILED — {r.get('reason', 'unknown reason')}" for r in runs if r.get("status") == "failed"]


def noise_warning(runs: Iterable[dict[str, Any]]) -> str | None:
    """Flag rows faster than their own lower bound: the bound or the measurement is wrong there."""
    below = [r["method"] for r in runs if r.get("status") == "ok" and (r.get("bound_ratio") or 1.0) < 0.95]
    if not below:
        return None
    return (f"warning: {', '.join(below)} ran faster than its lower bound, which a correct bound forbids: the "
            "bound misses something this method does differently (compare compute_only_s, compress_bound_s and "
            "wire_time_s in the JSON with the row's breakdown) or the timing is wrong; please report it")


def repeat_note(result: dict[str, Any]) -> str | None:
    """What a row is when the bench ran rounds (``--repeat``), else None."""
    rounds = result.get("repeat") or 1
    if rounds <= 1:
        return None
    return (f"{rounds} rounds, every method once per round: a row is its method's median run (the fastest for "
            "compute references); run spread = (slowest - fastest) / the row's time, of that many runs")


def prediction_note(net: dict[str, Any]) -> str | None:
    """One line saying how the simulator was calibrated on this network (or why it was not)."""
    pred = net.get("prediction")
    if not pred:
        return None
    if pred.get("error"):
        return f"prediction: failed ({pred['error']})"
    parts = []
    if pred.get("compute_scale"):
        parts.append(f"profile compute x{pred['compute_scale']:.2f} to match nocomm")
    else:
        parts.append(pred.get("note", "compute not calibrated"))
    nm = pred.get("network_model") or {}
    alpha = nm.get("collective_alpha_s")
    if alpha:
        parts.append("alpha/step " + ", ".join(f"{k} {v * 1e3:.2g} ms" for k, v in alpha.items()))
        scale = nm.get("collective_beta_scale") or {}
        if scale:
            parts.append("beta x " + ", ".join(f"{k} {v:.2f}" for k, v in scale.items()))
    elif nm.get("alpha_s") is not None:
        parts.append(f"alpha = RTT/2 = {nm['alpha_s'] * 1e3:.3g} ms (no collective probe)")
    return "simulator: " + "; ".join(parts)


def markdown(result: dict[str, Any]) -> str:
    """Markdown tables, one per network, with the failures listed under each."""
    out = []
    cols = columns(result)
    tta.annotate(result)
    for net in networks(result):
        out.append(f"**{title(result, net)}**\n")
        out.append("| " + " | ".join(h for h, _ in cols) + " |")
        out.append("|" + "---|" * len(cols))
        runs = runs_for(result, net)
        for r in rows((x for x in runs if x.get("status") != "failed"), cols):
            out.append("| " + " | ".join(r) + " |")
        if result.get("epochs"):
            head, per_method = tta.summary(result, net)
            out.append(f"\n{head}\n")
            out.extend(f"- **{m}**: {text}" for m, text in per_method)
        for f in failures(runs):
            out.append(f"\n- {f}")
        warn = noise_warning(runs)
        if warn:
            out.append(f"\n_{warn}_")
        note = prediction_note(net)
        if note:
            out.append(f"\n_{note}_")
        rounds = repeat_note(result)
        if rounds:
            out.append(f"\n_{rounds}_")
        out.append("")
    return "\n".join(out)


def print_table(result: dict[str, Any]) -> None:
    """A rich table per network (plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    import shutil

    console = Console(width=max(shutil.get_terminal_size((160, 24)).columns, 150))
    cols = columns(result)
    tta.annotate(result)
    for net in networks(result):
        table = Table(title=title(result, net), title_justify="left")
        for h, k in cols:
            table.add_column(h, justify="left" if k == "method" else "right")
        runs = runs_for(result, net)
        for r in rows((x for x in runs if x.get("status") != "failed"), cols):
            table.add_row(*r)
        console.print(table)
        if result.get("epochs"):
            for line in tta.summary_lines(result, net):
                console.print(line, markup=False, highlight=False)
        for f in failures(runs):
            console.print(f, style="red", markup=False, highlight=False)
        warn = noise_warning(runs)
        if warn:
            console.print(warn, style="yellow", markup=False, highlight=False)
        if not net.get("emulated"):
            console.print(f"note: {network_label(net)}", markup=False, highlight=False)
        note = prediction_note(net)
        if note:
            console.print(note, markup=False, highlight=False)
        rounds = repeat_note(result)
        if rounds:
            console.print(rounds, markup=False, highlight=False)
    if result.get("lower_bound_note") and not result.get("epochs"):  # no bounds without a nocomm run
        console.print(result["lower_bound_note"], markup=False, highlight=False)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Write the full result (the tables are rendered from it, so nothing is lost)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")


def load_json(path: str | Path) -> dict[str, Any]:
    """Read a result written by :func:`write_json` (``benchmarks/render.py`` re-renders it)."""
    return json.loads(Path(path).read_text())


# --- plots (drawn by :mod:`lowcomm.bench.plots`; matplotlib is imported only when plotting) ---


def plot(result: dict[str, Any], path: str | Path) -> list[Path]:
    """Write the bench's PNGs next to ``path``; see :func:`lowcomm.bench.plots.plot`."""
    from lowcomm.bench import plots

    return plots.plot(result, path)


def plot_accuracy(result: dict[str, Any], path: Path) -> Path:
    """Test accuracy against training time; see :func:`lowcomm.bench.plots.plot_accuracy`."""
    from lowcomm.bench import plots

    return plots.plot_accuracy(result, path)

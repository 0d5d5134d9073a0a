"""What a federated run shows: a line (or a live bar) per round, a summary table, two plots.

Why separate from the engine: everything here renders the per-round records and the result
JSON (contract C5) and nothing else, so a saved JSON can be re-rendered, and the Flower
benchmark draws its curve on the same axes with :func:`plot_runs`. rich and matplotlib are
imported only when something is displayed or drawn.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from lowcomm.errors import UsageError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


@dataclass
class RoundRecord:
    """One round of a federated run (contract C5); :meth:`to_dict` is its JSON form."""

    round: int
    test_accuracy: float | None
    test_loss: float | None
    round_time_s: float
    train_makespan_s: float
    predicted_makespan_s: float | None
    plan: dict[str, Any] = field(default_factory=dict)
    bytes_per_worker: float = 0.0
    clients: int = 0
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the C5 keys."""
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> RoundRecord:
        """Read a record back from JSON (unknown keys ignored, so newer files still load)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


Record = RoundRecord | Mapping[str, Any]


def _as_dict(record: Record) -> Mapping[str, Any]:
    return record.to_dict() if isinstance(record, RoundRecord) else record


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.2f} %"


def _secs(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f} s"


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, as memory is counted)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # unreachable: the loop returns at GiB


def round_line(record: Record, total: int | None = None) -> str:
    """One plain-text line for a round: accuracy, times, the plan and its prediction.

    Records number rounds from 0 (the engine's ``range(rounds)``); people count from 1, so
    the line says ``round 1/R`` for record 0 (and the plots put it at x = 1).
    """
    r = _as_dict(record)
    plan = r.get("plan") or {}
    head = f"round {int(r['round']) + 1}" + (f"/{total}" if total else "")
    parts = [f"acc {_pct(r.get('test_accuracy'))}"]
    if r.get("test_loss") is not None:
        parts.append(f"loss {float(r['test_loss']):.4f}")
    parts.append(f"round {_secs(r.get('round_time_s'))}")
    makespan = f"makespan {_secs(r.get('train_makespan_s'))}"
    if r.get("predicted_makespan_s") is not None:
        makespan += f" (predicted {_secs(r['predicted_makespan_s'])})"
    parts.append(makespan)
    if plan:
        parts.append(f"{plan.get('kind', '?')} plan, clients/worker {plan.get('clients_per_worker')}")
    return f"{head}: " + ", ".join(parts)


def print_round(record: Record, *, total: int | None = None, console: Any = None) -> None:
    """Print :func:`round_line` (on ``console``, a rich Console; stdout by default)."""
    from rich.console import Console

    # soft_wrap: one line per round however narrow the terminal or log (grep-able)
    (console or Console()).print(round_line(record, total), markup=False, highlight=False, soft_wrap=True)


class RoundDisplay:
    """A live rich bar over the rounds on a terminal (each round's line printed above it);
    one plain line per round otherwise, so logs keep the same information.

    ``start_round``: rounds already done (a resumed run); ``live``: force the bar on or off
    (default: on when the console is a terminal).
    """

    def __init__(self, total_rounds: int, *, start_round: int = 0, enabled: bool = True,
                 console: Any = None, live: bool | None = None) -> None:
        from rich.console import Console

        self.total = total_rounds
        self.enabled = enabled
        self.console = console or Console()
        self.bar: Any = None
        if enabled and (self.console.is_terminal if live is None else live):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("round"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                console=self.console)
            self.bar.start()
            self.task = self.bar.add_task("fl", total=total_rounds, completed=start_round, info="")

    def update(self, record: Record) -> None:
        """One round done: print its line and move the bar."""
        if not self.enabled:
            return
        print_round(record, total=self.total, console=self.console)
        if self.bar is not None:
            r = _as_dict(record)
            info = f"acc {_pct(r.get('test_accuracy'))}  round {_secs(r.get('round_time_s'))}"
            self.bar.update(self.task, advance=1, info=info)

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> RoundDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SUMMARY_ROWS: tuple[tuple[str, str], ...] = (
    ("algorithm", "algorithm"), ("clients (registered)", "clients"), ("clients per round", "per_round"),
    ("worker processes", "world_size"), ("model", "model"), ("data", "data"), ("partition", "partition"),
    ("rounds", "rounds"), ("local epochs", "local_epochs"), ("batch size", "batch_size"), ("lr", "lr"),
    ("device", "device"), ("parameters", "params"), ("schedule", "schedule"), ("slowdown", "slowdown"),
)


def summary_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of the summary table, from the result JSON (C5)."""
    rows = [(label, str(summary[key])) for label, key in _SUMMARY_ROWS if summary.get(key) is not None]
    rows.append(("final test accuracy", _pct(summary.get("final_test_accuracy"))))
    rows.append(("round time (median)", _secs(summary.get("round_time_s_median"))))
    history = summary.get("history") or []
    makespans = [h.get("train_makespan_s") for h in map(_as_dict, history)]
    predicted = [h.get("predicted_makespan_s") for h in map(_as_dict, history)]
    fitted = [(m, p) for m, p in zip(makespans, predicted) if m is not None and p is not None]
    if fitted:
        rows.append(("makespan, fitted rounds (median)",
                     f"{_secs(statistics.median(m for m, _ in fitted))} "
                     f"(predicted {_secs(statistics.median(p for _, p in fitted))})"))
    rows.append(("bytes per round per worker", human_bytes(summary.get("bytes_per_round_per_worker"))))
    peak = summary.get("peak_memory") or {}
    if peak:
        rows.append(("peak memory, all processes (PSS)", human_bytes(peak.get("pss_bytes"))))
        rows.append(("peak memory, all processes (RSS)", human_bytes(peak.get("rss_bytes"))))
        rows.append(("processes", str(peak.get("processes"))))
    stats = summary.get("partition_stats") or {}
    for key, value in stats.items():
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            rows.append((f"partition: {key}", f"{value:.4g}" if isinstance(value, float) else str(value)))
    return rows


def print_summary(summary: Mapping[str, Any], *, console: Any = None) -> None:
    """A rich table of the run's result (C5 keys; absent ones are left out)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lowcomm fl", title_justify="left", show_header=False)
    table.add_column("", justify="left")
    table.add_column("", justify="right")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    (console or Console()).print(table)


# --- plots (matplotlib, Agg) ---------------------------------------------------------------


def _check_path(path: str | Path) -> Path:
    p = Path(path)
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"plot file {str(p)!r} must end in one of {', '.join(PLOT_SUFFIXES)}")
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _curve(history: Sequence[Record]) -> tuple[list[float], list[float], list[float]]:
    """(rounds, elapsed seconds, accuracy in %) of the rounds that were evaluated."""
    rounds, elapsed, acc = [], [], []
    for rec in map(_as_dict, history):
        if rec.get("test_accuracy") is None:
            continue
        rounds.append(float(rec["round"]) + 1.0)  # records count from 0, see round_line
        elapsed.append(float(rec.get("elapsed_s") or 0.0))
        acc.append(100.0 * float(rec["test_accuracy"]))
    return rounds, elapsed, acc


def plot_runs(runs: Mapping[str, Sequence[Record]], path: str | Path, *, title: str | None = None,
              log_time: bool = False) -> Path:
    """Two panels, test accuracy vs round and vs elapsed wall-clock seconds, one curve per run
    (e.g. ``{"lowcomm": ..., "flower": ...}``); the format follows the suffix (PNG, SVG, PDF).
    ``log_time`` puts the wall-clock axis on a log scale, for runs 10x apart in speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = _check_path(path)
    if not runs:
        raise UsageError("nothing to plot: no runs given")
    fig, (by_round, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    try:
        for name, history in runs.items():
            rounds, elapsed, acc = _curve(history)
            by_round.plot(rounds, acc, marker=".", label=name)
            by_time.plot(elapsed, acc, marker=".", label=name)
        by_round.set_xlabel("round")
        by_time.set_xlabel("elapsed wall-clock (s)" + (", log scale" if log_time else ""))
        if log_time:
            by_time.set_xscale("log")
        by_round.set_ylabel("test accuracy (%)")
        for ax in (by_round, by_time):
            ax.grid(alpha=0.3)
        if len(runs) > 1:
            by_time.legend()
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def plot(history: Sequence[Record], path: str | Path, *, title: str | None = None,
         log_time: bool = False) -> Path:
    """One run's accuracy vs round and vs wall-clock (see :func:`plot_runs`)."""
    return plot_runs({"lowcomm": history}, path, title=title, log_time=log_time)

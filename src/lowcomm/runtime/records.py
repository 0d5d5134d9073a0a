"""Where a run reports as it goes: the JSONL step log, TensorBoard, the progress bar.

Why apart from the loop: the records' format is an interface (``--log`` files are read by
scripts), kept identical whatever the loop does; and only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

from lowcomm.errors import UsageError


def open_log(path: str) -> TextIO:
    """Open the JSONL step log for appending, first dropping a torn last line.

    A run killed while writing a record leaves half a line; a resumed run appending after it
    would glue its first record onto that fragment and make the file unreadable as JSONL.
    """
    try:
        with open(path, "rb+") as f:
            end = f.seek(0, os.SEEK_END)
            pos = end
            while pos > 0:  # read back from the end only as far as the last newline
                step = min(pos, 1 << 16)
                f.seek(pos - step)
                chunk = f.read(step)
                if pos == end and chunk.endswith(b"\n"):
                    break  # the last line is whole
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    f.truncate(pos - step + cut + 1)
                    break
                pos -= step
            else:
                f.truncate(0)  # no newline at all: one torn line
    except FileNotFoundError:
        pass
    return open(path, "a")


def rank_log_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes ``--log path`` with ``--log-all-ranks``: rank 0 ``path`` itself
    (what a reader of rank 0's log expects), rank N ``path`` with ``.rankN`` before its extension."""
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class RunLog:
    """The ``--log`` JSONL file (rank 0's, or every rank's with ``--log-all-ranks``) and the
    ``--tensorboard`` writer of rank 0 (either optional).

    Every record is one JSON line; its numeric fields (but ``step`` and ``epoch``) also go to
    TensorBoard as scalars at the record's step.
    """

    def __init__(self, log: str | None, tensorboard: str | None, *, enabled: bool) -> None:
        self.file = open_log(log) if log and enabled else None
        self.tb: Any = None
        if tensorboard and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(tensorboard)

    @classmethod
    def of_rank(cls, log: str | None, tensorboard: str | None, *, rank: int, all_ranks: bool = False) -> RunLog:
        """Rank ``rank``'s: the log on rank 0, or on every rank with ``all_ranks``
        (:func:`rank_log_path`); TensorBoard on rank 0 only."""
        if log and all_ranks:
            return cls(rank_log_path(log, rank), tensorboard if rank == 0 else None, enabled=True)
        return cls(log, tensorboard, enabled=rank == 0)

    @property
    def active(self) -> bool:
        """Whether anything is written (saves building per-step records otherwise)."""
        return self.file is not None or self.tb is not None

    def write(self, record: dict[str, Any], step: int) -> None:
        """Append ``record``; ``step`` is the TensorBoard step when the record has none."""
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(k, v, record.get("step", step))

    def close(self) -> None:
        """Close the file and the writer."""
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rich progress bar on rank 0 when attached to a terminal; silent otherwise."""

    def __init__(self, total: int, done: int, *, enabled: bool) -> None:
        self.bar: Any = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=done, info="")

    def update(self, loss: float) -> None:
        """One step done, with its loss."""
        if self.bar:
            self.bar.update(self.task, advance=1, info=f"loss {loss:.3f}")

    def note(self, record: dict[str, Any]) -> None:
        """Print an evaluation record above the bar."""
        if self.bar:
            parts = [f"{k} {v:.4f}" for k, v in record.items() if k.startswith("test_")]
            self.bar.console.print(f"epoch {record['epoch']}: " + ", ".join(parts))

    def close(self) -> None:
        """Remove the bar."""
        if self.bar:
            self.bar.stop()

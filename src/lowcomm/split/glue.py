"""GLUE tasks from the official TSV files (``train.tsv``, ``dev.tsv``) in a local folder.

The layouts are those of the files GLUE distributes (its download script unpacks them into
``SST-2/``, ``CoLA/``, ``MRPC/``, ``QNLI/``, ``RTE/``):

- ``sst2``: header ``sentence, label``; labels 0 (negative), 1 (positive).
- ``cola``: no header; columns source, label (0 unacceptable, 1 acceptable), original
  label, sentence.
- ``mrpc``: header ``Quality, #1 ID, #2 ID, #1 String, #2 String``; the pair is the two
  strings; Quality 0 (not equivalent), 1 (equivalent).
- ``qnli``: header ``index, question, sentence, label``; label entailment / not_entailment.
- ``rte``: header ``index, sentence1, sentence2, label``; label entailment / not_entailment.

Columns are found by their header names (their order may differ), CoLA's by position.
Fields are tab-separated with no quoting (GLUE's texts contain bare ``"`` characters, so a
quote-aware reader would merge lines). ``test.tsv`` has no labels, so ``dev.tsv`` serves as
the test set, as in the GLUE papers' dev-set results.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from lowcomm.errors import UsageError

#: one sample's text: a sentence or a sentence pair (see ``lowcomm.split.data.Text``)
GlueText = Union[str, tuple[str, str]]
#: one file's samples: texts and int64 labels
GlueRows = tuple[list[GlueText], np.ndarray]


@dataclass(frozen=True)
class GlueTask:
    """Where one task keeps its texts and labels.

    ``texts`` and ``label`` are header names when ``header`` is true, else column positions.
    ``values[k]`` is how label ``k`` is written in the file, ``names[k]`` what it means.
    """

    folder: str
    header: bool
    texts: tuple[str | int, ...]
    label: str | int
    values: tuple[str, ...]
    names: tuple[str, ...]

    def layout(self) -> str:
        """The expected columns, for error messages."""
        if self.header:
            return "a header with " + ", ".join(str(c) for c in (*self.texts, self.label))
        return (f"no header, the label in column {int(self.label) + 1} and the text in column "
                f"{', '.join(str(int(c) + 1) for c in self.texts)}")


_ENTAIL = ("entailment", "not_entailment")
GLUE_TASKS: dict[str, GlueTask] = {
    "sst2": GlueTask("SST-2", True, ("sentence",), "label", ("0", "1"), ("negative", "positive")),
    "cola": GlueTask("CoLA", False, (3,), 1, ("0", "1"), ("unacceptable", "acceptable")),
    "mrpc": GlueTask("MRPC", True, ("#1 String", "#2 String"), "Quality", ("0", "1"),
                     ("not_equivalent", "equivalent")),
    "qnli": GlueTask("QNLI", True, ("question", "sentence"), "label", _ENTAIL, _ENTAIL),
    "rte": GlueTask("RTE", True, ("sentence1", "sentence2"), "label", _ENTAIL, _ENTAIL),
}
SPLIT_FILES = ("train.tsv", "dev.tsv")


def task_folder(name: str, data_dir: str | Path | None) -> Path:
    """The folder holding ``name``'s ``train.tsv`` and ``dev.tsv``: ``data_dir`` itself, or its
    ``SST-2``-style subfolder (GLUE's name) or ``sst2``-style one (ours)."""
    task = GLUE_TASKS[name]
    where = str(data_dir) if data_dir is not None else "--data-dir (none given)"
    if data_dir is not None:
        root = Path(data_dir)
        for folder in (root, root / task.folder, root / name):
            if all((folder / f).is_file() for f in SPLIT_FILES):
                return folder
    raise UsageError(f"{name}: expected {' and '.join(SPLIT_FILES)} (GLUE {task.folder} layout: "
                     f"{task.layout()}) under {where} or its {task.folder}/ folder; see docs/data.md")


def _positions(task: GlueTask, header: list[str], path: Path, name: str) -> tuple[list[int], int]:
    """Column positions of the texts and the label, from the header row if the task has one."""
    if not task.header:
        return [int(c) for c in task.texts], int(task.label)
    cols = [c.strip() for c in header]
    missing = [str(c) for c in (*task.texts, task.label) if str(c) not in cols]
    if missing:
        raise UsageError(f"{name}: {path} has columns {cols}, missing {missing}; expected "
                         f"{task.layout()} (the GLUE {task.folder} layout)")
    return [cols.index(str(c)) for c in task.texts], cols.index(str(task.label))


def read_glue_file(name: str, path: Path) -> GlueRows:
    """All rows of one GLUE TSV file of task ``name``, in file order."""
    task = GLUE_TASKS[name]
    texts: list[GlueText] = []
    labels: list[int] = []
    code = {value: k for k, value in enumerate(task.values)}
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        text_at, label_at = _positions(task, next(rows, []) if task.header else [], path, name)
        first = 2 if task.header else 1
        width = max(*text_at, label_at) + 1
        for line, row in enumerate(rows, start=first):
            if not row:
                continue
            if len(row) < width:
                raise UsageError(f"{name}: {path} line {line} has {len(row)} tab-separated fields, "
                                 f"expected {width} or more ({task.layout()})")
            label = code.get(row[label_at].strip())
            if label is None:
                raise UsageError(f"{name}: {path} line {line} has label {row[label_at]!r}; "
                                 f"valid: {', '.join(task.values)}")
            parts = [row[i] for i in text_at]
            texts.append(parts[0] if len(parts) == 1 else (parts[0], parts[1]))
            labels.append(label)
    if not texts:
        raise UsageError(f"{name}: {path} has no samples; expected {task.layout()}")
    return texts, np.asarray(labels, dtype=np.int64)


def read_glue(name: str, data_dir: str | Path | None) -> tuple[GlueRows, GlueRows, list[str]]:
    """``name``'s train rows, dev rows (the test set) and label names."""
    folder = task_folder(name, data_dir)
    train, dev = (read_glue_file(name, folder / f) for f in SPLIT_FILES)
    return train, dev, list(GLUE_TASKS[name].names)

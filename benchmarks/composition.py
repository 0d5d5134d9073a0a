"""Generate docs/composition.md: which model x payload x schedule combinations run.

Why generated: the axes of the design guide compose freely only where the code says so,
and a hand-kept table drifts from it. Every axis is read from a registry, never from a
list here:

* **model**: the dense model, and every method with a ``then`` option (a model-axis method
  that trains a rewritten model and hands the gradients to any other method; today
  ``pufferfish``);
* **payload**: none, and every codec of :data:`lowcomm.compress.codec.CODECS`;
* **schedule**: the DDP comm hooks (the method named like the codec, ``ssgd`` for none),
  and every method with an engine :class:`~lowcomm.sched.pairing.Mode` (wfbp, mgwfbp, dear,
  lee18; ``compress=<codec>``).

A cell either runs, matching its central reference on 2 ranks (the tests named in the
generated page; ``tests/test_composition.py`` checks that they cover exactly the cells
marked working), or is refused with the text of
:func:`lowcomm.sched.pairing.pairing_refusal` (what ``methods.create`` raises).

Usage (from the repository root)::

    .venv/bin/python benchmarks/composition.py           # write docs/composition.md
    .venv/bin/python benchmarks/composition.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from lowcomm import methods
from lowcomm.compress.codec import CODECS
from lowcomm.sched.pairing import Mode, pairing_refusal

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "composition.md"
DENSE, NONE, DDP = "dense", "none", "ddp"
#: a refusal longer than this goes to a numbered note under the table
INLINE_MAX = 40
WORKS = "✓ tested"

#: where each kind of working cell is checked against its central reference (2 ranks)
TESTS = {
    "ddp": "`tests/test_compress_hooks.py::test_aggregated_gradient_matches_central_reference_with_many_buckets` "
           "(2 and 4 ranks, many DDP buckets; `ssgd` included)",
    "engine": "`tests/test_sched_codecs.py::test_schedule_carrying_codec_matches_central_reference_on_two_ranks` "
              "(with a codec) and `tests/test_sched_correctness.py` (no codec: against DDP)",
    "model": "`tests/test_composition.py::test_every_working_pufferfish_cell_matches_its_central_reference_on_two_ranks` "
             "(the factorized model's parameters)",
}


def models() -> list[str]:
    """The model axis: dense, then every method that takes a ``then`` method (sorted)."""
    wrappers = [n for n in methods.names()
                if "then" in {f.name for f in dataclasses.fields(methods.method_class(n).Options)}]
    return [DENSE, *sorted(wrappers)]


def payloads() -> list[str]:
    """The payload axis: none, then every registered codec (sorted)."""
    return [NONE, *sorted(CODECS.names())]


def schedules() -> list[str]:
    """The schedule axis: the DDP comm hooks, then every engine schedule (sorted)."""
    engine = [n for n in methods.names() if isinstance(getattr(methods.method_class(n), "mode", None), Mode)]
    return [DDP, *sorted(engine)]


def method_spec(payload: str, schedule: str) -> str:
    """The ``--method`` spec of a dense cell (default options)."""
    if schedule == DDP:
        return "ssgd" if payload == NONE else payload
    return schedule if payload == NONE else f"{schedule}:compress={payload}"


def cell_spec(model: str, payload: str, schedule: str) -> str:
    """The ``--method`` spec of a cell: a model-axis method takes the dense spec as ``then``."""
    inner = method_spec(payload, schedule)
    return inner if model == DENSE else f"{model}:then={inner}"


def refusal(payload: str, schedule: str) -> str | None:
    """Why the cell cannot run (the same for every model: a model-axis method only changes
    the parameters), or None. The DDP hooks carry every codec."""
    return None if schedule == DDP else pairing_refusal(schedule, payload)


@dataclass(frozen=True)
class Cell:
    """One combination and its verdict (``refused`` is None when it runs)."""

    model: str
    payload: str
    schedule: str
    refused: str | None

    @property
    def spec(self) -> str:
        """How to ask for it on the command line."""
        return cell_spec(self.model, self.payload, self.schedule)


def cells() -> list[Cell]:
    """Every cell of the matrix, in model, payload, schedule order."""
    return [Cell(m, p, s, refusal(p, s)) for m in models() for p in payloads() for s in schedules()]


def working() -> list[tuple[str, str, str]]:
    """(model, payload, schedule) of every cell that runs."""
    return [(c.model, c.payload, c.schedule) for c in cells() if c.refused is None]


def render() -> str:
    """The whole page (deterministic: sorted axes, notes numbered in order of use)."""
    notes: list[str] = []

    def mark(c: Cell) -> str:
        if c.refused is None:
            return WORKS
        if len(c.refused) <= INLINE_MAX:
            return f"✗ {c.refused}"
        if c.refused not in notes:
            notes.append(c.refused)
        return f"✗ refused [{notes.index(c.refused) + 1}]"

    scheds = schedules()
    lines = [
        "# Composition matrix: model × payload × schedule",
        "",
        "<!-- generated by benchmarks/composition.py; do not edit: run "
        "`.venv/bin/python benchmarks/composition.py` (tests/test_composition.py checks it) -->",
        "",
        "Every combination of the model, payload and schedule axes that lowcomm offers, read "
        "from the registries (codecs, methods, engine schedules). "
        f"**{WORKS}**: it runs and matches its central reference on 2 ranks (tested); "
        "**✗ refused**: `lowcomm.methods.create` refuses the spec with the text in the note.",
        "",
        "How to spell a cell as `--method`: the DDP column is the method named like the "
        "payload (`ssgd` for none, e.g. `topk:density=0.01`); an engine column is "
        "`SCHEDULE:compress=PAYLOAD` plus the codec's options (e.g. `dear:compress=fp16`); "
        "a model-axis row wraps that spec as `MODEL:then=SPEC` (parentheses around a spec "
        "with several options: `pufferfish:then=(dear:compress=acpsgd,rank=4)`).",
        "",
        "Where the working cells are tested:",
        "",
        f"* DDP column: {TESTS['ddp']};",
        f"* engine columns: {TESTS['engine']};",
        f"* model-axis rows: {TESTS['model']}.",
    ]
    for model in models():
        title = "dense model" if model == DENSE else f"`{model}` (low-rank factorized model, `{model}:then=...`)"
        lines += ["", f"## {title}", "", "| payload | " + " | ".join(f"`{s}`" for s in scheds) + " |",
                  "| --- |" + " --- |" * len(scheds)]
        for p in payloads():
            row = [mark(Cell(model, p, s, refusal(p, s))) for s in scheds]
            lines.append(f"| `{p}` | " + " | ".join(row) + " |")
    if notes:
        lines += ["", "## Refusals", ""] + [f"{i}. {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/composition.md, or with ``--check`` return 1 when it differs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/composition.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale: run .venv/bin/python benchmarks/composition.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

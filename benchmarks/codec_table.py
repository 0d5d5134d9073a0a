"""Generate the compressor table of docs/compression.md from the codecs' own declarations.

Why generated: a hand-kept table of compressors is one more file to touch per compressor
and drifts from the code. Every column comes from :data:`lowcomm.compress.codec.CODECS`:
the codec's ``summary``, its aggregation, whether it keeps state across steps, its options
dataclass (names and defaults), and its ``cost()`` for one example tensor. The table sits
between ``<!-- codecs:begin -->`` and ``<!-- codecs:end -->``; the prose paragraphs (one per
codec) are written by hand.

Usage (from the repository root)::

    .venv/bin/python benchmarks/codec_table.py           # rewrite the table in place
    .venv/bin/python benchmarks/codec_table.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from lowcomm.compress.codec import CODECS, Aggregation, codec_class

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "compression.md"
BEGIN, END = "<!-- codecs:begin -->", "<!-- codecs:end -->"
#: the example tensor of the bytes column: a 1024 x 1024 fp32 weight, 4 workers
SHAPE, WORLD = (1024, 1024), 4
AGGREGATION = {Aggregation.SUM: "sum (all-reduce / reduce-scatter)", Aggregation.GATHER: "gather (each payload decoded)"}


def _options(cls: type) -> str:
    fields = dataclasses.fields(cls)
    if not fields:
        return "none"
    return ", ".join(f"`{f.name}={_value(f)}`" for f in fields)


def _value(f: dataclasses.Field[object]) -> str:
    value = f.default if f.default is not dataclasses.MISSING else "?"
    return str(value).lower() if isinstance(value, bool) else str(value)


def table() -> str:
    """The Markdown table, one row per registered codec (sorted by name)."""
    dense = 4 * SHAPE[0] * SHAPE[1]
    lines = [
        f"| method | what it sends | aggregation | state across steps | options (defaults) | "
        f"payload bytes per worker per step (counted at the collective), one {SHAPE[0]}×{SHAPE[1]} fp32 tensor, P = {WORLD} (uncompressed: {dense:,}) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in CODECS.names():
        cls = codec_class(name)
        codec = cls(world=WORLD)
        nbytes = codec.cost([SHAPE], world=WORLD, dtype_bytes=4).nbytes
        state = "yes" if cls.stateful else "no"
        lines.append(f"| `{name}` | {cls.summary} | {AGGREGATION[cls.aggregation]} | {state} | "
                     f"{_options(cls.Options)} | {nbytes:,} |")
    return "\n".join(lines)


def render(doc: str) -> str:
    """``doc`` with the table between the markers replaced."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{DOC}: markers {BEGIN} ... {END} not found")
    return pattern.sub(lambda _m: f"{BEGIN}\n{table()}\n{END}", doc)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the table, or with ``--check`` report whether it is stale (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    new = render(doc)
    if args.check:
        if new != doc:
            print(f"{DOC} is stale: run .venv/bin/python benchmarks/codec_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""docs/compression.md's compressor table is generated from the codecs and kept current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lowcomm.compress.codec import CODECS

REPO = Path(__file__).resolve().parent.parent


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("codec_table", REPO / "benchmarks" / "codec_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compression_doc_table_equals_the_generator_output() -> None:
    gen = _generator()
    doc = gen.DOC.read_text()
    assert gen.render(doc) == doc, "docs/compression.md is stale: run .venv/bin/python benchmarks/codec_table.py"


def test_table_has_one_row_per_registered_codec_and_check_mode_catches_staleness(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    gen = _generator()
    rows = [line for line in gen.table().splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == CODECS.names()
    stale = tmp_path / "compression.md"
    stale.write_text(f"x\n{gen.BEGIN}\n| old |\n{gen.END}\n")
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0

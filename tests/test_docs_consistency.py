"""Numbers the docs quote must equal the JSON results they cite (no silent drift).

The quoted numbers live between ``<!-- NAME:begin/end -->`` markers and are written by
``benchmarks/doc_numbers.py --write``; these tests fail when a result file or a doc changed
without the other.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _doc_numbers() -> ModuleType:
    path = REPO / "benchmarks" / "doc_numbers.py"
    spec = importlib.util.spec_from_file_location("doc_numbers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("doc_numbers", module)
    spec.loader.exec_module(module)
    return module


def test_marked_numbers_in_the_docs_equal_what_the_json_gives() -> None:
    problems = _doc_numbers().stale(REPO)
    assert not problems, "run `.venv/bin/python benchmarks/doc_numbers.py --write`:\n" + "\n".join(problems)


def test_simulator_validation_counts_are_recomputed_from_the_bench_json() -> None:
    dn = _doc_numbers()
    counts = dn.prediction_counts(dn._load(dn.BENCH, REPO))
    for c in counts:  # every row with a prediction is counted once, by its own error
        assert all(abs(e) <= dn.TARGET for _, e in c.within)
        assert all(abs(e) > dn.TARGET for _, e in c.missed)
    summary = dn.sim_validation_summary(REPO)
    assert summary.startswith(f"{sum(len(c.within) for c in counts)} of {sum(c.total for c in counts)} rows")


def test_readme_and_status_state_the_same_test_suite_time() -> None:
    pattern = re.compile(r"`make test` takes about (\d+) minutes")
    found = {name: pattern.findall((REPO / name).read_text()) for name in ("README.md", "docs/status.md")}
    assert all(len(v) == 1 for v in found.values()), found
    assert found["README.md"] == found["docs/status.md"], found

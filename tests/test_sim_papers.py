"""benchmarks/sim_papers.py: the published-vs-predicted table, on a tiny hand-made case."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lowcomm.sim import ComputeCosts, LayerProfile, Profile


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_papers.py"
    spec = importlib.util.spec_from_file_location("sim_papers", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_papers"] = mod
    spec.loader.exec_module(mod)
    return mod


sp = _load()


def _tiny(device: str, model: str, batch: int) -> Profile:
    return Profile(model=model, batch_size=batch, optimizer_s=1e-3, costs=ComputeCosts(1e-10, 1e-12, 1e-9, 1e-9, 1e-9),
                   layers=[LayerProfile(f"l{i}", 1e-3 * batch / 8, 2e-3 * batch / 8, [[512, 512]]) for i in range(3)])


def _claim(agg: str, published: float | None) -> object:
    setups = [sp.Setup("tiny", 8, "1gbit", 8, 4, ",rank=2"), sp.Setup("tiny", 8, "infiniband", 8, 1, ",rank=2")]
    return sp.Claim("Paper", "acpsgd vs ssgd", published, "acpsgd", ["ssgd"], setups, agg)


@pytest.mark.parametrize("agg", ["mean", "max"])
def test_prediction_aggregates_the_setup_ratios_like_the_published_claim(agg: str) -> None:
    (row,) = sp.run([_claim(agg, 2.0)], load=_tiny)
    ratios = [s["ratio"] for s in row["setups"]]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)
    expect = sum(ratios) / 2 if agg == "mean" else max(ratios)
    assert row["predicted"] == pytest.approx(expect)
    assert row["error"] == pytest.approx(expect / 2.0 - 1.0)
    assert row["setups"][0]["gpus_per_node"] == 4 and row["setups"][0]["baseline"] == "ssgd"


def test_markdown_puts_published_beside_predicted_and_marks_missing_figures() -> None:
    rows = sp.run([_claim("mean", 2.0), _claim("max", None)], load=_tiny)
    text = sp.markdown(rows)
    lines = text.splitlines()
    assert lines[0].startswith("| paper | ratio | published | predicted | error |")
    assert "| 2.00x |" in lines[2] and "1 GbE" in lines[2] and "100 Gb IB" in lines[2]
    assert "| — |" in lines[3]


def test_write_doc_replaces_only_the_text_between_markers(tmp_path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(f"before\n{sp.BEGIN}\nold\n{sp.END}\nafter\n")
    sp.write_doc("new table", doc)
    assert doc.read_text() == f"before\n{sp.BEGIN}\nnew table\n{sp.END}\nafter\n"


def test_every_claim_names_a_paper_setting_and_a_known_network() -> None:
    for c in sp.claims():
        assert c.setups and c.aggregate in ("mean", "max")
        assert all(s.net in sp.NET_NAMES for s in c.setups)

"""``lowcomm elastic search`` and ``extract`` on a tiny trained supernet (structure, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm.cli import main

QUICK = ["--population", "6", "--iterations", "2", "--valid-size", "100", "--bn-batches", "1",
         "--latency-repeats", "1", "--latency-samples", "2", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module")
def supernet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("elastic")
    path = folder / "net.pt"
    assert main(["elastic", "train", "--model", "elastic_cnn2d", "--data", "digits", "--phases",
                 "full:1,kernel:1,depth:1,expand:1", "--steps", "3", "--subnets", "depth=2,expand=2", "--lr", "0.05",
                 "--no-progress", "--quiet", "--bn-batches", "1", "--threads", "1", "--out", str(path)]) == 0
    return path


def test_search_answers_meet_their_budgets_and_face_the_random_baseline(supernet: Path, tmp_path: Path) -> None:
    out, table = tmp_path / "s.json", tmp_path / "lat.json"
    assert main(["elastic", "search", "--supernet", str(supernet), "--latency-ms", "1e6,2e6", "--random", "3",
                 "--score", "direct", "--latency-table", str(table), "--json", str(out), *QUICK]) == 0
    s = json.loads(out.read_text())
    assert [b["budget_ms"] for b in s["budgets"]] == [1e6, 2e6]
    for b in s["budgets"]:
        assert b["search"]["predicted_ms"] <= b["budget_ms"] and b["random"]["predicted_ms"] <= b["budget_ms"]
        assert 0.0 <= b["search"]["test"]["accuracy"] <= 1.0
        assert isinstance(b["search_beats_random_on_test"], bool)
        for answer in (b["search"], b["random"]):  # verified by timing (--verify 5, the default)
            assert answer["predicted_ms"] <= b["budget_ms"] * (1 - s["latency_margin"])  # searched with a margin
            assert answer["verify"]["meets_budget"] and answer["measured_ms"] <= b["budget_ms"]
            assert answer["config"] in [r["config"] for r in answer["verify"]["rows"]]
    assert table.is_file() and json.loads(table.read_text())["units"]
    again = tmp_path / "s2.json"  # the saved table is read, not measured again
    assert main(["elastic", "search", "--supernet", str(supernet), "--latency-ms", "1e6", "--random", "0",
                 "--score", "predictor", "--predictor-samples", "8", "--latency-table", str(table),
                 "--json", str(again), *QUICK]) == 0
    s2 = json.loads(again.read_text())
    assert s2["score"]["kind"] == "predictor" and s2["score"]["samples"] == 8 and "random" not in s2["budgets"][0]


def test_a_budget_below_the_smallest_network_is_refused_naming_the_minimum(
        supernet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["elastic", "search", "--supernet", str(supernet), "--latency-ms", "1e-9", "--score", "direct",
                 *QUICK]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ms" in err


def test_extract_writes_a_plain_subnetwork_that_reloads(supernet: Path, tmp_path: Path) -> None:
    from lowcomm.elastic.artifacts import load_subnet

    out, js = tmp_path / "sub.pt", tmp_path / "e.json"
    assert main(["elastic", "extract", "--supernet", str(supernet), "--config", "min", "--out", str(out),
                 "--json", str(js), *QUICK]) == 0
    result = json.loads(js.read_text())
    sub, blob = load_subnet(out)
    assert blob["config"] == result["config"] and 0.0 <= result["test"]["accuracy"] <= 1.0
    assert sum(p.numel() for p in sub.parameters()) == result["params"]
    assert not any("Elastic" in type(m).__name__ for m in sub.modules())
    by_budget = tmp_path / "sub2.pt"
    assert main(["elastic", "extract", "--supernet", str(supernet), "--latency-ms", "1e6", "--out", str(by_budget),
                 "--score", "direct", *QUICK]) == 0
    assert by_budget.is_file()


@pytest.mark.parametrize("args, message", [
    (["search", "--latency-ms", "fast"], "milliseconds"),
    (["search", "--latency-ms", "-1"], "positive"),
    (["search", "--latency-ms", "5", "--latency-rounds", "0"], "--latency-rounds"),
    (["search", "--latency-ms", "5", "--latency-margin", "1"], "--latency-margin"),
    (["search", "--latency-ms", "5", "--verify", "-1"], "--verify"),
    (["extract", "--out", "x.pt"], "exactly one of --config"),
    (["extract", "--config", "{\"kernel\": [4]}", "--out", "x.pt"], "kernel"),
])
def test_misuse_is_one_line_and_exit_2(supernet: Path, tmp_path: Path, args: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["elastic", *args, "--supernet", str(supernet), *QUICK]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_sandwich_with_scratch_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["elastic", "train", "--model", "elastic_cnn1d", "--data", "mnist1d", "--scratch", "min",
                 "--sandwich", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sandwich" in err and len(err.splitlines()) == 1


def test_a_file_that_is_not_a_supernet_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bogus = tmp_path / "x.pt"
    bogus.write_bytes(b"not a checkpoint")
    assert main(["elastic", "search", "--supernet", str(bogus), "--latency-ms", "1", *QUICK]) == 2
    assert "not a lowcomm elastic file" in capsys.readouterr().err

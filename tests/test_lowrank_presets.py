"""Hybrid presets reproduce Pufferfish's model sizes; the summary reports before/after."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from lowcomm import models
from lowcomm.cli import main
from lowcomm.lowrank import factorize
from lowcomm.lowrank.summary import count_macs, example_input, summary

# (model, full count, Pufferfish's factorized count, counted by)
PAPER = [
    ("resnet18", 11_173_962, 3_336_138, models.count_parameters),
    ("vgg19", 20_560_330, 8_370_634, models.count_parameters),
    ("resnet50_imagenet", 25_557_032, 15_202_344, models.count_parameters),
    ("wide_resnet50_2", 68_883_240, 40_047_400, models.count_parameters),
    ("lstm_lm", 85_962_278, 67_962_278, models.count_parameters),
    ("transformer", 44_103_680, 21_821_440, models.non_embedding_parameters),
]


@pytest.mark.parametrize("name, full, paper, count", PAPER, ids=[p[0] for p in PAPER])
def test_preset_reproduces_paper_parameter_count_within_one_percent(name, full, paper, count) -> None:  # type: ignore[no-untyped-def]
    with torch.device("meta"):  # shapes only: no memory, no SVD
        model = models.create(name)
    assert count(model) == full
    model = factorize(model, inplace=True)  # full_rank=None: the preset registered for model.lowcomm_name
    got = count(model)
    assert abs(got - paper) / paper < 0.01, (got, paper)


def test_resnet18_preset_keeps_stem_first_block_shortcuts_and_fc_dense() -> None:
    with torch.device("meta"):
        model = factorize(models.create("resnet18"))
    assert type(model.conv1) is torch.nn.Conv2d and type(model.fc) is torch.nn.Linear
    assert type(model.layer1[0].conv1) is torch.nn.Conv2d
    assert type(model.layer2[0].downsample[0]) is torch.nn.Conv2d
    assert type(model.layer2[0].conv1).__name__ == "LowRankConv"


def test_summary_macs_match_paper_scale_for_cifar_models() -> None:
    with torch.device("meta"):
        dense = models.create("resnet18")
        fact = factorize(models.create("resnet18"))
    s = summary(dense, fact, example=example_input(dense))
    # Pufferfish: 0.56G -> 0.22G multiply-adds
    assert round(s["macs"]["before"] / 1e9, 2) == 0.56 and round(s["macs"]["after"] / 1e9, 2) == 0.22
    assert s["grad_bytes_per_step"]["after"] == 4 * s["params"]["after"]
    # a factorized model alone gives the same before/after from its dense equivalents
    alone = summary(fact, example=example_input(dense))
    assert alone["params"] == s["params"] and alone["macs"] == s["macs"]


def test_mac_counter_agrees_with_hand_count() -> None:
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(40, 5))
    macs, dense = count_macs(model, torch.zeros(1, 2, 10))
    assert macs == dense == 10 * 4 * 2 * 3 + 40 * 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fact = factorize(model, rank_ratio=0.25, full_rank=[], inplace=False)
    macs, dense = count_macs(fact, torch.zeros(1, 2, 10))
    r = 1  # conv: min(4, 6)/4 = 1; linear: min(5, 40)/4 = 1
    assert dense == 10 * 4 * 2 * 3 + 40 * 5
    assert macs == 10 * (r * 6 + 4 * r) + (40 * r + r * 5)


def test_cli_summary_prints_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["lowrank", "summary", "--model", "vgg19", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "parameters" in printed and "20,560,330" in printed and "8,370,634" in printed
    data = json.loads(out.read_text())
    assert data["params"] == {"before": 20_560_330, "after": 8_370_634, "reduction": pytest.approx(2.4562, abs=1e-4)}
    assert data["macs"]["before"] > data["macs"]["after"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "resnet18", "--rank-ratio", "0"], "rank-ratio must be in (0, 1]"),
        (["--model", "resnet18", "--full-rank", "layer9"], "matches no module"),
        (["--model", "nonet"], "unknown model"),
    ],
)
def test_cli_summary_bad_input_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lowrank", "summary", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

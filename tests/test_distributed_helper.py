"""The multi-rank test helper returns each rank's result, reports a failing rank with its
output, and leaves no folder behind either way (a suite runs it thousands of times)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist

from lowcomm.testing.distributed import DistributedTestFailure, run_distributed


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def rank_one_fails() -> None:
    if dist.get_rank() == 1:
        print("rank one says goodbye")
        raise ValueError("deliberate failure on rank 1")


def test_results_come_back_in_rank_order_and_no_folder_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert run_distributed(rank_and_world, 2) == [(0, 2), (1, 2)]
    assert list(tmp_path.iterdir()) == []


def test_a_failing_rank_is_reported_with_its_output_and_no_folder_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(DistributedTestFailure) as err:
        run_distributed(rank_one_fails, 2, timeout=60)
    assert "deliberate failure on rank 1" in str(err.value)
    assert "rank one says goodbye" in str(err.value)
    assert list(tmp_path.iterdir()) == []

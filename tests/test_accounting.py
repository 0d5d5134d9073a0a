"""The accounting layer counts ring-model wire bytes for each collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.testing import distributed, run_distributed


def test_wire_bytes_formulas() -> None:
    assert accounting.wire_bytes("all_reduce", 400, 4) == 2 * 3 * 400 // 4
    assert accounting.wire_bytes("reduce_scatter", 400, 4) == 300
    assert accounting.wire_bytes("all_gather", 100, 4) == 300
    assert accounting.wire_bytes("broadcast", 100, 4, is_src=False) == 0
    assert accounting.wire_bytes("all_reduce", 400, 1) == 0
    with pytest.raises(ValueError):
        accounting.wire_bytes("gossip", 1, 2)


def _all_reduce_known_tensor() -> dict:
    t = torch.ones(1000, dtype=torch.float32) * (dist.get_rank() + 1)
    accounting.all_reduce(t, tag="test")
    assert torch.all(t == sum(range(1, dist.get_world_size() + 1)))
    return accounting.ledger().as_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_of_known_tensor_counts_expected_bytes(world: int) -> None:
    for led in run_distributed(_all_reduce_known_tensor, world):
        expected = 2 * (world - 1) * 4000 // world
        assert led["by_collective"]["all_reduce"] == {"calls": 1, "payload_bytes": 4000, "wire_bytes": expected}
        assert led["by_tag"]["test"]["wire_bytes"] == expected


@distributed(world_size=2)
def test_gather_scatter_and_broadcast_are_counted() -> None:
    rank = dist.get_rank()
    x = torch.arange(8, dtype=torch.float64) + rank
    shard = torch.empty(4, dtype=torch.float64)
    accounting.reduce_scatter_tensor(shard, x)
    full = torch.empty(8, dtype=torch.float64)
    accounting.all_gather_into_tensor(full, shard)
    assert torch.equal(full, 2 * torch.arange(8, dtype=torch.float64) + 1)
    b = torch.zeros(3)
    accounting.broadcast(b, src=0)
    led = accounting.ledger().as_dict()["by_collective"]
    assert led["reduce_scatter"]["wire_bytes"] == 32  # (P-1)/P * 64 bytes
    assert led["all_gather"]["wire_bytes"] == 32  # (P-1) * 32 bytes
    assert led["broadcast"]["wire_bytes"] == (12 if rank == 0 else 0)

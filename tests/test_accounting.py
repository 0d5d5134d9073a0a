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


# --- which devices a group can carry ----------------------------------------------------------
@pytest.mark.parametrize("config", ["cuda:nccl", "nccl"])
def test_cpu_tensor_is_refused_on_a_group_without_a_cpu_backend(config: str) -> None:
    with pytest.raises(accounting.BackendDeviceError, match=r"cpu tensor.*cpu:gloo,cuda:nccl"):
        accounting.check_device_supported(config, "cpu", what="all_reduce (tag 'eval')")


def test_mixed_backend_config_serves_each_device_with_its_own_backend() -> None:
    assert accounting.check_device_supported("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert accounting.check_device_supported("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert accounting.check_device_supported("gloo", "cuda") == "gloo"  # as torch expands it
    with pytest.raises(accounting.BackendDeviceError, match="meta"):
        accounting.check_device_supported("cpu:gloo,cuda:nccl", "meta")


def test_malformed_backend_config_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="malformed"):
        accounting.parse_backend_config("cpu:gloo,cuda")


@distributed(world_size=2)
def test_collective_on_a_device_the_group_lacks_is_refused_before_counting() -> None:
    # a gloo group registered for cuda only: on a CPU machine, the same situation as a CPU
    # tensor on init_process_group("nccl")
    cuda_only = dist.new_group([0, 1], backend="cuda:gloo")
    with pytest.raises(accounting.BackendDeviceError, match=r"all_reduce \(tag 'eval'\).*cpu tensor"):
        accounting.all_reduce(torch.ones(3), group=cuda_only, tag="eval")
    with pytest.raises(accounting.BackendDeviceError, match="broadcast"):
        accounting.broadcast(torch.ones(3), 0, group=cuda_only)
    with pytest.raises(accounting.BackendDeviceError, match="p2p"):
        peer = 1 - dist.get_rank()
        accounting.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), peer, cuda_only)])
    assert accounting.ledger().as_dict()["wire_bytes"] == 0  # nothing refused was counted
    # the default (gloo) group still carries the same CPU tensor
    t = torch.ones(3)
    accounting.all_reduce(t, tag="ok")
    assert torch.equal(t, torch.full((3,), 2.0))
    assert accounting.device_backend(None, t.device) == "gloo"


@distributed(world_size=2)
def test_tensors_of_one_collective_on_different_devices_are_refused() -> None:
    out = torch.empty(4, device="meta")
    with pytest.raises(accounting.BackendDeviceError, match="one device"):
        accounting.all_gather_into_tensor(out, torch.ones(2))


@distributed(world_size=2)
def test_batched_exchange_counts_sends_on_the_sender_only() -> None:
    rank = dist.get_rank()
    peer = 1 - rank
    send = torch.full((1000,), float(rank + 1))
    recv = torch.empty(1000)
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    works = accounting.batch_isend_irecv(ops, tag="swap")
    assert len(works) == 2
    for w in works:
        w.wait()
    assert torch.equal(recv, torch.full((1000,), float(peer + 1)))
    # one-directional batch: only rank 0 sends
    one = torch.zeros(10)
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.ones(10), 1)]
    else:
        ops = [dist.P2POp(dist.irecv, one, 0)]
    for w in accounting.batch_isend_irecv(ops, tag="one"):
        w.wait()
    led = accounting.ledger().as_dict()["by_tag"]
    assert led["swap"] == {"calls": 1, "payload_bytes": 4000, "wire_bytes": 4000}
    if rank == 0:
        assert led["one"]["wire_bytes"] == 40
    else:
        assert "one" not in led and torch.equal(one, torch.ones(10))
    assert accounting.batch_isend_irecv([], tag="none") == []


@distributed(world_size=2)
def test_list_gather_all_to_all_and_point_to_point_are_counted() -> None:
    rank = dist.get_rank()
    peer = 1 - rank
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    outs = [torch.empty(4) for _ in range(2)]
    accounting.all_gather(outs, x, tag="ag")
    assert torch.equal(outs[peer], torch.arange(4, dtype=torch.float32) + 10 * peer)
    received = torch.empty(4)
    accounting.all_to_all_single(received, x, tag="a2a")
    # rank r receives chunk r of every rank: [x_0[2r:2r+2], x_1[2r:2r+2]]
    expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 10 * src for src in (0, 1)])
    assert torch.equal(received, expect)
    got = torch.empty(3)
    if rank == 0:
        accounting.isend(torch.full((3,), 7.0), 1, tag="p").wait()
    else:
        accounting.irecv(got, 0, tag="p").wait()
        assert torch.equal(got, torch.full((3,), 7.0))
    led = accounting.ledger().as_dict()["by_tag"]
    assert led["ag"] == {"calls": 1, "payload_bytes": 16, "wire_bytes": 16}  # (P-1) * 16
    assert led["a2a"] == {"calls": 1, "payload_bytes": 16, "wire_bytes": 8}  # (P-1)/P * 16
    if rank == 0:
        assert led["p"] == {"calls": 1, "payload_bytes": 12, "wire_bytes": 12}
    else:
        assert "p" not in led  # receives are not counted

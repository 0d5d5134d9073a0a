"""Topology: torchrun's layout, the refusals, the per-level groups and the ledger's link classes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm import accounting, transport
from lowcomm.comm.topology import Topology, link_of_group, link_of_peer, node_groups
from lowcomm.compress.codec import Message
from lowcomm.errors import UsageError
from lowcomm.testing import distributed


def test_layout_is_contiguous_like_torchrun() -> None:
    t = Topology(world=8, local_size=4, rank=6)
    assert (t.nodes, t.node, t.local_rank, t.hierarchical) == (2, 1, 2, True)
    assert t.intra_ranks() == [4, 5, 6, 7]
    assert t.inter_ranks() == [2, 6]
    assert link_of_peer(t, 5) == "intra" and link_of_peer(t, 1) == "inter"


@pytest.mark.parametrize("world,local", [(4, 4), (4, 1), (1, 1)])
def test_one_level_is_not_hierarchical(world: int, local: int) -> None:
    assert not Topology(world, local, 0).hierarchical


@pytest.mark.parametrize("world,local,rank", [(6, 4, 0), (4, 0, 0), (4, 2, 4), (0, 1, 0)])
def test_bad_sizes_are_refused_with_the_valid_ones(world: int, local: int, rank: int) -> None:
    with pytest.raises(UsageError) as e:
        Topology(world, local, rank)
    if world == 6:
        assert "valid workers per node: 1, 2, 3, 6" in str(e.value)


def test_from_env_gpus_per_node_wins_over_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_env() == Topology(8, 4, 3)
    assert Topology.from_env(gpus_per_node=2) == Topology(8, 2, 3)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Topology.from_env() == Topology(8, 8, 3)  # one node of every worker
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(UsageError, match="valid workers per node: 1, 2, 4, 8"):
        Topology.from_env()


def test_from_env_without_anything_is_one_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    assert Topology.from_env() == Topology(1, 1, 0)


def test_ledger_splits_a_flat_world_collective_by_the_ring_model() -> None:
    led = accounting.Ledger()
    led.record("all_reduce", "t", 800, 1200, inter=(400, 600))
    led.record("all_reduce", "t", 100, 150)
    d = led.as_dict()
    assert d["by_link"]["inter"] == {"calls": 1, "payload_bytes": 400, "wire_bytes": 600}
    assert d["by_link"]["intra"] == {"calls": 2, "payload_bytes": 500, "wire_bytes": 750}
    assert led.inter_wire_bytes + led.intra_wire_bytes == led.wire_bytes


def _groups_and_links() -> dict[str, object]:
    topo = Topology.from_env(gpus_per_node=2)
    accounting.set_topology(topo)
    try:
        groups = node_groups(topo)
        assert node_groups(topo) is groups  # cached
        assert link_of_group(groups.intra) == "intra" and link_of_group(groups.inter) == "inter"
        out: dict[str, object] = {
            "intra": dist.get_process_group_ranks(groups.intra),
            "inter": dist.get_process_group_ranks(groups.inter),
        }
        led = accounting.ledger()
        led.reset()
        n = 64  # float32 elements
        accounting.all_reduce(torch.ones(n), group=groups.intra, tag="i")
        out["intra_only"] = dict(led.as_dict()["by_link"])
        led.reset()
        accounting.all_reduce(torch.ones(n), group=groups.inter, tag="x")
        out["inter_only"] = dict(led.as_dict()["by_link"])
        led.reset()
        accounting.all_reduce(torch.ones(n), tag="w")  # flat ring over 2 nodes of 2
        out["world"] = dict(led.as_dict()["by_link"])
        led.reset()
        # a scoped message: reduce-scatter inside the node, through the transport
        msg = Message(torch.full((4,), float(dist.get_rank())), "reduce_scatter", scope="intra")
        out["rs"] = transport.start(msg, tag="rs", async_op=False, topology=topo).wait().tolist()
        out["rs_links"] = dict(led.as_dict()["by_link"])
        led.reset()
        # p2p to the same local rank on the other node: inter
        peer = (dist.get_rank() + 2) % 4
        buf, recv = torch.ones(8), torch.empty(8)
        ops = [dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, recv, peer)]
        for w in accounting.batch_isend_irecv(ops, tag="p"):
            w.wait()
        out["p2p"] = dict(led.as_dict()["by_link"])
        return out
    finally:
        accounting.set_topology(None)


@distributed(world_size=4)
def test_groups_and_link_classes_on_two_nodes_of_two() -> None:
    out = _groups_and_links()
    rank = dist.get_rank()
    assert out["intra"] == ([0, 1] if rank < 2 else [2, 3])
    assert out["inter"] == ([0, 2] if rank % 2 == 0 else [1, 3])
    n = 64 * 4
    # 2-worker groups: all-reduce wire 2(P-1)/P n = n
    assert out["intra_only"] == {"intra": {"calls": 1, "payload_bytes": n, "wire_bytes": n},
                                 "inter": {"calls": 0, "payload_bytes": 0, "wire_bytes": 0}}
    assert out["inter_only"] == {"inter": {"calls": 1, "payload_bytes": n, "wire_bytes": n},
                                 "intra": {"calls": 0, "payload_bytes": 0, "wire_bytes": 0}}
    # world ring of 4: wire 2*3/4 n, 1/local_size of it inter
    wire = 2 * 3 * n // 4
    assert out["world"]["inter"]["wire_bytes"] == wire // 2  # type: ignore[index]
    assert out["world"]["intra"]["wire_bytes"] == wire - wire // 2  # type: ignore[index]
    # intra reduce-scatter of [r, r, r, r] over {2k, 2k+1}: chunk i holds the node's sum
    node_sum = float(sum(out["intra"]))  # type: ignore[arg-type]
    assert out["rs"] == [node_sum, node_sum]
    assert out["rs_links"]["intra"]["wire_bytes"] == 16 // 2  # type: ignore[index]
    assert out["rs_links"]["inter"]["wire_bytes"] == 0  # type: ignore[index]
    assert out["p2p"]["inter"]["wire_bytes"] == 32  # type: ignore[index]
    assert out["p2p"]["intra"]["wire_bytes"] == 0  # type: ignore[index]


def _flat_fallback() -> tuple[list[float], dict[str, dict[str, int]]]:
    topo = Topology.from_env()  # LOCAL_WORLD_SIZE = world: one node
    assert not topo.hierarchical and node_groups(topo).intra is None
    accounting.ledger().reset()
    msg = Message(torch.ones(4), "reduce_scatter", scope="inter")
    got = transport.start(msg, tag="rs", async_op=False, topology=topo).wait().tolist()
    return got, dict(accounting.ledger().as_dict()["by_link"])


@distributed(world_size=2)
def test_a_scoped_message_runs_on_the_world_on_one_node() -> None:
    got, links = _flat_fallback()
    assert got == [2.0, 2.0]
    assert links["inter"]["wire_bytes"] == 0 and links["intra"]["wire_bytes"] == 8

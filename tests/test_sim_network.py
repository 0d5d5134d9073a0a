"""α-β network model: closed forms, accounting-consistent bytes, presets and parsing."""

from __future__ import annotations

import math

import pytest

from lowcomm.comm.accounting import wire_bytes
from lowcomm.errors import UsageError
from lowcomm.sim.network import Link, NetworkModel, collective_wire_bytes, parse_network, parse_rate

A, B = 1e-3, 1e-6  # α = 1 ms, β = 1 µs per byte
NET = NetworkModel(inter=Link(A, B))


@pytest.mark.parametrize("p", [2, 3, 4, 8, 64])
def test_ring_collectives_match_alpha_beta_formulas(p: int) -> None:
    n = 4096.0 * p
    assert NET.all_reduce(n, p) == pytest.approx(2 * (p - 1) * A + 2 * (p - 1) / p * n * B, rel=1e-12)
    assert NET.reduce_scatter(n, p) == pytest.approx((p - 1) * A + (p - 1) / p * n * B, rel=1e-12)
    # all-gather takes the per-worker input: full output is p·n_local
    assert NET.all_gather(n / p, p) == pytest.approx((p - 1) * A + (p - 1) / p * n * B, rel=1e-12)
    assert NET.broadcast(n, p) == pytest.approx(math.ceil(math.log2(p)) * (A + n * B), rel=1e-12)


def test_all_reduce_equals_reduce_scatter_plus_all_gather() -> None:
    p, n = 8, 8e6
    assert NET.all_reduce(n, p) == pytest.approx(NET.reduce_scatter(n, p) + NET.all_gather(n / p, p))


def test_tree_all_reduce_trades_latency_for_bandwidth() -> None:
    tree = NetworkModel(inter=Link(A, B), algorithm="tree")
    p, n = 64, 1000.0
    assert tree.all_reduce(n, p) == pytest.approx(2 * 6 * A + 2 * n * B)
    assert tree.all_reduce(n, p) < NET.all_reduce(n, p)  # small message: latency wins
    assert tree.all_reduce(1e9, p) > NET.all_reduce(1e9, p)  # large message: ring wins


def test_hierarchical_all_reduce_uses_intra_and_inter_links() -> None:
    intra, inter = Link(1e-6, 1e-9), Link(A, B)
    net = NetworkModel(inter=inter, intra=intra, algorithm="hierarchical", gpus_per_node=4)
    p, n, g, nodes = 16, 1.6e6, 4, 4
    expect = (2 * (g - 1) * intra.alpha_s + 2 * (g - 1) / g * n * intra.beta_s_per_byte
              + 2 * (nodes - 1) * A + 2 * (nodes - 1) / nodes * (n / g) * B)
    assert net.all_reduce(n, p) == pytest.approx(expect, rel=1e-12)
    assert net.all_reduce(n, p) < NET.all_reduce(n, p)


def test_single_worker_communicates_nothing() -> None:
    for f in (NET.all_reduce, NET.reduce_scatter, NET.all_gather, NET.broadcast):
        assert f(1e6, 1) == 0.0


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_wire_bytes_are_the_accounting_layers(coll: str) -> None:
    for p in (1, 2, 4, 7):
        assert collective_wire_bytes(coll, 1000 * p, p) == wire_bytes(coll, 1000 * p, p)
    # and the β term of the ring formulas is exactly wire bytes · β
    p, n = 4, 4000
    assert NET.all_reduce(n, p) - 2 * (p - 1) * A == pytest.approx(wire_bytes("all_reduce", n, p) * B)
    assert NET.all_gather(n, p) - (p - 1) * A == pytest.approx(wire_bytes("all_gather", n, p) * B)


def test_from_probe_sets_alpha_half_rtt_and_beta_from_bandwidth() -> None:
    net = NetworkModel.from_probe(1e9, 2e-3)
    assert net.alpha_s == pytest.approx(1e-3)
    assert net.beta_s_per_byte == pytest.approx(8e-9)
    with pytest.raises(UsageError):
        NetworkModel.from_probe(0, 1e-3)


def test_presets_cover_ethernet_infiniband_nvlink() -> None:
    for name in ("1gbit", "10gbit", "25gbit", "100gbit", "infiniband", "nvlink"):
        assert NetworkModel.preset(name).beta_s_per_byte > 0
    assert NetworkModel.preset("10gbit").inter.bandwidth_bits_per_s == pytest.approx(10e9)
    assert NetworkModel.preset("ib").name == "infiniband"


def test_parse_network_accepts_presets_rates_and_options() -> None:
    assert parse_rate("100mbit") == 1e8
    net = parse_network("100mbit,delay=5ms")
    assert net.inter.bandwidth_bits_per_s == pytest.approx(1e8)
    assert net.alpha_s == pytest.approx(5e-3)
    assert parse_network("10gbit,algo=tree").algorithm == "tree"
    h = parse_network("100gbit,intra=nvlink,gpus_per_node=8")
    assert h.algorithm == "hierarchical" and h.gpus_per_node == 8


@pytest.mark.parametrize("bad", ["", "fast", "10gbit,algo=star", "1gbit,delay=x", "1gbit,foo=1", "1gbit,delay"])
def test_parse_network_refuses_bad_specs(bad: str) -> None:
    with pytest.raises(UsageError):
        parse_network(bad)

"""The simulator's two-level topology: nodes of G workers behind one shared NIC, flat ring vs
hierarchical vs hybrid all-reduce, scoped codec rounds and the ``hier`` schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm.cli import main as cli_main
from lowcomm.compress.codec import CODECS
from lowcomm.errors import UsageError
from lowcomm.sim import ComputeCosts, LayerProfile, Link, NetworkModel, Profile, predict_iteration_time
from lowcomm.sim.network import parse_intra, parse_network
from lowcomm.sim.schedules import Sim

AE, BE = 1e-4, 8 / 1e9  # between nodes: 100 µs, 1 Gbit/s
AI, BI = 1e-5, 8 / 20e9  # inside a node: 10 µs, 20 Gbit/s
INTER, INTRA = Link(AE, BE), Link(AI, BI)
N_BYTES = 100e6


def two_level(g: int, algorithm: str = "ring", nic: str = "node") -> NetworkModel:
    return NetworkModel.two_level(INTER, INTRA, g, algorithm=algorithm, nic=nic)


def flat_formula(n: float, p: int) -> float:
    return 2 * (p - 1) * AE + 2 * (p - 1) / p * n * BE


def hier_formula(n: float, nodes: int, g: int) -> float:
    return (2 * (g - 1) * AI + 2 * (g - 1) / g * n * BI
            + 2 * (nodes - 1) * AE + 2 * (nodes - 1) / nodes * n * BE)


def sim_of(net: NetworkModel, p: int) -> Sim:
    prof = Profile(model="one", batch_size=8, optimizer_s=0.0, costs=ComputeCosts(),
                   layers=[LayerProfile("fc", 0.0, 0.0, [[1000]])])
    return Sim(prof, p, net)


# -- bytes on a node's NIC -----------------------------------------------------------------
@pytest.mark.parametrize(("nodes", "g", "limit"), [(2, 2, 1.5), (2, 4, 1.75), (4, 8, 2 * 31 / 32 / 1.5)])
def test_node_nic_bytes_flat_ring_is_2_p_minus_1_over_p_n_hierarchical_2_n_minus_1_over_n_n(
        nodes: int, g: int, limit: float) -> None:
    p, payload = nodes * g, 4_000_000 * nodes * g
    net = two_level(g)
    flat_nic = g * net.inter_bytes("all_reduce", payload, p, algorithm="flat")
    hier_nic = g * net.inter_bytes("all_reduce", payload, p, algorithm="hierarchical")
    assert flat_nic == pytest.approx(2 * (p - 1) / p * payload)
    assert hier_nic == pytest.approx(2 * (nodes - 1) / nodes * payload)
    assert flat_nic / hier_nic == pytest.approx(limit)


def test_hierarchical_wire_bytes_are_intra_reduce_scatter_inter_all_reduce_intra_all_gather() -> None:
    nodes, g, payload = 2, 4, 8_000_000
    net = two_level(g)
    shard = payload // g
    expect = (g - 1) / g * payload + 2 * (nodes - 1) / nodes * shard + (g - 1) * shard
    assert net.wire_bytes_of("all_reduce", payload, nodes * g, algorithm="hierarchical") == pytest.approx(expect)
    assert net.wire_bytes_of("all_reduce", payload, nodes * g) == pytest.approx(2 * 7 / 8 * payload)


# -- time ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("nodes", "g"), [(2, 2), (2, 4), (4, 8)])
def test_flat_and_hierarchical_times_follow_their_formulas(nodes: int, g: int) -> None:
    p = nodes * g
    net = two_level(g)
    assert net.flat_all_reduce(N_BYTES, p) == pytest.approx(flat_formula(N_BYTES, p), rel=1e-12)
    assert net.hierarchical_all_reduce(N_BYTES, p) == pytest.approx(hier_formula(N_BYTES, nodes, g), rel=1e-12)
    assert net.all_reduce(N_BYTES, p) == pytest.approx(flat_formula(N_BYTES, p), rel=1e-12)  # algo=ring


@pytest.mark.parametrize(("g", "ratio"), [(2, 1.5), (4, 1.75)])
def test_time_ratio_reaches_the_byte_limit_when_only_the_node_link_costs(g: int, ratio: float) -> None:
    free = Link(0.0, 0.0)
    net = NetworkModel.two_level(Link(0.0, BE), free, g)
    assert net.flat_all_reduce(N_BYTES, 2 * g) / net.hierarchical_all_reduce(N_BYTES, 2 * g) == pytest.approx(ratio)
    # with real intra-node and latency costs the speed-up stays below the limit
    real = two_level(g)
    assert 1 < real.flat_all_reduce(N_BYTES, 2 * g) / real.hierarchical_all_reduce(N_BYTES, 2 * g) < ratio


def test_a_nic_per_worker_keeps_the_multi_rail_formula() -> None:
    net = two_level(4, algorithm="hierarchical", nic="gpu")
    nodes, g = 2, 4
    expect = (2 * (g - 1) * AI + 2 * (g - 1) / g * N_BYTES * BI
              + 2 * (nodes - 1) * AE + 2 * (nodes - 1) / nodes * (N_BYTES / g) * BE)
    assert net.all_reduce(N_BYTES, 8) == pytest.approx(expect, rel=1e-12)


def test_hybrid_takes_the_faster_per_message() -> None:
    slow_intra = NetworkModel.two_level(INTER, Link(5e-3, BI), 4, algorithm="hybrid")
    tiny, big = 1_000.0, 100e6
    assert slow_intra.hybrid_choice(tiny, 8) == "flat"  # 6 slow intra steps cost more than 12 node steps
    assert slow_intra.hybrid_choice(big, 8) == "hierarchical"
    for n in (tiny, big):
        assert slow_intra.all_reduce(n, 8) == pytest.approx(
            min(slow_intra.flat_all_reduce(n, 8), slow_intra.hierarchical_all_reduce(n, 8)))


def test_one_node_is_a_ring_on_the_intra_link_and_sends_nothing_between_nodes() -> None:
    net = two_level(4, algorithm="hybrid")
    assert net.levels(4) is None
    assert net.all_reduce(N_BYTES, 4) == pytest.approx(2 * 3 * AI + 2 * 3 / 4 * N_BYTES * BI)
    assert net.inter_bytes("all_reduce", 1000, 4) == 0.0


# -- scoped codec rounds ---------------------------------------------------------------------
def test_scoped_rounds_run_on_the_node_or_the_same_local_rank_group() -> None:
    nodes, g, n = 2, 4, 8e6
    net = two_level(g)
    p = nodes * g
    assert net.scoped("reduce_scatter", n, p, "intra") == pytest.approx((g - 1) * AI + (g - 1) / g * n * BI)
    # G concurrent all-gathers among the N nodes share the node's NIC
    assert net.scoped("all_gather", n, p, "inter") == pytest.approx((nodes - 1) * AE + (nodes - 1) * n * BE * g)
    assert net.inter_bytes("all_gather", 1000, p, "inter") == 1000 * (nodes - 1)
    assert net.inter_bytes("reduce_scatter", 1000, p, "intra") == 0.0


def test_scoped_rounds_fall_back_to_all_workers_without_a_two_level_topology() -> None:
    flat = NetworkModel(inter=INTER)
    assert flat.scoped("all_gather", 1e6, 8, "inter") == pytest.approx(flat.all_gather(1e6, 8))
    sim = sim_of(flat, 8)
    task = sim.collective("ag", "all_gather", 1000, 1, scope="intra")
    assert task.duration == pytest.approx(flat.all_gather(1000, 8))
    assert task.inter_bytes == task.wire_bytes  # one worker per node: every byte leaves it


def test_sim_collective_records_inter_node_bytes_by_scope() -> None:
    sim = sim_of(two_level(2), 4)
    rs = sim.collective("rs", "reduce_scatter", 4000, 1, scope="intra")
    ag = sim.collective("ag", "all_gather", 1000, 1, scope="inter")
    assert (rs.wire_bytes, rs.inter_bytes) == (2000, 0.0)
    assert (ag.wire_bytes, ag.inter_bytes) == (1000, 1000.0)


@pytest.mark.skipif("hitopk" not in CODECS, reason="the hitopk codec is not registered in this build")
def test_hitopk_sends_at_most_one_gth_of_topk_between_nodes() -> None:
    prof = Profile(model="one", batch_size=8, optimizer_s=0.0, costs=ComputeCosts(),
                   layers=[LayerProfile("fc", 1e-3, 2e-3, [[1024, 1024]])])
    net = two_level(4)
    hi = predict_iteration_time(prof, "hitopk", workers=8, network=net)
    tk = predict_iteration_time(prof, "topk", workers=8, network=net)
    assert 0 < hi.inter_node_bytes_per_worker <= tk.inter_node_bytes_per_worker / 4 * 1.01


# -- the hier schedule -----------------------------------------------------------------------
F, BW = 2e-3, 4e-3


def one_layer() -> Profile:
    return Profile(model="one", batch_size=8, optimizer_s=0.0, costs=ComputeCosts(),
                   layers=[LayerProfile("fc", F, BW, [[2048, 2048]])])


@pytest.mark.parametrize("mode", ["hier", "flat", "hybrid"])
def test_hier_schedule_is_compute_plus_its_modes_all_reduce(mode: str) -> None:
    nodes, g = 2, 4
    net = two_level(g)
    n = 2048 * 2048 * 4
    pred = predict_iteration_time(one_layer(), f"hier:mode={mode}", workers=nodes * g, network=net)
    comm = {"hier": hier_formula(n, nodes, g), "flat": flat_formula(n, nodes * g)}
    comm["hybrid"] = min(comm.values())
    assert pred.iter_time_s == pytest.approx(F + BW + comm[mode], rel=1e-9)
    flat_nic = 2 * 7 / 8 * n
    assert pred.inter_node_bytes_per_worker * g == pytest.approx(flat_nic if mode == "flat" else 2 * 1 / 2 * n)


def test_hier_flat_equals_ssgd_on_one_bucket() -> None:
    net = two_level(2)
    a = predict_iteration_time(one_layer(), "hier:mode=flat", workers=4, network=net)
    b = predict_iteration_time(one_layer(), "ssgd", workers=4, network=net)
    assert a.iter_time_s == pytest.approx(b.iter_time_s, rel=1e-12)


# -- parsing and the CLI ---------------------------------------------------------------------
def test_network_spec_takes_nic_and_hybrid_and_intra_rates() -> None:
    net = parse_network("1gbit,intra=loopback,gpus_per_node=4,algo=hybrid,nic=node")
    assert (net.algorithm, net.gpus_per_node, net.nic) == ("hybrid", 4, "node")
    assert parse_intra("20gbit").bandwidth_bits_per_s == pytest.approx(20e9)
    with pytest.raises(UsageError, match="valid: gpu, node"):
        parse_network("1gbit,intra=nvlink,gpus_per_node=4,nic=switch")
    with pytest.raises(UsageError, match="valid: loopback"):
        parse_intra("warp")
    with pytest.raises(UsageError, match="two-level"):
        parse_network("1gbit,algo=hybrid")


def test_simulate_cli_runs_nodes_times_gpus_per_node_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    one_layer().save(prof)
    out = tmp_path / "sim.json"
    code = cli_main(["simulate", "--profile", str(prof), "--nodes", "2", "--gpus-per-node", "4", "--net", "1gbit",
                     "--intra", "loopback", "--methods", "ssgd,hier,hier:mode=hybrid", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["workers"] == [8] and result["network"]["nic"] == "node"
    rows = {r["method"]: r for r in result["results"]}
    assert rows["hier"]["iter_time_s"] < rows["ssgd"]["iter_time_s"]
    assert rows["hier"]["inter_node_bytes_per_worker"] < rows["ssgd"]["inter_node_bytes_per_worker"]


def test_simulate_cli_refuses_a_zero_node_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    one_layer().save(prof)
    assert cli_main(["simulate", "--profile", str(prof), "--nodes", "0", "--gpus-per-node", "4"]) == 2
    assert "--nodes" in capsys.readouterr().err


def test_hier_hybrid_with_pinned_link_costs_follows_the_methods_own_rule() -> None:
    net = two_level(4)
    # intra-node collectives pinned as very slow: the method's rule keeps the group flat
    spec = "hier:mode=hybrid,alpha_intra=10,beta_intra=0,alpha_inter=0,beta_inter=0"
    pred = predict_iteration_time(one_layer(), spec, workers=8, network=net)
    flat = predict_iteration_time(one_layer(), "hier:mode=flat", workers=8, network=net)
    assert pred.iter_time_s == pytest.approx(flat.iter_time_s, rel=1e-12)

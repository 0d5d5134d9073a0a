"""Hierarchical all-reduce on 4 gloo ranks as 2 nodes x 2: same sum as the flat all-reduce, bytes
on each link as the formulas say, the ``hier`` schedule trains like DDP, the hybrid rule.

Tolerance (tests/tolerance.py): the hierarchical sum adds the node sums (one rounding each) and
then the two nodes (one more); the ring adds the four terms in another order. Both are sums of
``world`` terms, so each side has at most ``world - 1`` roundings: ops = world.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm import hooks, methods
from lowcomm.cli import main
from lowcomm.comm import accounting
from lowcomm.comm.hierarchical import (
    LinkCosts,
    choose,
    flat_time,
    hier_time,
    hierarchical_all_reduce,
)
from lowcomm.comm.topology import Topology, node_groups
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.sched.cost import AlphaBeta
from lowcomm.testing import distributed, run_distributed
from test_sched_correctness import check, compare_with_ddp
from tolerance import rel_err, tolerance

methods.names()  # load the method modules before forking

TWO_BY_TWO = 2  # workers per node in the 4-rank tests


def _two_nodes() -> Topology:
    topo = Topology.from_env(gpus_per_node=TWO_BY_TWO)
    accounting.set_topology(topo)
    return topo


# --- the collective ----------------------------------------------------------------------------
def _sum_both_ways(numel: int, dtype: torch.dtype, piece_bytes: int = 4 << 20) -> tuple[float, float, dict[str, Any]]:
    topo = _two_nodes()
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    flat = x.clone()
    dist.all_reduce(flat)
    hier = x.clone()
    led = accounting.ledger()
    led.reset()
    hierarchical_all_reduce(hier, topo, node_groups(topo), tag="h", piece_bytes=piece_bytes)
    exact = x.to(torch.float64).clone()
    dist.all_reduce(exact)
    return rel_err(hier, exact), rel_err(flat, exact), led.as_dict()


@pytest.mark.parametrize("numel", [64, 33])  # 33: padded to a multiple of 2 (a copy)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hierarchical_sum_equals_the_flat_all_reduce(numel: int, dtype: torch.dtype) -> None:
    results = run_distributed(_sum_both_ways, 4, numel, dtype)
    tol = tolerance(dtype, ops=4)
    for hier_err, flat_err, _ in results:
        assert hier_err <= tol and flat_err <= tol, (hier_err, flat_err, tol)


def test_ledger_bytes_per_link_follow_the_formulas() -> None:
    n_elems = 64
    results = run_distributed(_sum_both_ways, 4, n_elems, torch.float32)
    n, g, nodes = n_elems * 4, 2, 2
    for *_, traffic in results:
        intra = (g - 1) * n // g + (g - 1) * (n // g)  # reduce-scatter + all-gather
        inter = 2 * (nodes - 1) * (n // g) // nodes  # all-reduce of the 1/G chunk
        assert traffic["by_link"]["intra"]["wire_bytes"] == intra
        assert traffic["by_link"]["inter"]["wire_bytes"] == inter
        assert traffic["by_tag"]["h.rs"]["calls"] == traffic["by_tag"]["h.ag"]["calls"] == 1
        assert traffic["by_tag"]["h.ar"]["calls"] == 1
        # the flat ring's inter share is 1/G of 2(P-1)/P n: 1.5x the hierarchical one on 2 x 2
        assert inter * 1.5 == 2 * 3 * n // 4 // g


def test_pipelined_pieces_sum_the_same_and_send_the_same_bytes() -> None:
    # 1000 float32 elements in pieces of ~256 bytes: 16 pieces (the cap), each a multiple of G,
    # one inter-node all-reduce in flight while the next piece is reduce-scattered
    n_elems, piece = 1000, 256
    results = run_distributed(_sum_both_ways, 4, n_elems, torch.float32, piece)
    tol = tolerance(torch.float32, ops=4)
    n, g, nodes = n_elems * 4, 2, 2
    for hier_err, _, traffic in results:
        assert hier_err <= tol
        assert traffic["by_tag"]["h.rs"]["calls"] == traffic["by_tag"]["h.ar"]["calls"] == 16
        assert traffic["by_tag"]["h.ag"]["calls"] == 16
        assert traffic["by_link"]["intra"]["wire_bytes"] == 2 * (g - 1) * (n // g)
        assert traffic["by_link"]["inter"]["wire_bytes"] == 2 * (nodes - 1) * (n // g) // nodes


def test_pieces_are_multiples_of_the_node_size_and_cover_the_buffer() -> None:
    from lowcomm.comm.hierarchical import MAX_PIECES, pieces_of

    for numel, g, piece in ((1000, 2, 256), (1002, 3, 64), (8, 4, 1 << 20), (4 << 20, 4, 4 << 20)):
        lengths = pieces_of(numel, 4, g, piece)
        assert sum(lengths) == numel and all(n % g == 0 and n > 0 for n in lengths)
        assert len(lengths) <= MAX_PIECES


def _one_node() -> dict[str, Any]:
    topo = Topology.from_env()  # LOCAL_WORLD_SIZE = world: one node
    accounting.set_topology(None)
    t = torch.full((10,), float(dist.get_rank() + 1))
    accounting.ledger().reset()
    hierarchical_all_reduce(t, topo, tag="h")
    return {"sum": t.tolist(), "traffic": accounting.ledger().as_dict()}


@distributed(world_size=2)
def test_one_node_falls_back_to_one_flat_all_reduce() -> None:
    out = _one_node()
    assert out["sum"] == [3.0] * 10
    assert list(out["traffic"]["by_tag"]) == ["h"]
    assert out["traffic"]["by_link"]["inter"]["wire_bytes"] == 0


# --- the hybrid rule ---------------------------------------------------------------------------
COSTS = LinkCosts(intra=AlphaBeta(1e-4, 1e-10), inter=AlphaBeta(5e-4, 8e-9))  # loopback vs 1 Gbit/s


def test_hybrid_picks_flat_for_tiny_buffers_and_hier_for_large() -> None:
    topo = Topology(8, 4, 0)
    assert choose(64, topo, COSTS, "hybrid") == "flat"  # two more start-ups than it saves
    assert choose(64 << 20, topo, COSTS, "hybrid") == "hier"
    assert hier_time(64 << 20, topo, COSTS) < flat_time(64 << 20, topo, COSTS)
    assert choose(64, topo, COSTS, "hier") == "hier" and choose(64 << 20, topo, COSTS, "flat") == "flat"
    assert choose(64 << 20, Topology(4, 4, 0), COSTS, "hybrid") == "flat"  # one node: nothing to gain


def test_hybrid_large_buffer_gain_is_the_byte_ratio() -> None:
    # only bandwidth on the inter link: flat / hier -> 2(P-1)/P / (2(N-1)/N) = 1.5 (2x2), 1.75 (2x4)
    costs = LinkCosts(intra=AlphaBeta(0.0, 0.0), inter=AlphaBeta(0.0, 1e-9))
    for world, g, ratio in ((4, 2, 1.5), (8, 4, 1.75)):
        topo = Topology(world, g, 0)
        assert flat_time(1e8, topo, costs) / hier_time(1e8, topo, costs) == pytest.approx(ratio)


def test_bad_modes_and_partial_costs_are_refused() -> None:
    with pytest.raises(UsageError, match="valid: hier, hybrid, flat"):
        methods.create("hier:mode=ring")
    with pytest.raises(UsageError, match="give all of alpha_intra"):
        methods.create("hier:alpha_intra=0.001")
    with pytest.raises(UsageError, match="hitopk"):
        methods.create("hier:compress=topk")


# --- the schedule and the hooks ----------------------------------------------------------------
def _compare(spec: str, steps: int) -> dict[str, Any]:
    _two_nodes()
    return compare_with_ddp(spec, "sgd", steps, False, None)


@pytest.mark.parametrize("spec", [
    "hier:threshold_mb=0",  # one group per layer: several buffers on the communication thread
    # pinned costs whose crossover (~1 KB) lies between the tiny model's small groups and its 2 KB one
    "hier:mode=hybrid,threshold_mb=0,alpha_intra=1e-5,beta_intra=1e-10,alpha_inter=5e-4,beta_inter=8e-8",
    "hier:mode=hybrid,threshold_mb=0",  # probed costs: averaged over all ranks, so every rank chooses alike
])
def test_hier_schedule_trains_like_ddp(spec: str) -> None:
    steps = 4
    results = run_distributed(_compare, 4, spec, steps)
    check(results, steps)
    d = results[0]["describe"]
    assert d["hierarchical"] is True and d["nodes"] == 2 and d["gpus_per_node"] == 2
    if "alpha_intra" in spec:
        assert d["hierarchical_buffers"] >= 1 and d["flat_buffers"] >= 1
    elif "hybrid" in spec:
        assert all(r["describe"]["link_costs"] == d["link_costs"] for r in results)
        assert all(v >= 0 for v in d["link_costs"].values())
    else:
        assert d["flat_buffers"] == 0


def _powersgd_ranks_agree(spec: str) -> list[float]:
    _two_nodes()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=dist.get_world_size()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    led = accounting.ledger()
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        led.reset()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
    inter = led.as_dict()["by_link"]["inter"]["wire_bytes"]
    return [float(inter), *torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()]


def test_hier_carries_a_multi_round_sum_codec_and_ranks_agree() -> None:
    spec = "hier:compress=powersgd,rank=2,start_iter=1,threshold_mb=0"
    results = run_distributed(_powersgd_ranks_agree, 4, spec)
    assert all(r[1:] == results[0][1:] for r in results)  # same parameters on every rank
    assert all(r[0] > 0 for r in results)  # the compressed messages crossed nodes hierarchically


def _hooked(hierarchical: bool | str) -> list[torch.Tensor]:
    topo = _two_nodes()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.001)
    hooks.register(ddp, "ssgd", hierarchical=hierarchical, gpus_per_node=topo.local_size)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    accounting.ledger().reset()
    F.cross_entropy(ddp(x), y).backward()
    grads = [p.grad.detach().clone() for p in ddp.parameters()]  # type: ignore[union-attr]
    grads.append(torch.tensor([float(accounting.ledger().as_dict()["by_link"]["inter"]["wire_bytes"])]))
    return grads


def test_hooks_route_the_mean_all_reduce_hierarchically() -> None:
    plain = run_distributed(_hooked, 4, False)
    hier = run_distributed(_hooked, 4, True)
    tol = tolerance(torch.float32, ops=4)
    for a, b in zip(hier, plain):
        assert max(rel_err(x, y) for x, y in zip(a[:-1], b[:-1])) <= tol
        assert 0 < float(a[-1]) < float(b[-1])  # fewer bytes cross the nodes


def test_hooks_refuse_gathered_codecs() -> None:
    results = run_distributed(_refused, 2)
    assert all("hitopk" in r for r in results)


def _refused() -> str:
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    try:
        hooks.register(ddp, "topk", density=0.5, hierarchical=True, gpus_per_node=1)
    except UsageError as e:
        return str(e)
    return "not refused"


# --- lowcomm train --gpus-per-node ---------------------------------------------------------------
def test_train_runs_hier_on_emulated_nodes_and_reports_inter_node_bytes(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["train", "--model", "mlp", "--nproc", "4", "--gpus-per-node", "2", "--method", "hier:threshold_mb=0",
            "--steps", "3", "--warmup-steps", "1", "--no-eval", "--batch-size", "16", "--threads", "1",
            "--quiet", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    s = json.loads(out.read_text())
    assert s["gpus_per_node"] == 2 and s["method_info"]["hierarchical"] is True
    grad = 4 * s["params"]
    # per step: intra RS + AG of every group (n each way, halves of a 2-worker node), inter 2(N-1)/N n/G
    # (= n/2), plus the engine's small broadcasts and flags; the flat ring would send 3/4 n inter
    assert grad / 2 <= s["inter_node_bytes_per_worker_per_iter"] < 3 * grad / 4


def test_train_refuses_gpus_per_node_that_does_not_divide_nproc(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--nproc", "4", "--gpus-per-node", "3", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lowcomm: error: --gpus-per-node 3 does not divide --nproc 4; valid: 1, 2, 4"]


def _resumed_costs() -> dict[str, Any]:
    _two_nodes()
    saved = {"alpha_intra": 1e-5, "beta_intra": 1e-10, "alpha_inter": 5e-4, "beta_inter": 8e-8}
    method = methods.create("hier:mode=hybrid")
    method.load_state_dict({"link_costs": saved})  # a checkpoint's state, before wrap (as the trainer does)
    accounting.ledger().reset()
    method.wrap(nn.Linear(4, 2), MethodContext(rank=dist.get_rank(), world_size=dist.get_world_size()))
    return {"costs": method.describe()["link_costs"], "saved": saved, "state": method.state_dict()["link_costs"],
            "tags": list(accounting.ledger().as_dict()["by_tag"])}


def test_a_resumed_hybrid_run_keeps_its_link_costs_without_probing() -> None:
    for r in run_distributed(_resumed_costs, 4):
        assert r["costs"] == r["saved"] == r["state"]
        assert not any(t.endswith(".probe") for t in r["tags"])

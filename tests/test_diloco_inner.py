"""``inner=SPEC`` of ``localsgd`` / ``diloco`` / ``streaming_diloco``: replicas of several GPUs.

4 gloo ranks as 2 nodes x 2 (the topology set as ``--gpus-per-node 2`` sets it). Each node
runs the inner steps synchronously (``SPEC`` on its intra group), and only the nodes' leaders
sync across nodes. The reference is tests/test_localsgd.py's algorithm in one process with
one replica per *node*, whose inner step uses the mean gradient of the node's two ranks'
batches. Tolerance (tests/tolerance.py): float32, the two sides differ in the order of
additions of the averages (DDP's all-reduce, the leaders' all-reduce), 8 rounding steps per
step as in tests/test_localsgd.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from diloco_testlib import resume_matches
from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.comm.topology import Topology
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.methods.outer_sync import split_fragments
from lowcomm.testing import distributed, run_distributed
from test_localsgd import batch, make_model, make_optimizer
from tolerance import assert_close_eps

methods.names()  # load the method modules before forking
WORLD, G = 4, 2  # 2 nodes of 2
NODES = WORLD // G


def rank_run(spec: str, steps: int, inner: str = "sgd", device: str = "cpu") -> dict[str, Any]:
    """One rank on the 2 x 2 topology: ``steps`` steps of ``spec`` on ``device`` (``cuda``: this
    rank's GPU); its weights (on the CPU) and its bytes per tag and per link after the wrap
    (the initial broadcast left out)."""
    accounting.set_topology(Topology.from_env(gpus_per_node=G))
    rank = dist.get_rank()
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    model = make_model().to(where or "cpu")
    method = methods.create(spec)
    ctx = MethodContext(
        rank=rank, world_size=WORLD, total_steps=steps, device=where or torch.device("cpu")
    )
    wrapped = method.wrap(model, ctx)
    accounting.ledger().reset()
    opt = make_optimizer(model, inner)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = (t.to(where or "cpu") for t in batch(step, rank))
        nn.functional.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
    method.flush()
    led = accounting.ledger().as_dict()
    return {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "by_tag": {k: v["wire_bytes"] for k, v in led["by_tag"].items()},
        "inter": led["by_link"].get("inter", {}).get("wire_bytes", 0),
        "wire": led["wire_bytes"],
        "describe": method.describe(),
    }


def reference(
    steps: int,
    *,
    h: int,
    mode: str,
    inner: str = "sgd",
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
) -> list[dict[str, torch.Tensor]]:
    """DiLoCo / Local SGD / Streaming DiLoCo with one replica per node, each inner step on the
    mean gradient of the node's ranks' batches (outer Nesterov, lr 0.7, momentum 0.9: the
    defaults), as tests/test_localsgd.py's reference writes the algorithm."""
    base = make_model()
    reps = [copy.deepcopy(base) for _ in range(NODES)]
    opts = [make_optimizer(m, inner) for m in reps]
    frags = split_fragments(base, fragments)
    offsets = [f * h // fragments for f in range(fragments)]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    mom = {n: torch.zeros_like(p) for n, p in glob.items()}
    pending: list[tuple[int, int, dict[str, torch.Tensor]]] = []

    def merge(f: int, avg: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n in frags[f]:
                if mode != "average":
                    mom[n] = 0.9 * mom[n] + avg[n]
                    glob[n] = glob[n] - 0.7 * (avg[n] + 0.9 * mom[n])
                for m in reps:
                    p = dict(m.named_parameters())[n]
                    p.copy_(avg[n] if mode == "average" else alpha * p + (1 - alpha) * glob[n])

    for t in range(1, steps + 1):
        for node, (m, opt) in enumerate(zip(reps, opts)):
            opt.zero_grad(set_to_none=True)
            for r in range(node * G, (node + 1) * G):
                x, y = batch(t - 1, r)
                (nn.functional.cross_entropy(m(x), y) / G).backward()
            opt.step()
        for item in [i for i in pending if i[0] <= t]:
            pending.remove(item)
            merge(item[1], item[2])
        for f in range(fragments):
            if t % h != offsets[f]:
                continue
            with torch.no_grad():
                avg = {}
                for n in frags[f]:
                    ps: list[torch.Tensor] = [dict(m.named_parameters())[n] for m in reps]
                    sent = ps if mode == "average" else [glob[n] - p for p in ps]
                    avg[n] = torch.stack(sent).sum(0) / NODES
            if delay == 0:
                merge(f, avg)
            else:
                pending.append((t + delay, f, avg))
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in reps]


def assert_nodes_match(
    runs: list[dict[str, Any]], expected: list[dict[str, torch.Tensor]], steps: int
) -> None:
    for rank, run in enumerate(runs):
        ref = expected[rank // G]
        for k, v in ref.items():
            assert_close_eps(
                run["state"][k], v, torch.float32, ops=8 * steps, msg=f"rank {rank} {k}"
            )


@pytest.mark.parametrize(
    "spec, mode",
    [("diloco:sync_every=3,inner=ssgd", "outer"), ("localsgd:sync_every=3,inner=ssgd", "average")],
)
def test_inner_ssgd_equals_one_replica_per_node_on_the_mean_node_gradient(
    spec: str, mode: str
) -> None:
    steps = 7  # syncs after steps 3 and 6 (momentum carried), the last step is local
    runs = run_distributed(rank_run, WORLD, spec, steps, "sgd_momentum")
    assert_nodes_match(runs, reference(steps, h=3, mode=mode, inner="sgd_momentum"), steps)
    # the ranks of a node hold the same weights, the two nodes differ mid-period
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in runs[0]["state"])
    assert not torch.equal(runs[0]["state"]["fc1.weight"], runs[2]["state"]["fc1.weight"])
    d = runs[0]["describe"]
    assert d["nodes"] == NODES and d["gpus_per_node"] == G and d["inner"]["method"] == "ssgd"
    # bytes: the leaders' all-reduce over 2 nodes of the whole model, per sync, on the inter
    # link only; the other ranks send nothing across nodes (their node's leader broadcasts)
    size = 4 * sum(v.numel() for v in runs[0]["state"].values())
    for rank, run in enumerate(runs):
        leader = rank % G == 0
        outer = run["by_tag"].get(spec.split(":")[0], 0)
        assert outer == (2 * (NODES - 1) / NODES * size * 2 if leader else 0), rank
        assert run["inter"] == outer, rank


def test_streaming_with_one_fragment_and_no_delay_is_diloco_inside_nodes() -> None:
    steps = 6
    a = run_distributed(rank_run, WORLD, "diloco:sync_every=2,inner=ssgd", steps)
    b = run_distributed(
        rank_run,
        WORLD,
        "streaming_diloco:sync_every=2,inner=ssgd,fragments=1,delay=0,alpha=0",
        steps,
    )
    for ra, rb in zip(a, b):
        for k, v in ra["state"].items():
            assert torch.equal(v, rb["state"][k]), k


def test_streaming_fragments_with_delay_inside_nodes_equal_the_reference() -> None:
    steps, spec = 9, "streaming_diloco:sync_every=4,inner=ssgd,fragments=2,delay=1,alpha=0.5"
    runs = run_distributed(rank_run, WORLD, spec, steps)
    expected = reference(steps, h=4, mode="outer", fragments=2, delay=1, alpha=0.5)
    assert_nodes_match(runs, expected, steps)
    for a, b in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert all(torch.equal(v, b["state"][k]) for k, v in a["state"].items())
    assert runs[1]["inter"] == 0 and runs[0]["inter"] > 0


@pytest.mark.parametrize("inner", ["wfbp", "dear"])
def test_an_engine_schedule_inside_nodes_trains_like_ssgd(inner: str) -> None:
    steps = 5
    a = run_distributed(rank_run, WORLD, "diloco:sync_every=2,inner=ssgd", steps)
    b = run_distributed(rank_run, WORLD, f"diloco:sync_every=2,inner={inner}", steps)
    for ra, rb in zip(a, b):
        for k, v in ra["state"].items():
            assert_close_eps(rb["state"][k], v, torch.float32, ops=8 * steps, msg=k)


def test_compressed_pseudo_gradients_cross_nodes_once_per_node() -> None:
    spec = "diloco:sync_every=2,inner=ssgd,compress=(topk:density=0.25)"
    runs = run_distributed(rank_run, WORLD, spec, 4)
    for k, v in runs[0]["state"].items():
        assert all(torch.equal(v, r["state"][k]) for r in runs[1:]), k  # synced at step 4
    assert runs[0]["inter"] > 0 and runs[1]["inter"] == 0


def test_inner_refusals_are_one_line_with_the_fix() -> None:
    for spec, words in [
        ("diloco:inner=localsgd", "semi-synchronous"),
        ("localsgd:inner=(streaming_diloco:fragments=1)", "semi-synchronous"),
        ("diloco:inner=pufferfish", "model axis"),
        ("streaming_diloco:inner=nosuch", "synchronous method"),
    ]:
        with pytest.raises(UsageError, match=words) as e:
            methods.create(spec)
        assert "\n" not in str(e.value)


def _one_node() -> str:
    accounting.set_topology(Topology.from_env(gpus_per_node=2))
    method = methods.create("diloco:inner=ssgd")
    try:
        method.wrap(make_model(), MethodContext(rank=dist.get_rank(), world_size=2))
    except UsageError as e:
        return str(e)
    return ""


def test_inner_on_one_node_is_refused_with_the_fix() -> None:
    for msg in run_distributed(_one_node, 2):
        assert "needs >= 2 nodes" in msg and "--gpus-per-node" in msg and "LOCAL_WORLD_SIZE" in msg


@distributed(world_size=WORLD, timeout=240)
def test_resume_mid_period_matches_the_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    # H = 4, checkpoint at step 6: mid-period, after one outer step (momentum is state)
    resume_matches(tmp_path, "diloco:sync_every=4,inner=ssgd", 6, nproc=WORLD, gpus_per_node=G)


@distributed(world_size=WORLD, timeout=240)
def test_resume_with_a_compressed_fragment_in_flight_matches_bit_for_bit(tmp_path: Path) -> None:
    # fragments at offsets 0 and 2, delay 1: at step 10 fragment 1's sync (started at step 10)
    # is in flight; the leaders' top-k error feedback is state too
    method = (
        "streaming_diloco:sync_every=4,fragments=2,delay=1,inner=ssgd,compress=(topk:density=0.2)"
    )
    mid = resume_matches(tmp_path, method, 10, nproc=WORLD, gpus_per_node=G)
    assert mid["sync"]["pending"][1]  # the in-flight fragment was saved (its node's mean)
    leader = dist.get_rank() % G == 0
    assert bool(mid["sync"]["codecs"][0]) == leader  # only the leaders run the codec


def test_the_simulator_prices_the_bytes_the_trainer_counts() -> None:
    from lowcomm.sim.network import Link, NetworkModel
    from lowcomm.sim.predict import predict_iteration_time
    from test_localsgd_sim import profile_of_test_model

    steps, spec = 8, "diloco:sync_every=4,inner=ssgd"
    runs = run_distributed(rank_run, WORLD, spec, steps)
    net = NetworkModel.two_level(Link(1e-4, 1e-9), Link(1e-6, 1e-10), gpus_per_node=G)
    pred = predict_iteration_time(profile_of_test_model(), spec, workers=WORLD, network=net)
    for key, predicted in (
        ("inter", pred.inter_node_bytes_per_worker),
        ("wire", pred.wire_bytes_per_worker),
    ):
        measured = sum(r[key] for r in runs) / WORLD / steps  # the node's mean, per step
        assert predicted == pytest.approx(measured, rel=1e-9), key
    with pytest.raises(UsageError, match="--nodes N and --gpus-per-node"):
        predict_iteration_time(
            profile_of_test_model(), spec, workers=WORLD, network=NetworkModel(Link(1e-4, 1e-9))
        )


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; `make test-gpu` on a GPU machine")
@pytest.mark.parametrize(
    "spec",
    [
        "diloco:sync_every=2,inner=ssgd,global_on=cpu",
        "streaming_diloco:sync_every=4,fragments=2,delay=1,inner=ssgd,compress=(topk:density=0.5)",
    ],
)
def test_on_cuda_the_nodes_ranks_agree_and_only_leaders_cross_nodes(spec: str) -> None:
    # four ranks on fewer GPUs share them over gloo (NCCL refuses that); with four, NCCL alone:
    # a CPU tensor handed to a collective would fail there
    backend = "gloo" if GPUS < WORLD else "nccl"
    runs = run_distributed(rank_run, WORLD, spec, 8, "sgd", "cuda", device="cuda", backend=backend)
    for a, b in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert all(torch.equal(v, b["state"][k]) for k, v in a["state"].items())
    assert runs[0]["inter"] > 0 and runs[1]["inter"] == 0

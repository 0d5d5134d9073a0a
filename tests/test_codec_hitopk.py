"""hitopk's own tests and its central reference (the registry-driven suites pick both up).

``Reference`` is HiTopKComm (Shi et al., MLSys'21) written with plain dense ops: per node the
sum of its workers' gradients plus the node's residual, top-k of every chunk ``l`` of every
tensor (``c = ceil(n / G)`` elements, ``k = max(1, ceil(density * c))``), the mean over all
workers of what every node sent; the residual is what the node did not send. It shares
nothing with the codec but the documented chunking rule.

The single-process tests run ``P`` codecs through a fake exchange that implements the
message contract (reduce-scatter / all-gather on the intra or inter group of a 2 x 2
topology); the distributed ones run 4 gloo ranks as 2 nodes x 2 through the real transport.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import compress_testlib
from compress_testlib import HOOK_CASES, has_reference
from lowcomm.comm import accounting, transport
from lowcomm.comm.topology import Topology
from lowcomm.compress.codec import CODECS, Aggregation, Layout, Message
from lowcomm.compress.hitopk import HiTopKCodec, HiTopKOptions, chunk_sizes, from_shards, to_shards
from lowcomm.compress.topk import TopKCodec, TopKOptions
from lowcomm.errors import UsageError
from lowcomm.testing import distributed
from tolerance import assert_close_eps

#: start compressing at step 1 with a visible density (the registry-driven suites use these)
OPTIONS: dict[str, Any] = {"density": 0.1}


def _keep_topk_rows(rows: torch.Tensor, density: float) -> torch.Tensor:
    """Each row with only its ``max(1, ceil(density * len))`` largest |entries| kept."""
    k = max(1, math.ceil(density * rows.shape[1]))
    keep = torch.zeros_like(rows)
    idx = rows.abs().argsort(dim=1, descending=True)[:, :k]
    return keep.scatter_(1, idx, rows.gather(1, idx))


class Reference(compress_testlib.Reference):
    """Dense HiTopKComm; ``local_size`` workers per node (default, and for one node: 1, i.e.
    topk, as the codec documents)."""

    def __init__(self, *a: Any, options: Any, local_size: int | None = None, **k: Any) -> None:
        super().__init__(*a, **k)
        self.o = options
        self.local = local_size if local_size is not None and local_size < self.world else 1

    def ops(self, names: list[str]) -> float:
        """A node's sum of its workers' terms and residual, then a sum over nodes and a division."""
        return float(self.world + self.world // self.local + 1)

    def sent(self, c: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The entries one node sends of its corrected sum ``c`` (per tensor, per chunk)."""
        out, off = [], 0
        for n in sizes:
            chunk = -(-n // self.local)
            t = torch.nn.functional.pad(c[off : off + n], (0, self.local * chunk - n)).view(self.local, chunk)
            out.append(_keep_topk_rows(t, self.o.density).reshape(-1)[:n])
            off += n
        return torch.cat(out)

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        sizes = self.sizes(names)
        total = torch.zeros_like(xs[0])
        scale = torch.stack([x.abs() for x in xs]).sum(0)
        for node in range(self.world // self.local):
            ranks = range(node * self.local, (node + 1) * self.local)
            residual = self.get(node, names) if self.o.error_feedback else torch.zeros_like(xs[0])
            scale += residual.abs()
            c = torch.stack([xs[r] for r in ranks]).sum(0) + residual
            s = self.sent(c, sizes)
            self.put(node, names, c - s)
            total += s
        self.scale = scale / self.world
        return total / self.world


# --- a fake transport: the message contract on a (world, local_size) topology ---------------
def _group(rank: int, scope: str, world: int, local: int) -> list[int]:
    if not 1 < local < world:  # not hierarchical: the transport's flat fallback
        return list(range(world))
    if scope == "intra":
        node = rank // local
        return list(range(node * local, (node + 1) * local))
    if scope == "inter":
        return list(range(rank % local, world, local))
    return list(range(world))


def _exchange(msgs: list[Message], local: int) -> list[torch.Tensor]:
    """What each rank's message receives (every rank at the same stage)."""
    world = len(msgs)
    out = []
    for r, m in enumerate(msgs):
        if m.collective == "none":
            out.append(m.buf)
            continue
        group = _group(r, m.scope, world, local)
        if m.collective == "reduce_scatter":
            i = group.index(r)
            out.append(torch.stack([msgs[q].buf.view(len(group), -1)[i] for q in group]).sum(0))
        else:
            assert m.collective == "all_gather", m.collective
            out.append(torch.stack([msgs[q].buf for q in group]))
    return out


def fake_step(codecs: list[HiTopKCodec], xs: list[torch.Tensor], layout: Layout, local: int,
              finite: list[bool] | None = None) -> list[torch.Tensor]:
    """One step of every codec through the fake exchange; each rank's decoded mean."""
    flags = finite or [True] * len(codecs)
    msgs = [c.encode(x.clone(), layout, torch.tensor(f)) for c, x, f in zip(codecs, xs, flags)]
    while not msgs[0].final:
        got = _exchange(msgs, local)
        msgs = [c.advance(m, g) for c, m, g in zip(codecs, msgs, got)]
    got = _exchange(msgs, local)
    outs = []
    for c, m, g in zip(codecs, msgs, got):
        out = torch.empty_like(xs[0])
        c.decode(m, g, out)
        c.end_step()
        outs.append(out)
    return outs


def make_codecs(world: int, local: int, **options: Any) -> list[HiTopKCodec]:
    opts = HiTopKOptions(**{"start_iter": 0, "sparsity_warmup": 0, **options})
    codecs = []
    for r in range(world):
        c = HiTopKCodec(opts, world=world, rank=r)
        c.set_topology(Topology(world, local, r))
        c.set_run(steps_per_epoch=10, total_steps=100)
        codecs.append(c)
    return codecs


SHAPES = [(7, 5), (5,), (12, 3), (1,)]
NAMES = ["a.weight", "a.bias", "b.weight", "b.bias"]


def layout_of(names: list[str] = NAMES, shapes: list[tuple[int, ...]] = SHAPES) -> Layout:
    return Layout.of(names, shapes, {n: i for i, n in enumerate(NAMES)})


def grads(world: int, step: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * step + 1)
    return [torch.randn(numel, generator=gen) for _ in range(world)]


def memories(codecs: list[HiTopKCodec], layout: Layout) -> list[torch.Tensor]:
    return [torch.cat([c.memory.state_dict().get(n, torch.zeros(s)) for n, s in zip(layout.names, layout.sizes)])
            for c in codecs]


# --- shards -----------------------------------------------------------------------------
def test_shards_cut_each_tensor_into_chunks_and_invert_exactly() -> None:
    sizes = [7, 4, 1]
    flat = torch.arange(1.0, 13.0)
    rows = to_shards(flat, sizes, 2)
    assert chunk_sizes(sizes, 2) == [4, 2, 1]
    assert rows.tolist() == [[1, 2, 3, 4, 8, 9, 12], [5, 6, 7, 0, 10, 11, 0]]
    assert torch.equal(from_shards(rows, sizes, torch.empty(12)), flat)
    assert to_shards(flat, sizes, 1).data_ptr() != flat.data_ptr()  # always a new tensor


# --- math (single process, fake 2 x 2 exchange) ------------------------------------------
@pytest.mark.parametrize("world,local", [(4, 2), (4, 4), (4, 1), (6, 3)])
def test_every_rank_decodes_the_mean_of_each_nodes_per_chunk_topk_of_its_sum(world: int, local: int) -> None:
    layout = layout_of()
    codecs = make_codecs(world, local, density=0.2)
    ref = Reference(world, dict(zip(NAMES, map(torch.Size, SHAPES))), {}, options=codecs[0].options,
                    local_size=local)
    for step in range(4):
        xs = grads(world, step, layout.numel)
        outs = fake_step(codecs, xs, layout, local)
        expected = ref(xs, NAMES)
        for out in outs:
            assert torch.equal(out, outs[0])  # identical on every rank
        assert_close_eps(outs[0], expected, torch.float32, ops=ref.ops(NAMES), msg=f"step {step}")


def test_error_feedback_keeps_exactly_what_was_not_sent_on_the_owners_shard() -> None:
    world, local = 4, 2
    layout = layout_of()
    codecs = make_codecs(world, local, density=0.1)
    kept = torch.zeros(layout.numel, dtype=torch.float64)
    for step in range(5):
        xs = grads(world, step, layout.numel)
        outs = fake_step(codecs, xs, layout, local)
        kept += torch.stack(xs).double().sum(0) - world * outs[0].double()
        mems = memories(codecs, layout)
        # the residuals of all workers add up to everything not delivered so far
        assert torch.allclose(torch.stack(mems).double().sum(0), kept, atol=1e-5)
        for r, mem in enumerate(mems):  # and each lives on the chunks its owner selects from
            rows = to_shards(mem, layout.sizes, local)
            assert not rows[[g for g in range(local) if g != r % local]].any()
        assert (torch.stack(mems).abs().sum(0) > 0).sum() > layout.numel // 2  # most entries wait


@pytest.mark.parametrize("local", [1, 3])
def test_one_worker_per_node_and_one_node_are_exactly_topk(local: int) -> None:
    world = 3
    layout = layout_of()
    hi = make_codecs(world, local, density=0.15)
    top = [TopKCodec(TopKOptions(density=0.15, start_iter=0, sparsity_warmup=0), world=world, rank=r)
           for r in range(world)]
    for c in top:
        c.set_run(steps_per_epoch=10, total_steps=100)
    for step in range(4):
        xs = grads(world, step, layout.numel)
        got = fake_step(hi, xs, layout, local)
        msgs = [c.encode(x.clone(), layout, torch.tensor(True)) for c, x in zip(top, xs)]
        rows = torch.stack([m.buf for m in msgs])
        for c, m, out in zip(top, msgs, got):
            want = torch.empty_like(out)
            c.decode(m, rows, want)
            c.end_step()
            assert torch.equal(out, want)


def test_the_selection_does_not_depend_on_how_tensors_are_fused() -> None:
    world, local = 4, 2
    fused = make_codecs(world, local, density=0.2)
    apart = make_codecs(world, local, density=0.2)
    whole = layout_of()
    parts = [layout_of([n], [s]) for n, s in zip(NAMES, SHAPES)]
    for step in range(3):
        xs = grads(world, step, whole.numel)
        a = fake_step(fused, xs, whole, local)[0]
        pieces, off = [], 0
        for lay in parts:
            pieces.append(fake_step(apart, [x[off : off + lay.numel] for x in xs], lay, local)[0])
            off += lay.numel
        assert torch.equal(a, torch.cat(pieces))


def test_fast_threshold_selection_selects_exactly_what_the_exact_one_does() -> None:
    world, local = 4, 2
    layout = Layout.of(["big.weight", "big.bias"], [(600, 500), (500,)], {"big.weight": 0, "big.bias": 1})
    fast = make_codecs(world, local, density=0.01, fast_select=True)
    exact = make_codecs(world, local, density=0.01)
    for step in range(2):  # chunks of 150,000 elements: above the sampled path's threshold
        xs = grads(world, step, layout.numel)
        assert torch.equal(fake_step(fast, xs, layout, local)[0], fake_step(exact, xs, layout, local)[0])


def test_resume_from_state_dict_continues_exactly_even_with_another_layout() -> None:
    world, local = 4, 2
    layout = layout_of()
    straight = make_codecs(world, local, density=0.1)
    first = make_codecs(world, local, density=0.1)
    for step in range(3):
        xs = grads(world, step, layout.numel)
        fake_step(straight, xs, layout, local)
        fake_step(first, xs, layout, local)
    resumed = make_codecs(world, local, density=0.1)
    for c, old in zip(resumed, first):
        c.load_state_dict(old.state_dict())
    split = [layout_of(NAMES[:2], SHAPES[:2]), layout_of(NAMES[2:], SHAPES[2:])]
    for step in range(3, 6):
        xs = grads(world, step, layout.numel)
        want = fake_step(straight, xs, layout, local)[0]
        n0 = split[0].numel
        got0 = fake_step(resumed, [x[:n0] for x in xs], split[0], local)[0]
        got1 = fake_step(resumed, [x[n0:] for x in xs], split[1], local)[0]
        assert torch.equal(torch.cat([got0, got1]), want)


def test_momentum_masking_zeroes_the_velocity_where_the_node_sent_on_every_worker_of_it() -> None:
    world, local = 4, 2
    layout = layout_of()
    codecs = make_codecs(world, local, density=0.1, momentum_masking=True)
    for c in codecs:
        c.set_momentum(0.9)
    for step in range(3):
        xs = grads(world, step, layout.numel)
        for c, x in zip(codecs, xs):
            c.accumulate(x, layout, torch.tensor(True))
        before = [c.velocity.find(layout.names).clone() for c in codecs]  # type: ignore[union-attr]
        msgs_bytes = fake_step(codecs, xs, layout, local)
        assert msgs_bytes
        for node in range(world // local):
            ranks = range(node * local, (node + 1) * local)
            vel = [codecs[r].velocity.find(layout.names) for r in ranks]
            zeroed = [(b != 0) & (v == 0) for b, v in zip((before[r] for r in ranks), vel)]  # type: ignore[operator]
            assert all(torch.equal(z, zeroed[0]) for z in zeroed)  # the same positions on the node
            count = zeroed[0].sum()
            ks = sum(codecs[0].shard_ks(SHAPES, local, density=0.1))
            assert 0 < count <= local * ks


def test_nonfinite_input_decodes_nan_on_every_rank_and_leaves_the_state_unchanged() -> None:
    world, local = 4, 2
    layout = layout_of()
    codecs = make_codecs(world, local, density=0.1)
    fake_step(codecs, grads(world, 0, layout.numel), layout, local)
    before = memories(codecs, layout)
    xs = grads(world, 1, layout.numel)
    outs = fake_step(codecs, xs, layout, local, finite=[True, True, False, True])
    for out in outs:
        assert not torch.isfinite(out).all()
    for b, a in zip(before, memories(codecs, layout)):
        assert torch.equal(a, b)


# --- bytes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world,local", [(4, 2), (8, 2), (8, 4), (4, 4), (4, 1)])
@pytest.mark.parametrize("masking", [False, True])
def test_messages_have_exactly_the_bytes_cost_declares(world: int, local: int, masking: bool) -> None:
    layout = layout_of()
    codecs = make_codecs(world, local, density=0.1, momentum_masking=masking)
    for c in codecs:
        c.set_momentum(0.9)
    xs = grads(world, 0, layout.numel)
    msgs = [c.encode(x.clone(), layout, torch.tensor(True)) for c, x in zip(codecs, xs)]
    sent = []
    while True:
        if msgs[0].collective != "none":
            sent.append((msgs[0].collective, msgs[0].scope, msgs[0].buf.numel() * msgs[0].buf.element_size()))
        if msgs[0].final:
            break
        got = _exchange(msgs, local)
        msgs = [c.advance(m, g) for c, m, g in zip(codecs, msgs, got)]
    cost = codecs[0].cost(SHAPES, world=world, dtype_bytes=4, step=0)
    assert [(r.collective, r.scope, r.nbytes) for r in cost.rounds] == sent
    nodes = world // local
    k = sum(max(1, math.ceil(0.1 * c)) for c in chunk_sizes([35, 5, 36, 1], local))
    if nodes > 1:  # the pairs' message: K (value, index) pairs among the same-local-rank workers
        assert ("all_gather", "inter" if 1 < local < world else "world", k * 8) in sent
    assert [r.blocking for r in cost.rounds] == [True] * (len(cost.rounds) - 1) + [False]


def test_inter_node_bytes_are_at_most_one_over_g_of_topks_at_equal_density() -> None:
    shapes = [(256, 128), (256,), (64, 256), (64,)]
    for world, local in [(4, 2), (8, 2), (8, 4), (16, 8)]:
        hi = HiTopKCodec(HiTopKOptions(density=0.01), world=world).cost(shapes, world=world, local_size=local)
        top = TopKCodec(TopKOptions(density=0.01), world=world).cost(shapes, world=world)
        nodes = world // local
        hi_inter = sum((nodes - 1) * r.nbytes for r in hi.rounds if r.scope == "inter")
        topk_inter = (world - 1) * top.nbytes // local  # the accounting layer's ring model
        assert hi_inter * local <= topk_inter, (world, local)


def test_one_node_and_one_worker_per_node_are_topk_with_topks_bytes() -> None:
    top = TopKCodec(TopKOptions(), world=4).cost(SHAPES, world=4)
    for local in (None, 1, 4):
        cost = HiTopKCodec(HiTopKOptions(), world=4).cost(SHAPES, world=4, local_size=local)
        assert [(r.collective, r.nbytes) for r in cost.rounds] == [(r.collective, r.nbytes) for r in top.rounds]
    codec = HiTopKCodec(HiTopKOptions(), world=4)
    codec.set_topology(Topology(4, 4, 0))
    assert codec.local_size is None and codec.levels() == (1, 4)


def test_a_node_size_that_does_not_divide_the_world_is_refused_with_the_valid_ones() -> None:
    codec = HiTopKCodec(HiTopKOptions(), world=6)
    with pytest.raises(UsageError, match="valid workers per node: 1, 2, 3, 6"):
        codec.cost(SHAPES, world=6, local_size=4)


def test_declarations_and_registry() -> None:
    assert "hitopk" in CODECS.names() and has_reference("hitopk")
    assert HiTopKCodec.aggregation is Aggregation.GATHER and HiTopKCodec.multi_round
    assert ("hitopk", {**OPTIONS, "start_iter": 1}) in list(HOOK_CASES)
    # topk's options, with gtopk's measured defaults (masking off, a 6-epoch sparsity warm-up,
    # topk's former warm-up) and local clipping off (its accuracy was not re-measured with it)
    assert dataclasses.asdict(HiTopKOptions()) == {**dataclasses.asdict(TopKOptions()), "momentum_masking": False,
                                                   "sparsity_warmup": "6ep", "clip": 0.0, "start_iter": "10%",
                                                   "warmup_density": 0.25}


# --- 4 gloo ranks as 2 nodes x 2, through the real transport -----------------------------
def _run_transport(codec: HiTopKCodec, flat: torch.Tensor, layout: Layout, topo: Topology | None) -> torch.Tensor:
    msg = codec.encode(flat.clone(), layout, torch.tensor(True))
    msg = transport.run_rounds(codec, msg, tag="hitopk", topology=topo)
    received = transport.start(msg, tag="hitopk", topology=topo).wait()
    out = torch.empty_like(flat)
    codec.decode(msg, received, out)
    codec.end_step()
    return out


def _ranks_2x2(steps: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_env(gpus_per_node=2)
    layout = layout_of([n for n in NAMES], [(64, 32), (32,), (16, 64), (16,)])
    hi = HiTopKCodec(HiTopKOptions(density=0.05, start_iter=0, sparsity_warmup=0), world=world, rank=rank)
    hi.set_topology(topo)
    top = TopKCodec(TopKOptions(density=0.05, start_iter=0, sparsity_warmup=0), world=world, rank=rank)
    accounting.set_topology(topo)
    outs, inter = [], {}
    for name, codec in (("hitopk", hi), ("topk", top)):
        accounting.ledger().reset()
        for step in range(steps):
            xs = grads(world, step, layout.numel)
            if name == "hitopk":
                outs.append(_run_transport(hi, xs[rank], layout, topo))
            else:
                _run_transport(codec, xs[rank], layout, topo)  # type: ignore[arg-type]
        inter[name] = accounting.ledger().by_link["inter"].wire_bytes
    accounting.set_topology(None)
    return {"outs": outs, "inter": inter, "state": hi.state_dict(),
            "cost": hi.cost(layout.shapes, world=world, step=0)}


def test_four_ranks_as_two_nodes_of_two_agree_match_the_reference_and_the_byte_formula() -> None:
    steps = 3
    results = compress_testlib.run_ranks(_ranks_2x2, 4, steps)
    layout = layout_of([n for n in NAMES], [(64, 32), (32,), (16, 64), (16,)])
    shapes = dict(zip(layout.names, map(torch.Size, layout.shapes)))
    ref = Reference(4, shapes, {}, options=HiTopKOptions(density=0.05), local_size=2)
    for step in range(steps):
        expected = ref(grads(4, step, layout.numel), list(layout.names))
        for res in results:
            assert torch.equal(res["outs"][step], results[0]["outs"][step])
        assert_close_eps(results[0]["outs"][step], expected, torch.float32, ops=ref.ops(list(layout.names)))
    cost = results[0]["cost"]
    formula = steps * sum((2 - 1) * r.nbytes for r in cost.rounds if r.scope == "inter")  # (N-1) * K pairs
    for res in results:
        assert res["inter"]["hitopk"] == formula
        assert res["inter"]["hitopk"] * 2 <= res["inter"]["topk"]


@distributed(world_size=4)
def test_a_transport_without_topology_fails_loudly_instead_of_mixing_nodes() -> None:
    rank = dist.get_rank()
    codec = HiTopKCodec(HiTopKOptions(start_iter=0), world=4, rank=rank)
    codec.set_topology(Topology(4, 2, rank))
    layout = layout_of()
    with pytest.raises(RuntimeError, match="topology disagrees"):
        _run_transport(codec, grads(4, 0, layout.numel)[rank], layout, None)


# --- the DDP comm hook on 2 nodes x 2 (LOCAL_WORLD_SIZE=2, as the launcher sets it) --------
def _hook_run_2x2(steps: int) -> dict[str, Any]:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    accounting.set_topology(None)  # the ledger reads the environment again
    try:
        return compress_testlib.recorded_run("hitopk", {"density": 0.1, "start_iter": 1}, steps=steps)
    finally:
        accounting.set_topology(None)


def test_the_ddp_hook_on_two_nodes_of_two_matches_the_reference_on_every_rank() -> None:
    steps = 4
    results = compress_testlib.run_ranks(_hook_run_2x2, 4, steps)
    o = HiTopKOptions(density=0.1, start_iter=1)
    ref = compress_testlib.reference_for("hitopk", {"density": 0.1, "start_iter": 1}, 4)
    hier = Reference(4, ref.shapes, ref.index, options=o, local_size=2)
    warm = compress_testlib.Mean(4, ref.shapes, ref.index)
    compared = 0
    for s in range(steps):
        buckets = [res["log"][s]["buckets"] for res in results]
        for b, (names, _) in enumerate(buckets[0]):
            current = warm if s < 1 else hier
            expected = current([bk[b][1] for bk in buckets], names)
            for n, piece in zip(names, expected.split(hier.sizes(names))):
                got = [res["log"][s]["out"][n] for res in results]
                assert all(torch.equal(g, got[0]) for g in got)  # identical on every rank
                assert_close_eps(got[0], piece, torch.float32, ops=current.ops(names), msg=f"step {s} {n}")
                compared += 1
    assert compared > 8
    for res in results:  # compressed steps send pairs across nodes, the warm-up a ring all-reduce
        assert res["ledger"]["by_link"]["inter"]["wire_bytes"] > 0


# --- engine schedules on 2 nodes x 2 ------------------------------------------------------
ENGINE_SPECS = ("wfbp", "dear:threshold_mb=0", "lee18:threshold_mb=0,merge_below=0")


def _engine_runs_2x2() -> dict[str, Any]:
    import os

    from lowcomm import methods
    from lowcomm.methods.base import MethodContext
    from sgd_testlib import record_sgd_steps

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    accounting.set_topology(None)
    rank, out = dist.get_rank(), {}
    for spec in ENGINE_SPECS:
        schedule, _, extra = spec.partition(":")
        model, shadow = compress_testlib.make_model(), compress_testlib.make_model()
        method = methods.create(f"{schedule}:compress=hitopk,density=0.1,start_iter=1" + (f",{extra}" if extra else ""))
        wrapped = method.wrap(model, MethodContext(rank=rank, world_size=dist.get_world_size()))
        out[schedule] = record_sgd_steps(method, model, shadow, wrapped, steps=4, lr=0.05, rank=rank)
    return out


def test_engine_schedules_carry_hitopk_on_two_nodes_of_two_like_the_reference() -> None:
    from sgd_testlib import check_sgd_steps

    runs = compress_testlib.run_ranks(_engine_runs_2x2, 4, timeout=240)
    opts: dict[str, Any] = {"density": 0.1, "start_iter": 1}
    for spec in ENGINE_SPECS:
        schedule = spec.split(":")[0]
        recs = [r[schedule] for r in runs]
        base = compress_testlib.reference_for("hitopk", opts, 4)
        ref = Reference(4, base.shapes, base.index, options=HiTopKOptions(**opts), local_size=2)
        warm = compress_testlib.reference_for("ssgd", {}, 4)
        names = list(recs[0]["local"][0])
        assert check_sgd_steps(recs, names, ref, warm, 1, steps=4, lr=0.05, label=schedule) >= 1


@distributed(world_size=4)
def test_hooks_register_with_gpus_per_node_gives_the_codec_and_transport_the_node_layout() -> None:
    import lowcomm.hooks

    model = compress_testlib.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = lowcomm.hooks.register(ddp, "hitopk", gpus_per_node=2, density=0.1, start_iter=0)
    codec = state.codec
    assert isinstance(codec, HiTopKCodec) and codec.levels() == (2, 2)  # LOCAL_WORLD_SIZE says 4 here
    gen = torch.Generator().manual_seed(dist.get_rank())
    ddp(torch.randn(8, 8, generator=gen)).pow(2).mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
    everyone = [torch.empty_like(grads) for _ in range(4)]
    dist.all_gather(everyone, grads)
    assert all(torch.equal(g, grads) for g in everyone)

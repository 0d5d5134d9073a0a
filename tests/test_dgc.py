"""Deep Gradient Compression (Lin et al., ICLR 2018) in topk / gtopk: sparsity warm-up,
momentum factor masking, local gradient clipping (also on the low-rank codecs), and resumes
in the middle of the warm-up.

The ranks are simulated in one process: each rank has its own codec, and :func:`sync_step`
follows the transports' contract (``accumulate`` then ``encode``; an all-gather hands every
rank all the payloads, a ``p2p`` exchange hands each rank its peer's buffer; ``advance``
until the final message, ``decode``, ``end_step``). Deterministic, and no process group."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from lowcomm.compress.codec import Layout, Message, codec_class
from lowcomm.compress.dgc import clip_threshold, density_at, stage_densities
from lowcomm.compress.feedback import finite_flag
from lowcomm.errors import UsageError
from lowcomm.hooks import options_for
from lowcomm.testing.distributed import distributed

SHAPES = ((40, 50), (50,), (30, 40), (7,))
LAYOUT = Layout.of([f"p{i}" for i in range(len(SHAPES))], SHAPES, {f"p{i}": i for i in range(len(SHAPES))})
SPARSE = ["topk", "gtopk"]
EPS = torch.finfo(torch.float32).eps


def make(name: str, world: int, *, momentum: float = 0.0, steps_per_epoch: int | None = 4,
         **opts: Any) -> list[Any]:
    """One codec per rank, run information given, velocity on when ``momentum > 0``; local
    clipping off unless asked for (the tests below compare with unclipped references)."""
    opts.setdefault("clip", 0.0)
    if name in SPARSE:
        opts.setdefault("warmup_density", 0.25)  # DGC's first stage: three stages to 0.01
    codecs = [codec_class(name)(options_for(name, **opts), world=world, rank=r) for r in range(world)]
    for c in codecs:
        c.set_run(steps_per_epoch=steps_per_epoch, total_steps=None)
        c.set_momentum(momentum)
    return codecs


def grads(world: int, step: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Rank ``r``'s flat gradient of ``step`` (fixed seeds: the same on every call)."""
    n = LAYOUT.numel
    return [torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + r)) * scale for r in range(world)]


def _exchange(codecs: list[Any], msgs: list[Message]) -> list[torch.Tensor]:
    """What each rank's message receives (all ranks are at the same round)."""
    kind = msgs[0].collective
    if kind == "all_gather":
        rows = torch.stack([m.buf for m in msgs])
        return [rows for _ in msgs]
    if kind == "p2p":
        return [msgs[m.peer].buf.clone() if m.recv else torch.empty_like(m.buf) for m in msgs]
    return [m.buf for m in msgs]


def sync_step(codecs: list[Any], flats: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """One step on every rank: the decoded means and each rank's sent bytes (a dense
    ``start_iter`` step: the mean of the accumulated inputs, bytes not counted)."""
    flats = [f.clone() for f in flats]
    if not codecs[0].active:
        for c, f in zip(codecs, flats):
            c.accumulate(f, LAYOUT, finite_flag(f))
            c.end_step()
        return [torch.stack(flats).mean(0)] * len(codecs), [0] * len(codecs)
    msgs = []
    for c, f in zip(codecs, flats):
        finite = finite_flag(f)
        c.accumulate(f, LAYOUT, finite)
        msgs.append(c.encode(f, LAYOUT, finite))
    sent = [m.numel if m.send else 0 for m in msgs]
    while not all(m.final for m in msgs):
        received = _exchange(codecs, msgs)
        msgs = [c.advance(m, rcv) for c, m, rcv in zip(codecs, msgs, received)]
        sent = [s + (m.numel if m.send else 0) for s, m in zip(sent, msgs)]
    received = _exchange(codecs, msgs)
    outs = []
    for c, m, rcv in zip(codecs, msgs, received):
        out = torch.empty(LAYOUT.numel)
        c.decode(m, rcv, out)
        c.end_step()
        outs.append(out)
    return outs, sent


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as it is written to and read from disk."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return dict(torch.load(buf, weights_only=False))


def velocity(codec: Any) -> torch.Tensor:
    return torch.cat([codec.state_dict()["velocity"][n] for n in LAYOUT.names])


def memory(codec: Any) -> torch.Tensor:
    mem = codec.state_dict()["memory"]
    return torch.cat([mem.get(n, torch.zeros(s)) for n, s in zip(LAYOUT.names, LAYOUT.sizes)])


# --- the sparsity warm-up schedule ---------------------------------------------------------------
def test_warmup_density_falls_by_a_quarter_per_stage_and_ends_at_the_target() -> None:
    assert stage_densities(0.25, 0.01) == [0.25, 0.0625, 0.015625]
    assert stage_densities(0.01, 0.01) == [] and stage_densities(0.005, 0.01) == []
    # three stages over 9 steps after start_iter=2: three steps each, then the target
    got = [density_at(s, density=0.01, warmup_density=0.25, begin=2, length=9) for s in range(14)]
    assert got[2:11] == [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3
    assert got[11:] == [0.01] * 3
    # uneven split: stage lengths differ by at most one step, every stage is used
    got = [density_at(s, density=0.01, warmup_density=0.25, begin=0, length=7) for s in range(7)]
    counts = [got.count(d) for d in (0.25, 0.0625, 0.015625)]
    assert sum(counts) == 7 and max(counts) - min(counts) <= 1 and min(counts) >= 1
    assert density_at(5, density=0.01, warmup_density=0.25, begin=0, length=0) == 0.01


@pytest.mark.parametrize("name", SPARSE)
def test_codec_density_is_a_pure_function_of_the_step(name: str) -> None:
    """'3ep' at 4 steps per epoch after start_iter=2: steps 2..13 are the warm-up."""
    a = make(name, 1, start_iter=2, sparsity_warmup="3ep")[0]
    expected = {2: 0.25, 5: 0.25, 6: 0.0625, 9: 0.0625, 10: 0.015625, 13: 0.015625, 14: 0.01, 400: 0.01}
    for step in [400, 9, 2, 13, 6, 14, 10, 5]:  # any order: no hidden state
        assert a.density_at(step) == expected[step]
        b = make(name, 1, start_iter=2, sparsity_warmup="3ep")[0]
        b.step = step
        assert b.density == expected[step]
    assert a.density_at(None) == 0.01  # a cost query without a step: the target


@pytest.mark.parametrize("name", SPARSE)
def test_warmup_default_is_off_without_run_information_and_an_explicit_one_is_refused(name: str) -> None:
    c = codec_class(name)(options_for(name), world=2)
    c.set_run(steps_per_epoch=None, total_steps=None)
    assert [c.density_at(s) for s in (10, 11, 100)] == [0.01] * 3  # the default "Nep" falls back to 0
    explicit = codec_class(name)(options_for(name, sparsity_warmup="4ep"), world=2)
    with pytest.raises(UsageError, match="steps_per_epoch"):
        explicit.set_run(steps_per_epoch=None, total_steps=None)
    steps = codec_class(name)(options_for(name, sparsity_warmup=6, start_iter=0, warmup_density=0.25), world=2)
    steps.set_run(steps_per_epoch=None, total_steps=None)  # steps need no run information
    assert [steps.density_at(s) for s in range(7)] == [0.25] * 2 + [0.0625] * 2 + [0.015625] * 2 + [0.01]


@pytest.mark.parametrize("bad", [{"warmup_density": 0}, {"warmup_density": 1.5}, {"clip": -1.0},
                                 {"clip": float("nan")}, {"sparsity_warmup": "2 epochs"},
                                 {"sparsity_warmup": -1}])
def test_invalid_dgc_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match=next(iter(bad))):
        options_for("topk", **bad)


# --- bytes follow the schedule -----------------------------------------------------------------
@pytest.mark.parametrize("name, world", [("topk", 2), ("gtopk", 2), ("gtopk", 4)])
def test_payload_bytes_follow_the_warmup_schedule(name: str, world: int) -> None:
    codecs = make(name, world, start_iter=0, sparsity_warmup=6, density=0.01)
    shapes = list(SHAPES)
    rounds = 1 if name == "topk" else int(math.log2(world))
    for step in range(8):
        d = codecs[0].density
        assert d == codecs[0].density_at(step)
        ks = codecs[0].ks(shapes)
        assert ks == [max(1, math.ceil(d * math.prod(s))) for s in shapes]
        per_msg = codecs[0].payload_bytes(shapes, 4)
        assert per_msg == 8 * sum(ks)
        cost = codecs[0].cost(shapes, world=world, step=step)
        _, sent = sync_step(codecs, grads(world, step))
        assert sent == [rounds * per_msg] * world  # every rank sends the same sizes
        assert cost.nbytes == rounds * per_msg
    assert codecs[0].density == 0.01
    target = codecs[0].cost(shapes, world=world)  # no step: the target density
    assert target.nbytes == rounds * 8 * sum(max(1, math.ceil(0.01 * math.prod(s))) for s in shapes)
    assert codecs[0].cost(shapes, world=world, step=0).nbytes > target.nbytes


# --- momentum factor masking ---------------------------------------------------------------------
def _velocity_before_masking(codecs: list[Any], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """``m*u + g`` computed as ``accumulate`` does (the same kernel: bit-identical)."""
    return [f.clone().add_(velocity(c), alpha=c.momentum_factor) for c, f in zip(codecs, flats)]


@pytest.mark.parametrize("name, world", [("topk", 2), ("gtopk", 2), ("gtopk", 4)])
def test_masking_zeroes_the_velocity_exactly_where_values_were_sent(name: str, world: int) -> None:
    codecs = make(name, world, momentum=0.9, start_iter=0, sparsity_warmup=0, density=0.05,
                  momentum_masking=True)
    sync_step(codecs, grads(world, 0))  # the velocity and memory now hold something
    flats = grads(world, 1)
    u = _velocity_before_masking(codecs, flats)
    mem_before = [memory(c) for c in codecs]
    outs, _ = sync_step(codecs, flats)
    for r, c in enumerate(codecs):
        after = velocity(c)
        masked = after == 0
        if name == "topk":  # the local selection: the residual keeps exactly the rest
            comp = u[r] + mem_before[r]
            sent = memory(c) == 0
            assert int(masked.sum()) == sum(c.ks(list(SHAPES)))
        else:  # the local values that made it into the global selection
            sent = (memory(c) == 0) & (outs[r] != 0)
            comp = u[r] + mem_before[r]
        assert torch.equal(masked, sent & (comp != 0)), r
        assert torch.equal(after[~masked], u[r][~masked]), r  # untouched elsewhere, bit for bit
        assert masked.any()


@pytest.mark.parametrize("name", SPARSE)
def test_without_masking_or_velocity_the_state_is_the_plain_residual(name: str) -> None:
    plain = make(name, 2, start_iter=0, sparsity_warmup=0, momentum_correction=False)
    unmasked = make(name, 2, momentum=0.9, start_iter=0, sparsity_warmup=0, momentum_masking=False)
    default_off = make(name, 2, start_iter=0, sparsity_warmup=0)  # momentum 0: no velocity stage
    for step in range(3):
        a, _ = sync_step(plain, grads(2, step))
        b, _ = sync_step(default_off, grads(2, step))
        sync_step(unmasked, grads(2, step))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert "velocity" not in plain[0].state_dict()
    assert (velocity(unmasked[0]) != 0).all()  # nothing masked


# --- local gradient clipping ---------------------------------------------------------------------
@pytest.mark.parametrize("name, world", [("topk", 2), ("gtopk", 4)])
def test_clipping_bounds_each_workers_contribution_per_tensor(name: str, world: int) -> None:
    clip = 0.5
    thr = clip_threshold(clip, world)
    assert thr == pytest.approx(clip / math.sqrt(world), rel=EPS)
    codecs = make(name, world, start_iter=0, sparsity_warmup=0, density=1.0, clip=clip)
    flats = grads(world, 0, scale=10.0)
    flats[0][LAYOUT.sizes[0]: LAYOUT.sizes[0] + LAYOUT.sizes[1]] *= 1e-4  # p1: below the bound
    outs, _ = sync_step(codecs, flats)
    sizes = LAYOUT.sizes
    # density 1: everything is sent, so the mean is the mean of the clipped gradients
    for j, seg in enumerate(outs[0].split(sizes)):
        assert float(seg.norm()) <= thr * (1 + 4 * EPS * sizes[j])
    clipped = [f.clone() for f in flats]
    for c, f in zip(codecs, clipped):
        c.accumulate(f, LAYOUT, finite_flag(f))
    for r, f in enumerate(clipped):
        for j, (seg, orig) in enumerate(zip(f.split(sizes), flats[r].split(sizes))):
            norm = float(seg.norm())
            assert norm <= thr * (1 + 4 * EPS * sizes[j]), (r, j)
            if float(orig.norm()) <= thr:
                assert torch.equal(seg, orig)  # under the bound: not touched
            else:
                assert norm == pytest.approx(thr, rel=4 * EPS * sizes[j])
                assert torch.allclose(seg / norm, orig / float(orig.norm()), rtol=0, atol=8 * EPS)
    nan = flats[0].clone()
    nan[3] = float("nan")
    codecs[0].accumulate(nan, LAYOUT, finite_flag(nan))
    assert not bool(torch.isfinite(nan).all())  # the poison travels on


def test_clipping_is_on_by_default_where_it_was_measured() -> None:
    for name in ("topk", "gtopk", "powersgd", "acpsgd"):
        assert options_for(name).clip == 1.0, name
    assert options_for("hitopk").clip == 0.0  # its accuracy benchmark was not re-run with it
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(UsageError, match="clip must be a finite number >= 0"):
            options_for("powersgd", clip=bad)


@pytest.mark.parametrize("name, world, momentum, start_iter",
                         [("powersgd", 2, 0.9, 0), ("acpsgd", 4, 0.9, 0), ("acpsgd", 4, 0.0, 0),
                          ("acpsgd", 2, 0.9, 5)])
def test_low_rank_codecs_clip_each_tensor_before_anything_else(name: str, world: int, momentum: float,
                                                                start_iter: int) -> None:
    """On every path: ACP-SGD's compressed CPU step takes the clipping's norms in accumulate
    (they need whole tensors) and defers the scaling and the velocity into its fused encode,
    leaving the buffer as it came until then; the dense warm-up clips in place."""
    clip = 1.0
    thr = clip_threshold(clip, world)
    codec = make(name, world, momentum=momentum, start_iter=start_iter, clip=clip)[0]
    flat = grads(world, 0, scale=10.0)[0]
    small = slice(LAYOUT.sizes[0], LAYOUT.sizes[0] + LAYOUT.sizes[1])
    flat[small] *= 1e-4  # p1: below the bound, left as it is
    orig = flat.clone()
    codec.accumulate(flat, LAYOUT, finite_flag(flat))
    if name == "acpsgd" and not start_iter:  # deferred: the buffer holds g; the factors wait
        pending = codec._deferred[LAYOUT.names]
        assert torch.equal(flat, orig) and pending.stage == bool(momentum)
        clipped = [seg * scale for seg, scale in zip(orig.split(LAYOUT.sizes), pending.scales)]
    else:  # the velocity stage ran: with zero velocity so far, u = g, clipped
        assert not getattr(codec, "_deferred", None)
        clipped = list(flat.split(LAYOUT.sizes))
    for j, (seg, before) in enumerate(zip(clipped, orig.split(LAYOUT.sizes))):
        if float(before.norm()) <= thr:
            assert torch.equal(seg, before), j
        else:
            assert float(seg.norm()) == pytest.approx(thr, rel=4 * EPS * LAYOUT.sizes[j]), j
    cost = codec.cost(list(SHAPES), world=world)
    assert cost.encode.elementwise > make(name, world, momentum=momentum, start_iter=start_iter)[0].cost(
        list(SHAPES), world=world).encode.elementwise  # the clipping's two passes are priced


# --- NaN policy ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SPARSE)
def test_nonfinite_input_leaves_velocity_and_memory_unchanged(name: str) -> None:
    codecs = make(name, 2, momentum=0.9, start_iter=0, sparsity_warmup=4, clip=1.0)
    sync_step(codecs, grads(2, 0))
    before = [(velocity(c), memory(c)) for c in codecs]
    flats = grads(2, 1)
    flats[1][5] = float("nan")
    outs, _ = sync_step(codecs, flats)
    assert all(not bool(torch.isfinite(o).all()) for o in outs)  # every rank sees the poison
    for r, c in enumerate(codecs):
        if r == 1:  # the bad rank keeps all its state
            assert torch.equal(velocity(c), before[r][0]) and torch.equal(memory(c), before[r][1])
        elif name == "gtopk":  # its memory (and masking) depends on the poisoned aggregate
            assert torch.equal(memory(c), before[r][1])
            masked = velocity(c) == 0
            assert not masked.any()  # nothing masked on a skipped step
        assert torch.isfinite(velocity(c)).all() and torch.isfinite(memory(c)).all()


# --- resume in the middle of the warm-up ---------------------------------------------------------
@pytest.mark.parametrize("name, world", [("topk", 2), ("gtopk", 4)])
def test_resume_in_the_middle_of_the_warmup_is_bit_exact(name: str, world: int) -> None:
    opts = dict(start_iter=1, sparsity_warmup="2ep", density=0.01, clip=2.0, fast_select=True, seed=5)
    straight = make(name, world, momentum=0.9, **opts)
    first = make(name, world, momentum=0.9, **opts)
    for step in range(1, 5):  # steps 1..8 are the warm-up (2 epochs of 4 steps)
        sync_step(straight, grads(world, step))
        sync_step(first, grads(world, step))
    assert 0.01 < straight[0].density < 0.25  # stopped mid-warm-up
    ckpt = [roundtrip(c.state_dict()) for c in first]
    resumed = make(name, world, momentum=0.9, **opts)
    for c, state in zip(resumed, ckpt):
        c.load_state_dict(state)
    for step in range(5, 12):
        a, bytes_a = sync_step(straight, grads(world, step))
        b, bytes_b = sync_step(resumed, grads(world, step))
        assert bytes_a == bytes_b
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    for x, y in zip(straight, resumed):
        assert torch.equal(velocity(x), velocity(y)) and torch.equal(memory(x), memory(y))


# --- no host synchronization ---------------------------------------------------------------------
@pytest.mark.parametrize("name, world", [("topk", 2), ("gtopk", 4)])
def test_a_dgc_step_reads_no_device_value_on_the_host(name: str, world: int) -> None:
    """Clipping, velocity, masking and the warm-up's sizes: all decided without a host read."""
    from test_host_sync import HostReads

    codecs = make(name, world, momentum=0.9, start_iter=0, sparsity_warmup=4, clip=1.0)
    sync_step(codecs, grads(world, 0))  # the first step allocates the state
    for step in (1, 2):
        flats = grads(world, step)
        flats[0][1] = float("nan") if step == 2 else flats[0][1]
        with HostReads() as reads:
            sync_step(codecs, flats)
        assert reads.count == 0, reads.report()


# --- through the DDP comm hook on 2 ranks --------------------------------------------------------
@distributed(world_size=2)
def test_through_the_ddp_hook_masking_and_bytes_follow_the_warmup() -> None:
    """The hook accumulates, clips, masks and sends the warm-up's sizes: after every
    compressed step the velocity is zero exactly where the residual was cleared (the sent
    positions), and the counted bytes are the codec's declared cost of each step."""
    import torch.distributed as dist
    from torch import nn

    from lowcomm.comm import accounting
    from lowcomm.hooks import register

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-3)
    hook = register(ddp, "topk", density=0.02, start_iter=1, sparsity_warmup="2ep", momentum=0.9,
                    clip=1.0, steps_per_epoch=2, warmup_density=0.25)
    codec = hook.codec
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shapes = [p.shape for p in model.parameters()]
    gen = torch.Generator().manual_seed(rank)
    expected, densities = 0, []
    for step in range(7):
        opt.zero_grad(set_to_none=True)
        (ddp(torch.randn(16, 8, generator=gen)) - torch.randn(16, 4, generator=gen)).pow(2).mean().backward()
        assert hook.check_finite()
        opt.step()
        if step < 1:
            continue  # the dense start_iter step
        densities.append(codec.density_at(step))
        expected += sum(codec.cost([sh], world=2, step=step).nbytes for sh in shapes)
        state = hook.state_dict()
        for name, u in state["velocity"].items():
            assert torch.equal(u == 0, state["memory"][name] == 0), (step, name)
            assert (u == 0).any()
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.02, 0.02]
    assert accounting.ledger().as_dict()["payload_bytes"] - 4 * sum(p.numel() for p in model.parameters()) == expected


def test_gtopk_defaults_differ_from_topk_where_measured() -> None:
    """gTop-k's longer sparsity warm-up and masking off, and topk's shorter warm-ups
    (TopKOptions and GTopKOptions say why; hitopk keeps gtopk's)."""
    top, gtop = codec_class("topk").Options(), codec_class("gtopk").Options()
    hier = codec_class("hitopk").Options()
    assert (top.momentum_masking, top.sparsity_warmup) == (True, "2ep")
    assert (top.start_iter, top.warmup_density) == ("min(1ep,5%)", 0.0625)
    assert (gtop.momentum_masking, gtop.sparsity_warmup) == (False, "6ep")
    for former in (gtop, hier):
        assert (former.start_iter, former.warmup_density) == ("10%", 0.25)
    assert gtop.density == top.density == 0.01

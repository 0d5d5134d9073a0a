"""gTop-k's and hitopk's CPU kernels give the results of the forms they replace (issue 18).

The merge of sorted (value, index) lists is compared bit for bit with
:func:`~lowcomm.compress.topk.merge_sparse_segments` (ties, cancellations, ``-0.0``, tiny
tensors); whole codec steps of P in-process ranks are compared bit for bit with the device
paths (``LOWCOMM_CPU_FAST=0``: the torch forms CUDA tensors take), outputs and residual
memories alike, including the storage swap that replaces the residual copy. No timing here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowcomm.compress.codec import Layout, Message, codec_class
from lowcomm.compress.selection import accumulate_topk, device_paths, topk_magnitude
from lowcomm.compress.sparse_kernels import Spares, merge_sorted_segments, mergeable, sent_mask
from lowcomm.compress.sparse_device import merge_sparse_batched
from lowcomm.compress.topk import merge_sparse_segments

SIZES = [1, 7, 40, 3, 130, 64, 2]


def _part(rng: np.random.Generator, sizes: list[int], ks: list[int], ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """k sorted distinct positions per segment (buffer offsets) and their values; with
    ``ties`` the values are small integers (equal magnitudes, sums that cancel to 0, -0.0)."""
    idx, off = [], 0
    for n, k in zip(sizes, ks):
        idx.append(np.sort(rng.choice(n, k, replace=False)) + off)
        off += n
    total = sum(ks)
    vals = rng.integers(-3, 4, total).astype(np.float32) if ties else rng.standard_normal(total).astype(np.float32)
    if ties:
        vals[rng.random(total) < 0.2] = -0.0
    return torch.from_numpy(vals), torch.from_numpy(np.concatenate(idx).astype(np.int32))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("density", [0.05, 0.5, 1.0])
def test_merge_of_sorted_lists_equals_the_per_tensor_unique_merge_bit_for_bit(ties: bool, density: float) -> None:
    rng = np.random.default_rng(int(100 * density) + ties)
    ks = [max(1, min(n, int(np.ceil(density * n)))) for n in SIZES]
    bounds = np.concatenate([[0], np.cumsum(SIZES)])
    for _ in range(5):
        ps = [_part(rng, SIZES, ks, ties) for _ in range(2)]
        assert mergeable(ps)
        want_v, want_i = merge_sparse_segments(ps, ks)
        got_v, got_i = merge_sorted_segments(ps, ks, bounds)
        assert torch.equal(got_i, want_i)
        assert torch.equal(got_v.view(torch.int32), want_v.view(torch.int32))  # -0.0 vs +0.0 too


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("density", [0.05, 0.5, 1.0])
def test_device_merge_of_all_segments_at_once_equals_the_per_tensor_merge_bit_for_bit(ties: bool, density: float) -> None:
    """The device paths' merge (fixed-size whole-payload ops, no host reads) against the
    per-tensor unique-and-select merge: the same indices and the same floats (-0.0 too),
    whichever part is listed first, with parts unsorted within a segment as well."""
    rng = np.random.default_rng(int(100 * density) + ties + 7)
    ks = [max(1, min(n, int(np.ceil(density * n)))) for n in SIZES]
    for trial in range(5):
        ps = [_part(rng, SIZES, ks, ties) for _ in range(2)]
        if trial % 2:  # the order within each segment does not matter to either merge
            ps = [(v.flip(0), i.flip(0)) for v, i in ps]
            ps = [(torch.cat([v for v in pv.split(ks[::-1])][::-1]), torch.cat([i for i in pi.split(ks[::-1])][::-1]))
                  for pv, pi in ps]
        for pair in (ps, ps[::-1]):
            want_v, want_i = merge_sparse_segments(pair, ks)
            with device_paths():
                got_v, got_i = merge_sparse_segments(pair, ks)
            direct_v, direct_i = merge_sparse_batched(pair, ks)
            assert torch.equal(got_i, want_i) and torch.equal(direct_i, want_i)
            assert torch.equal(got_v.view(torch.int32), want_v.view(torch.int32))
            assert torch.equal(direct_v.view(torch.int32), want_v.view(torch.int32))


def test_merge_of_one_element_tensors_and_unsorted_parts() -> None:
    one = (torch.tensor([-0.0]), torch.tensor([0], dtype=torch.int32))
    v, i = merge_sorted_segments([one, one], [1], np.array([0, 1]))
    assert i.tolist() == [0] and v.view(torch.int32).item() == 0  # 0 + -0 + -0 = +0
    unsorted = (torch.ones(2), torch.tensor([3, 1], dtype=torch.int32))
    half = (torch.ones(2, dtype=torch.float16), torch.tensor([1, 3], dtype=torch.int32))
    assert not mergeable([one, unsorted]) and not mergeable([half, half]) and not mergeable([one, one, one])


def test_sent_mask_marks_exactly_the_local_positions_chosen_globally() -> None:
    rng = np.random.default_rng(0)
    for n_local, n_chosen in [(0, 5), (5, 0), (50, 50), (200, 17)]:
        local = torch.from_numpy(np.sort(rng.choice(1000, n_local, replace=False)).astype(np.int64))
        chosen = torch.from_numpy(np.sort(rng.choice(1000, n_chosen, replace=False)).astype(np.int32))
        want = torch.from_numpy(np.isin(local.numpy(), chosen.numpy()))
        assert torch.equal(sent_mask(local, chosen), want)


def test_spares_hand_the_spare_to_the_memory_and_keep_the_old_storage_as_the_next_spare() -> None:
    spares = Spares()
    mem = torch.arange(6, dtype=torch.float32)
    spare = spares.get(("a",), mem)
    spare.copy_(torch.full((6,), 7.0))
    old_ptr, spare_ptr = mem.data_ptr(), spare.data_ptr()
    spares.keep(("a",), mem, spare)
    assert torch.equal(mem, torch.full((6,), 7.0)) and mem.data_ptr() == spare_ptr
    assert spares.get(("a",), mem).data_ptr() == old_ptr
    other = torch.full((6,), 2.0)  # not the spare: copied
    spares.keep(("a",), mem, other)
    assert torch.equal(mem, other) and mem.data_ptr() == spare_ptr


# --- whole codec steps: CPU fast paths against the device paths -------------------------------
def _layout() -> Layout:
    names = [f"p{i}" for i in range(len(SIZES))]
    return Layout.of(names, [(n,) for n in SIZES], {n: i for i, n in enumerate(names)})


def _exchange(msgs: list[Message]) -> list[torch.Tensor]:
    """What each rank receives when every rank is at the same stage (no process group)."""
    out = []
    for m in msgs:
        if m.collective == "none":
            out.append(m.buf)
        elif m.collective == "p2p":
            assert m.peer is not None
            out.append(msgs[m.peer].buf.clone() if m.recv else torch.empty_like(m.buf))
        else:
            assert m.collective == "all_gather", m.collective
            out.append(torch.stack([q.buf for q in msgs]))
    return out


def _run(name: str, world: int, steps: int, options: dict[str, object], nonfinite_step: int = -1,
         dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's decoded output of every step, and the final residual memories."""
    layout = _layout()
    cls = codec_class(name)
    opts = cls.Options(density=0.1, start_iter=0, sparsity_warmup=0, **options)
    codecs = [cls(opts, world=world, rank=r) for r in range(world)]
    for c in codecs:
        c.set_momentum(0.9)
    gen = torch.Generator().manual_seed(world)
    outs = []
    for step in range(steps):
        xs = [torch.randn(layout.numel, generator=gen).to(dtype) for _ in codecs]
        flags = [not (step == nonfinite_step and r == world - 1) for r in range(world)]
        if not flags[-1]:
            xs[-1][3] = float("nan")
        msgs = [c.encode(x, layout, torch.tensor(f)) for c, x, f in zip(codecs, xs, flags)]
        while not msgs[0].final:
            got = _exchange(msgs)
            msgs = [c.advance(m, g) for c, m, g in zip(codecs, msgs, got)]
        got = _exchange(msgs)
        for c, m, g in zip(codecs, msgs, got):
            out = torch.empty(layout.numel, dtype=dtype)
            c.decode(m, g, out)
            c.end_step()
            outs.append(out)
    mems = [c.memory.get(layout.names, layout.sizes, outs[0]).clone() for c in codecs]
    return outs, mems


@pytest.mark.parametrize("name", ["gtopk", "hitopk"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 16])
def test_codec_steps_equal_the_device_paths_bit_for_bit(name: str, world: int) -> None:
    fast = _run(name, world, 3, {})
    with device_paths():
        slow = _run(name, world, 3, {})
    for a, b in zip(fast[0] + fast[1], slow[0] + slow[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["gtopk", "hitopk"])
def test_a_nonfinite_step_and_masking_and_no_error_feedback_equal_the_device_paths(name: str) -> None:
    for options in ({"momentum_masking": True}, {"error_feedback": False}):
        fast = _run(name, 4, 3, options, nonfinite_step=1)
        with device_paths():
            slow = _run(name, 4, 3, options, nonfinite_step=1)
        for a, b in zip(fast[0] + fast[1], slow[0] + slow[1]):
            assert torch.equal(a, b) or (a.isnan().any() and b.isnan().any() and torch.equal(a.isnan(), b.isnan()))


@pytest.mark.parametrize("name", ["gtopk", "hitopk"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_take_the_torch_forms_where_numpy_cannot_and_agree(name: str, dtype: torch.dtype) -> None:
    fast = _run(name, 4, 2, {}, dtype=dtype)
    with device_paths():
        slow = _run(name, 4, 2, {}, dtype=dtype)
    for a, b in zip(fast[0] + fast[1], slow[0] + slow[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n, k", [(100_000, 1000), (100_000, 30_000), (5_000, 50)])
def test_fused_add_and_select_into_another_buffer_leaves_the_memory_untouched(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    e, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    e_before, into = e.clone(), torch.full((n,), float("nan"))
    idx = accumulate_topk(e, g, k, out=into)
    assert torch.equal(e, e_before) and torch.equal(into, e_before + g)
    assert torch.equal(idx, topk_magnitude(e_before + g, k))


def test_spares_of_a_rebuilt_layout_are_dropped() -> None:
    """After DDP regroups parameters into new buckets, the old layouts' spares (each a
    gradient-sized buffer) are released; unrelated layouts keep theirs."""
    spares = Spares()
    like = torch.zeros(6)
    spares.get(("a", "b"), like)
    keep = spares.get(("c",), torch.zeros(2))
    spares.get(("b", "a"), like)  # the same parameters in a new layout
    assert set(spares._bufs) == {("b", "a"), ("c",)}
    assert spares.get(("c",), torch.zeros(2)) is keep

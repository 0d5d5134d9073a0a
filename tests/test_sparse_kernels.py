"""The sparse and low-rank kernels' fast CPU paths give today's results (issue 18).

Top-k, its residual memory, its decode, gTop-k's merge and DGC's clipping are compared bit
for bit with the plain forms they replace; the low-rank products and ACP-SGD's fused encode
differ only in float summation order and are compared with a dtype tolerance
(tests/tolerance.py). The device paths (what CUDA tensors take) are exercised on the CPU
with :func:`lowcomm.compress.selection.device_paths`. No timing here: speed lives in
benchmarks/kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.compress import matrices, selection
from lowcomm.compress.codec import Layout, codec_class
from lowcomm.compress.dgc import CLIP_EPS, clip_segments_
from lowcomm.compress.feedback import ErrorFeedback, ParamStore
from lowcomm.compress.matrices import batched_mm, fused_step, orthogonalize
from lowcomm.compress.selection import device_paths, scatter_mean, topk_magnitude
from lowcomm.compress.topk import SparseFeedback, TopK, merge_sparse
from tolerance import rel_err, tolerance


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The documented rule, by a full stable sort: the k largest |x|, ties to the smaller index."""
    order = torch.sort(x.abs(), descending=True, stable=True).indices[:k]
    return torch.sort(order).values


# --- selection --------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(1000, 10), (40_000, 400), (300_000, 3000), (300_000, 100_000)])
def test_topk_magnitude_selects_the_same_set_as_torch_topk(n: int, k: int) -> None:
    x = torch.randn(n, generator=_gen(n))
    got = topk_magnitude(x, k)
    assert torch.equal(got, torch.sort(got).values)  # ascending
    assert set(got.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_topk_ties_break_towards_the_smaller_index_on_the_sampled_path() -> None:
    x = torch.randint(-20, 21, (200_000,), generator=_gen(1)).float()  # many equal magnitudes
    k = 2_000
    assert torch.equal(topk_magnitude(x, k), reference_topk(x, k))
    assert torch.equal(topk_magnitude(x[:5_000], 50), reference_topk(x[:5_000], 50))  # small path


def test_topk_retries_and_falls_back_to_the_exact_set() -> None:
    x = torch.randn(200_000, generator=_gen(2))
    k = 500
    want = reference_topk(x, k)
    assert torch.equal(topk_magnitude(x, k, oversample=0.2), want)  # first threshold too high
    assert torch.equal(topk_magnitude(x, k, oversample=0.2, max_tries=1), want)  # whole-tensor trim


def test_topk_of_a_tensor_with_nans_still_returns_k_distinct_indices() -> None:
    x = torch.randn(100_000, generator=_gen(3))
    x[::7] = float("nan")
    for k in (1_000, 90_000):
        got = topk_magnitude(x, k)
        assert got.numel() == k and torch.unique(got).numel() == k


def test_the_sample_never_touches_the_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    topk_magnitude(torch.randn(100_000, generator=_gen(4)), 100)
    assert torch.equal(before, torch.get_rng_state())


def test_device_paths_select_the_same_set() -> None:
    x = torch.randn(100_000, generator=_gen(5))
    fast = topk_magnitude(x, 1_000)
    with device_paths():
        plain = topk_magnitude(x, 1_000)
    assert set(fast.tolist()) == set(plain.tolist())


# --- residual memory, decode --------------------------------------------------------------------
SIZES = [70_000, 64, 300, 50_000]
LAYOUT = Layout.of([f"t{i}" for i in range(len(SIZES))], [(s,) for s in SIZES], {})


def _run_feedback(cls: type, steps: list[torch.Tensor], finite: list[bool]) -> tuple[list, torch.Tensor]:
    ef = cls(TopK(0.01), store=ParamStore())
    payloads = []
    for g, ok in zip(steps, finite):
        p, _ = ef.compress(g.clone(), LAYOUT, torch.tensor(ok))
        order = torch.argsort(p[1])
        payloads.append((p[0][order], p[1][order]))
    return payloads, ef.memory.get(LAYOUT.names, LAYOUT.sizes, steps[0])


@pytest.mark.parametrize("device_path", [False, True])
def test_sparse_feedback_equals_the_generic_error_feedback_bit_for_bit(device_path: bool) -> None:
    n = sum(SIZES)
    steps = [torch.randn(n, generator=_gen(10 + s)) for s in range(3)]
    steps[1][5] = float("nan")  # a non-finite step leaves the memory unchanged
    finite = [True, False, True]
    want, mem_want = _run_feedback(ErrorFeedback, steps, finite)
    if device_path:
        with device_paths():
            got, mem_got = _run_feedback(SparseFeedback, steps, finite)
    else:
        got, mem_got = _run_feedback(SparseFeedback, steps, finite)
    assert torch.equal(mem_got, mem_want)
    for (vg, ig), (vw, iw), ok in zip(got, want, finite):
        assert ig.numel() == iw.numel()
        if ok:  # (a poisoned step: any k indices, torch.topk ranks NaN first, numpy never)
            assert torch.equal(ig, iw) and torch.equal(vg, vw)


def _payloads(world: int, n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for w in range(world):
        g = _gen(100 + w)
        idx = torch.sort(torch.randperm(n, generator=g)[:k]).values.to(torch.int32)
        out.append((torch.randn(k, generator=g), idx))
    return out


@pytest.mark.parametrize("world", [4, 16])
def test_topk_decode_equals_zero_fill_index_add_divide_bit_for_bit(world: int) -> None:
    n = 3 * selection.OUT_CHUNK + 123  # several chunks and a short last one
    pays = _payloads(world, n, 5_000)
    pays[1] = (pays[1][0], pays[0][1])  # two workers sending the same indices: sums in order
    want = torch.zeros(n).index_add_(0, torch.cat([i for _, i in pays]).long(), torch.cat([v for v, _ in pays]))
    want.div_(world)
    assert torch.equal(TopK.aggregate_into(torch.full((n,), 7.0), pays), want)
    shuffled = [(v.flip(0), i.flip(0)) for v, i in pays]  # not ascending: the plain passes
    want_sh = torch.zeros(n).index_add_(0, torch.cat([i for _, i in shuffled]).long(),
                                        torch.cat([v for v, _ in shuffled])).div_(world)
    assert torch.equal(TopK.aggregate_into(torch.empty(n), shuffled), want_sh)
    with device_paths():
        assert torch.equal(TopK.aggregate_into(torch.empty(n), pays), want)


def test_scatter_mean_of_one_small_buffer_is_the_plain_mean() -> None:
    out = torch.empty(10)
    scatter_mean(out.numpy(), [(torch.tensor([1.0, 2.0]).numpy(), torch.tensor([3, 3]).numpy())])
    assert out.tolist() == [0.0] * 3 + [3.0] + [0.0] * 6


def test_merge_sparse_fast_path_equals_the_stable_sort() -> None:
    g = _gen(20)
    vals = [torch.randint(-5, 6, (3_000,), generator=g).float() for _ in range(2)]  # ties
    idx = [torch.sort(torch.randperm(10_000, generator=g)[:3_000]).values.to(torch.int32) for _ in range(2)]
    fast = merge_sparse(vals, idx, 3_000)
    with device_paths():
        plain = merge_sparse(vals, idx, 3_000)
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])


def test_clipping_in_one_batch_equals_the_per_tensor_loop() -> None:
    flat = torch.randn(sum(SIZES), generator=_gen(30))
    flat[:300] *= 100  # one tensor above the bound, the others below
    want = flat.clone()
    for part in want.split(SIZES):
        part.mul_((2.0 / (part.norm() + CLIP_EPS)).clamp_(max=1.0))
    assert torch.equal(clip_segments_(flat, SIZES, 2.0), want)


# --- low rank -----------------------------------------------------------------------------------
def test_cpu_product_form_matches_the_plain_product() -> None:
    ms = [torch.randn(64, 900, generator=_gen(40 + i)) for i in range(3)]
    f = torch.randn(3, 900, 4, generator=_gen(43))
    p = torch.randn(3, 64, 4, generator=_gen(44))
    ops = 900  # a dot product of m terms, in another order
    for got, want in ((batched_mm(ms, f), torch.stack([m @ f[k] for k, m in enumerate(ms)])),
                      (batched_mm(torch.stack(ms), f), torch.stack([m @ f[k] for k, m in enumerate(ms)])),
                      (batched_mm(ms, p, transpose=True), torch.stack([m.T @ p[k] for k, m in enumerate(ms)]))):
        assert rel_err(got, want) <= tolerance(torch.float32, ops=ops)


@pytest.mark.parametrize("rows", [True, False])
def test_fused_step_equals_the_unfused_formulas(rows: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrices, "BLOCK", 1_000)  # many blocks, a short last one
    n, m, r = 48, 130, 3
    g, e0, u0 = (torch.randn(n, m, generator=_gen(50 + i)) for i in range(3))
    f = orthogonalize(torch.randn(m if rows else n, r, generator=_gen(53)))
    e, u, out = e0.clone(), u0.clone(), torch.empty(n if rows else m, r)
    fused_step(g, e, f, out, rows=rows, velocity=u)
    mat = g + e0
    want = mat @ f if rows else mat.T @ f
    e_want = mat - (want @ f.T if rows else f @ want.T)
    u_want = u0 - (u0 @ f @ f.T if rows else f @ (f.T @ u0))
    ops = max(n, m)  # one sum over a side of the matrix, another over r
    for got, exp in ((out, want), (e, e_want), (u, u_want)):
        assert rel_err(got, exp) <= tolerance(torch.float32, ops=ops)


SHAPES = [(32, 8, 3, 3), (32,), (64, 32, 3, 3), (64, 32, 3, 3), (10, 64)]
LR_LAYOUT = Layout.of([f"p{i}" for i in range(len(SHAPES))], SHAPES, {f"p{i}": i for i in range(len(SHAPES))})


def _lowrank_run(name: str, steps: int) -> tuple[list[torch.Tensor], dict]:
    cls = codec_class(name)
    codec = cls(cls.Options(start_iter=0, rank=2), world=1)
    codec.set_momentum(0.9)
    n = LR_LAYOUT.numel
    outs = []
    fin = torch.ones((), dtype=torch.bool)
    for s in range(steps):
        flat = torch.randn(n, generator=_gen(60 + s))
        codec.accumulate(flat, LR_LAYOUT, fin)
        msg = codec.encode(flat, LR_LAYOUT, fin)
        while not msg.final:
            msg = codec.advance(msg, msg.buf.clone())
        out = torch.empty(n)
        codec.decode(msg, msg.buf.clone(), out)
        codec.end_step()
        outs.append(out)
    return outs, codec.state_dict()


@pytest.mark.parametrize("name", ["acpsgd", "powersgd"])
def test_lowrank_cpu_paths_match_the_device_paths_up_to_summation_order(name: str) -> None:
    """Two steps (acpsgd: a P- and a Q-step) with momentum and masking, fused CPU path against
    the branch-free device path. ops: a dot product over the longer matrix side (288), twice
    over (product, then residual/rebuild); cond: the second step orthogonalizes a factor that
    carries the first step's difference, bounded here by the factors' condition number."""
    fast, st_fast = _lowrank_run(name, 2)
    with device_paths():
        plain, st_plain = _lowrank_run(name, 2)
    cond = max(float(torch.linalg.cond(t)) for t in [*st_plain["p"].values(), *st_plain["q"].values()])
    tol = tolerance(torch.float32, ops=2 * 288, cond=max(1.0, cond))
    for a, b in zip(fast, plain):
        assert rel_err(a, b) <= tol
    for key in ("memory", "velocity", "p", "q"):
        for pname, t in st_plain[key].items():
            assert rel_err(st_fast[key][pname], t) <= tol, (key, pname)
    assert math.isfinite(tol)

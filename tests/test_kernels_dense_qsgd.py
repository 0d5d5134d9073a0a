"""QSGD's fast kernels (lowcomm.compress.qsgdkern, lowcomm.compress.qsgdjit): the documented
uniforms and rounding, one result whatever the path (compiled, torch, torch without numba) or
the fusion, and unbiasedness to the stated resolution."""

from __future__ import annotations

import math

import pytest
import torch

from kernels_testlib import require_compiled
from lowcomm.compress import native, qsgdkern
from lowcomm.compress.qsgd import Quantizer
from lowcomm.compress.qsgdkern import U_OFFSET, U_SCALE, uniforms


def _reference_levels(x: torch.Tensor, seg: list[int], seeds: list[int], s: int, bs: int) -> torch.Tensor:
    """The docstring's arithmetic, one tensor and one bucket at a time."""
    out, off = [], 0
    for n, seed in zip(seg, seeds):
        t, u = x[off : off + n], uniforms(seed, n)
        for a in range(0, n, bs):
            v = t[a : a + bs]
            norm = torch.linalg.vector_norm(torch.nn.functional.pad(v, (0, bs - v.numel())))
            scale = torch.where(norm > 0, s / norm, torch.zeros(()))
            out.append(torch.clamp(torch.floor(v * scale + u[a : a + bs]), -s, s).to(torch.int8))
        off += n
    return torch.cat(out)


def _paths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, object]]:
    """(name, LOWCOMM_CPU_FAST, the loaded kernel module) of the CPU compiled path, the torch
    path that device tensors take, and the CPU fast setting on a machine without numba."""
    jit = require_compiled("qsgdjit")
    return [("torch", "0", jit), ("no numba", "1", None), ("compiled", "1", jit)]


@pytest.mark.parametrize("seg, bs", [([70_000, 9, 512, 131_072, 3], 512), ([1000, 7, 20_001], 7),
                                     ([4, 4, 4], 48), ([6_600], 100)])
def test_every_path_gives_the_documented_levels_bit_for_bit(
        seg: list[int], bs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial buckets, buckets not a multiple of 4 and tensors smaller than a bucket: the
    compiled CPU kernel, the whole-buffer torch path, the fallback without numba and the
    reference agree exactly (norms too)."""
    x = torch.randn(sum(seg), generator=torch.Generator().manual_seed(1))
    x[:bs] = 0.0  # a bucket of norm 0
    seeds = [11 * i + 5 for i in range(len(seg))]
    expected = _reference_levels(x, seg, seeds, 5, bs)
    for name, fast, jit in _paths(monkeypatch):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        monkeypatch.setitem(native._LOADED, "qsgdjit", jit)
        q = Quantizer(levels=5, bucket_size=bs)
        q.seeds = seeds
        levels, norms = q.compress(x, seg)[0]
        assert torch.equal(levels, expected), name
        assert torch.equal(norms, qsgdkern.bucket_norms(x, qsgdkern.plan_of(seg, bs))), name


def test_every_path_decodes_the_same_mean_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled decode adds the workers' products in the generic decode's order: three
    workers' payloads average to the same bits on every path."""
    seg, bs = [5000, 3, 1029], 64
    payloads = []
    for r in range(3):
        q = Quantizer(levels=7, bucket_size=bs)
        q.seeds = [100 * r + i for i in range(len(seg))]
        payload, ctx = q.compress(torch.randn(sum(seg), generator=torch.Generator().manual_seed(r)), seg)
        payloads.append(payload)
    means = {}
    for name, fast, jit in _paths(monkeypatch):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        monkeypatch.setitem(native._LOADED, "qsgdjit", jit)
        means[name] = Quantizer(levels=7, bucket_size=bs).aggregate(payloads, ctx)
    for name, mean in means.items():
        assert torch.equal(mean, means["torch"]), name


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 on a Python int (the documented hash, written once more)."""
    m = (1 << 32) - 1
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _word(i: int, k1: int, k2: int) -> int:
    h = _lowbias32(_lowbias32((i // 2 + k1) & 0xFFFFFFFF) ^ k2)
    return (h >> 16) if i & 1 else (h & 0xFFFF)


def test_words_are_the_documented_hash_of_the_index_and_wrap_modulo_2_32() -> None:
    """``w_i`` = the low (even ``i``) or high (odd ``i``) half of
    ``H(H((i // 2 + k1) mod 2**32) xor k2)``, checked on Python integers, for keys whose
    ``i // 2 + k1`` wraps past ``2**32`` inside the tensor, with buckets starting at odd
    elements (torch and compiled paths)."""
    seed = 77
    k1, k2 = qsgdkern.keys(seed)
    w = qsgdkern.words(seed, 1000)
    assert w.tolist()[:51] == [_word(i, k1, k2) for i in range(51)]
    jit = require_compiled("qsgdjit")
    import numpy as np

    n, bs, k1, k2 = 4095, 7, (1 << 32) - 1000, 12345  # 585 buckets; the pair index wraps at element 2000
    x = torch.full((n,), 0.5)  # buckets of 7, every other one starting at an odd element
    norms = torch.linalg.vector_norm(x.view(-1, bs), dim=1)
    out = torch.empty(n, dtype=torch.int8)
    starts, firsts = np.array([0, n], dtype=np.int64), np.array([0], dtype=np.int64)
    jit.levels(x.numpy(), norms.numpy(), starts, firsts, np.array([k1]), np.array([k2]), bs, 127.0, out.numpy())
    u = torch.tensor([_word(i, k1, k2) for i in range(n)]).to(torch.float32) * U_SCALE + U_OFFSET
    y = x * (norms.reciprocal() * 127.0).repeat_interleave(bs)[:n]
    assert torch.equal(out, torch.clamp(torch.floor(y + u), -127, 127).to(torch.int8))


def test_uniforms_are_the_documented_16_bit_grid_reproducible_and_distinct_per_seed() -> None:
    u = uniforms(123, 100_003)
    k = (u - U_OFFSET) / U_SCALE  # the 16-bit words
    assert torch.equal(k, k.round()) and float(k.min()) >= 0 and float(k.max()) <= 65535
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, uniforms(123, 100_003))
    assert torch.equal(uniforms(123, 10), u[:10])  # a prefix of the same stream
    assert not torch.equal(uniforms(124, 1000), u[:1000])
    # the 2**16 values are about equally likely: a chi-square over 16 bins of 100003 draws
    # has mean 15 and sd sqrt(30); 80 is 12 sd above the mean
    counts = torch.bincount((k // 4096).long(), minlength=16).double()
    assert float(((counts - counts.mean()) ** 2 / counts.mean()).sum()) < 80


def test_the_quantizer_is_unbiased_to_its_resolution() -> None:
    """E[level] = y (the scaled value) up to 2**-16. Each level is floor(y) + B, B a
    Bernoulli(p) draw (p the fractional part of y, up to the resolution), independent over
    N seeds. Bernstein's inequality bounds the mean of N such draws: it misses p by more than
    sqrt(2 p (1 - p) L / N) + 2 L / (3 N) with probability at most 2 exp(-L); L = ln(2e12)
    makes that 1e-12 per element. The draws are fixed by the seeds, so the test is
    deterministic; a quantizer that always rounds down misses the band wherever p is not
    small (more than half the elements here)."""
    n, trials, s, bs = 256, 400, 3, 64
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    q = Quantizer(levels=s, bucket_size=bs)
    norms = torch.linalg.vector_norm(x.view(-1, bs), dim=1)
    y = (x.view(-1, bs) * (s / norms)[:, None]).reshape(-1).double()
    total = torch.zeros(n, dtype=torch.float64)
    for t in range(trials):
        q.seeds = [1_000 + t]
        total += q.compress(x, [n])[0][0].double()
    mean = total / trials
    p = y - y.floor()
    big_l = math.log(2e12)
    band = (2 * p * (1 - p) * big_l / trials).sqrt() + 2 * big_l / (3 * trials) + 2.0**-16
    assert bool(((mean - y).abs() <= band).all())
    assert int((p > band).sum()) > n // 2  # always rounding down would be caught


def test_plan_merges_consecutive_whole_buckets_into_one_run() -> None:
    plan = qsgdkern.plan_of([1024, 512, 100, 1536, 3], 512)
    assert plan.runs == [(0, 0, 3), (1636, 4, 3)]
    assert plan.buckets == 8 and plan.tail_bucket.tolist() == [3, 7]
    assert int(plan.counts.sum()) == 1024 + 512 + 100 + 1536 + 3
    assert math.prod(plan.tail_src.shape) == 103


def test_a_bucket_larger_than_the_buffer_gives_the_documented_levels_and_mean() -> None:
    """One norm per tensor (a bucket far larger than the buffer): the levels are the
    documented ones and two equal payloads average to their decode."""
    seg, bs = [1000, 3000], 2**28
    x = torch.randn(sum(seg), generator=torch.Generator().manual_seed(3))
    q = Quantizer(levels=5, bucket_size=bs)
    q.seeds = [7, 8]
    payload, ctx = q.compress(x, seg)
    assert torch.equal(payload[0], _reference_levels(x, seg, [7, 8], 5, bs))
    mean = q.aggregate([payload, payload], ctx)
    # two equal payloads: their decode, up to the order of two float roundings per element
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(mean, q.decompress(payload, ctx), rtol=4 * eps, atol=0.0)


def test_plans_are_kept_for_every_bucket_of_a_large_model() -> None:
    """A model has one layout per bucket: the cache keeps far more than a few, so no bucket's
    plan is rebuilt (and re-copied to a GPU) every step."""
    layouts = [[4096 + i] for i in range(qsgdkern.PLANS_KEPT)]
    plans = [qsgdkern.plan_of(seg, 512) for seg in layouts]
    assert all(qsgdkern.plan_of(seg, 512) is p for seg, p in zip(layouts, plans))


def test_without_numba_one_warning_names_the_extra_and_the_encode_still_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delitem(native._LOADED, "qsgdjit", raising=False)
    import lowcomm.compress

    monkeypatch.setitem(sys.modules, "lowcomm.compress.qsgdjit", None)  # import raises ImportError
    monkeypatch.delattr(lowcomm.compress, "qsgdjit", raising=False)  # (once imported, also an attribute)
    monkeypatch.setenv("LOWCOMM_CPU_FAST", "1")
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    q = Quantizer(levels=5, bucket_size=64)
    q.seeds = [9]
    with pytest.warns(RuntimeWarning, match=r"lowcomm\[fast\]"):
        levels = q.compress(x, [3000])[0][0]
    assert torch.equal(levels, _reference_levels(x, [3000], [9], 5, 64))
    assert qsgdkern.compiled() is None  # decided once: no second warning


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; `make test-gpu` on a GPU machine")
def test_cuda_draws_the_same_words_and_levels_as_the_cpu() -> None:
    """The words are a hash of (seed, index) computed by torch integer operations, so a GPU
    draws what the CPU draws, and with the same norms the levels agree bit for bit."""
    assert torch.equal(qsgdkern.words(5, 10_001, "cuda").cpu(), qsgdkern.words(5, 10_001))
    plan = qsgdkern.plan_of([5000, 7, 1029], 64)
    assert torch.equal(qsgdkern.buffer_words(plan, 2**62 + 11, [4, 0, 9], "cuda").cpu(),
                       qsgdkern.buffer_words(plan, 2**62 + 11, [4, 0, 9], "cpu"))
    seg, seeds = [5000, 7, 1029], [3, 4, 5]
    x = torch.randn(sum(seg), generator=torch.Generator().manual_seed(6))
    q = Quantizer(levels=7, bucket_size=64)
    q.seeds = seeds
    levels_gpu, norms_gpu = q.compress(x.cuda(), seg)[0]
    assert torch.equal(levels_gpu.cpu(), _reference_levels_from(x, seg, seeds, 7, 64, norms_gpu.cpu()))


def _reference_levels_from(x: torch.Tensor, seg: list[int], seeds: list[int], s: int, bs: int,
                           norms: torch.Tensor) -> torch.Tensor:
    """The documented levels given the bucket norms (a GPU's norm reduction may round the
    last bit differently from the CPU's; the levels follow from whatever norms were sent)."""
    plan = qsgdkern.plan_of(seg, bs)
    scale = torch.where(norms > 0, s / norms, torch.zeros(()))
    return qsgdkern.quantize_torch(x, plan, scale, seeds, float(s))


def test_buffer_words_equal_each_tensors_words_from_its_draw_seed() -> None:
    """The whole-buffer draw (keys computed from the seed base on the device side) gives each
    tensor the words of its own draw_seed, including seeds above 2**62 and empty tensors."""
    from lowcomm.compress.qsgd import draw_seed, seed_base

    seg, indices = [1001, 0, 7, 4096, 3], [5, 0, 999_999, 17, 2]
    plan = qsgdkern.plan_of(seg, 64)
    for seed, step, rank in [(0, 0, 0), (3, 12_345, 3), (2**62 + 7, 10**9, 1_000_000)]:
        base = seed_base(seed, step, rank)
        seeds = [draw_seed(seed, step, i, rank) for i in indices]
        assert seeds == [(base + i * qsgdkern.SEED_STRIDE) % 2**63 for i in indices]
        expected = torch.cat([qsgdkern.words(sd, n) for sd, n in zip(seeds, seg)])
        assert torch.equal(qsgdkern.buffer_words(plan, base, indices, "cpu"), expected)


def test_the_codec_device_path_draws_whole_buffers_with_the_same_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the codec (which sets the seed base): the torch path's levels equal the
    compiled (or per-tensor) path's, so a GPU rank and a CPU rank of the same step agree."""
    from lowcomm.compress.codec import Layout, codec_class

    shapes = [(40, 30), (7,), (3, 5, 5)]
    names = [f"p{i}" for i in range(len(shapes))]
    layout = Layout.of(names, shapes, {n: 3 * i + 1 for i, n in enumerate(names)})
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(8))
    payloads = []
    for fast in ("1", "0"):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        codec = codec_class("qsgd")(codec_class("qsgd").Options(bucket_size=50, start_iter=0), world=2, rank=1)
        codec.step = 9
        codec.prepare(layout)
        assert codec.quantizer.affine is not None
        payloads.append(codec.quantizer.compress(x, layout.sizes)[0])
    assert torch.equal(payloads[0][0], payloads[1][0]) and torch.equal(payloads[0][1], payloads[1][1])

"""QSGD's fast kernels (lowcomm.compress.qsgdkern): the documented uniforms and rounding, one
result whatever the path, the fusion or the chunking, and unbiasedness to the stated
resolution."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.compress import qsgdkern
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


@pytest.mark.parametrize("seg, bs", [([70_000, 9, 512, 131_072, 3], 512), ([1000, 7, 20_001], 7),
                                     ([4, 4, 4], 48), ([6_600], 100)])
def test_fast_and_device_paths_give_the_documented_levels_bit_for_bit(
        seg: list[int], bs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk boundaries (chunks of about 1000 elements here: many per tensor), partial
    buckets, buckets not a multiple of 4 and tensors smaller than a bucket: the CPU chunked
    kernel, the whole-buffer torch path and the reference agree exactly (norms too)."""
    monkeypatch.setattr(qsgdkern, "CHUNK", 1000)
    x = torch.randn(sum(seg), generator=torch.Generator().manual_seed(1))
    x[:bs] = 0.0  # a bucket of norm 0
    seeds = [11 * i + 5 for i in range(len(seg))]
    got = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        q = Quantizer(levels=5, bucket_size=bs)
        q.seeds = seeds
        got[fast] = q.compress(x, seg)[0]
    assert torch.equal(got["1"][0], got["0"][0]) and torch.equal(got["1"][1], got["0"][1])
    assert torch.equal(got["1"][0], _reference_levels(x, seg, seeds, 5, bs))


def test_uniforms_are_the_documented_16_bit_grid_reproducible_and_distinct_per_seed() -> None:
    u = uniforms(123, 100_003)
    k = (u - U_OFFSET) / U_SCALE  # the signed 16-bit words
    assert torch.equal(k, k.round()) and float(k.min()) >= -32768 and float(k.max()) <= 32767
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, uniforms(123, 100_003))
    assert torch.equal(uniforms(123, 10), u[:10])  # a prefix of the same stream
    assert not torch.equal(uniforms(124, 1000), u[:1000])
    # the 2**16 values are about equally likely: a chi-square over 16 bins of 100003 draws
    # has mean 15 and sd sqrt(30); 80 is 12 sd above the mean
    counts = torch.bincount(((k + 32768) // 4096).long(), minlength=16).double()
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


@pytest.mark.parametrize("seg, bs, chunk", [([1000, 3000], 2**28, None), ([1000, 200], 64, 10**6)])
def test_scratch_is_sized_by_the_data_not_by_the_bucket_or_chunk_size(
        seg: list[int], bs: int, chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One norm per tensor (a bucket far larger than the buffer), or chunks longer than any
    tensor, must not ask for bucket- or chunk-sized work buffers: the encode's and the
    aggregate's scratch stay within the data, and the levels and the mean are still the
    documented ones."""
    from lowcomm.compress import base

    if chunk is not None:
        monkeypatch.setattr(qsgdkern, "CHUNK", chunk)
    monkeypatch.setattr(base._SCRATCH, "pool", {}, raising=False)
    monkeypatch.setenv("LOWCOMM_CPU_FAST", "1")
    x = torch.randn(sum(seg), generator=torch.Generator().manual_seed(3))
    q = Quantizer(levels=5, bucket_size=bs)
    q.seeds = [7, 8]
    payload, ctx = q.compress(x, seg)
    assert torch.equal(payload[0], _reference_levels(x, seg, [7, 8], 5, bs))
    mean = q.aggregate([payload, payload], ctx)
    # two equal payloads: their decode, up to the order of two float roundings per element
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(mean, q.decompress(payload, ctx), rtol=4 * eps, atol=0.0)
    assert max(t.numel() for t in base._SCRATCH.pool.values()) <= sum(seg)


def test_plans_are_kept_for_every_bucket_of_a_large_model() -> None:
    """A model has one layout per bucket: the cache keeps far more than a few, so no bucket's
    plan is rebuilt (and re-copied to a GPU) every step."""
    layouts = [[4096 + i] for i in range(qsgdkern.PLANS_KEPT)]
    plans = [qsgdkern.plan_of(seg, 512) for seg in layouts]
    assert all(qsgdkern.plan_of(seg, 512) is p for seg, p in zip(layouts, plans))

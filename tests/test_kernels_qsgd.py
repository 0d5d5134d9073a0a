"""QSGD's CPU decode (one gather of the bucket steps per worker) equals the generic decode bit
for bit, and its encode is unchanged (levels and norms), with and without the fast paths."""

from __future__ import annotations

import pytest
import torch

from lowcomm.compress.qsgd import Quantizer

SEG = [1000, 512, 7, 1536, 3]


@pytest.mark.parametrize("world", [1, 3, 16])
@pytest.mark.parametrize("bucket_size", [512, 100])
def test_qsgd_mean_matches_the_generic_decode_bit_for_bit(world: int, bucket_size: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    n = sum(SEG)
    results = []
    for fast in ("1", "0"):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        q = Quantizer(levels=127, bucket_size=bucket_size)
        payloads = []
        for w in range(world):
            x = torch.randn(n, generator=torch.Generator().manual_seed(w))
            x[:512] = 0.0  # a bucket of norm 0
            q.seeds = [w * 10 + i for i in range(len(SEG))]
            payloads.append(q.compress(x, SEG)[0])
        ctx = (n, torch.float32, SEG)
        out = torch.empty(n)
        q.aggregate_out(payloads, ctx, out)
        results.append((payloads, q.aggregate(payloads, ctx), out))
    (p_fast, agg_fast, out_fast), (p_ref, agg_ref, out_ref) = results
    for a, b in zip(p_fast, p_ref):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(agg_fast, agg_ref) and torch.equal(out_fast, agg_ref) and torch.equal(out_ref, agg_ref)

"""On a GPU (``make test-gpu``): the low-rank codecs' batched orthogonalization and gTop-k's
batched merge give the CPU results and never wait for the device.

The CPU suite runs these device paths on CPU tensors (``device_paths()``) and counts their
operations (``benchmarks/device_ops.py``); what it cannot see is a wait inside a CUDA kernel's
host code (a data-dependent output size). ``torch.cuda.set_sync_debug_mode("error")`` turns
any such wait into an error. The body runs in a child process, so the pytest process never
touches the GPU (as in tests/test_cuda_smoke.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU (torch.cuda.is_available() is False); `make test-gpu`")

BODY = textwrap.dedent("""
    import numpy as np, torch
    from lowcomm.compress.matrices import orthogonalize, orthogonalize_all
    from lowcomm.compress.sparse_device import merge_sparse_batched
    from lowcomm.compress.topk import merge_sparse_segments

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 40, 4, generator=g), torch.randn(2, 130, 4, generator=g), torch.randn(1, 7, 2, generator=g)]
    flag = torch.ones((), dtype=torch.bool, device="cuda")
    dev = [x.cuda() for x in xs]
    orthogonalize_all(dev, flag)  # (first call: kernels load)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    got = orthogonalize_all(dev, flag)
    torch.cuda.set_sync_debug_mode(0)
    for x, q in zip(xs, got):
        err = float((q.cpu() - orthogonalize(x)).abs().max())
        assert err < 1e-4, ("orthogonalize_all", err)

    rng = np.random.default_rng(1)
    sizes, ks = [7, 40, 3, 130, 64], [2, 4, 1, 13, 6]
    def part():
        idx, off = [], 0
        for n, k in zip(sizes, ks):
            idx.append(np.sort(rng.choice(n, k, replace=False)) + off)
            off += n
        return (torch.from_numpy(rng.integers(-3, 4, sum(ks)).astype(np.float32)),
                torch.from_numpy(np.concatenate(idx).astype(np.int32)))
    pair = [part(), part()]
    want_v, want_i = merge_sparse_segments(pair, ks)
    on = [(v.cuda(), i.cuda()) for v, i in pair]
    merge_sparse_batched(on, ks)  # (first call: the segment table is copied to the device once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    got_v, got_i = merge_sparse_batched(on, ks)
    torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu().view(torch.int32), want_v.view(torch.int32))
    print("ok")
""")


@cuda
@needs_gpu
def test_batched_orthogonalization_and_sparse_merge_match_the_cpu_and_never_wait_on_cuda() -> None:
    done = subprocess.run([sys.executable, "-c", BODY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr

"""The kernel bound's byte and FLOP formulas (contract K1), and the kernels benchmark's rows.

Formulas only: no speed is asserted (the measured bandwidths depend on the machine).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from lowcomm.bench.kernel_bound import (
    KNOWN,
    compression_bound_s,
    copy_bandwidth_bytes_per_s,
    kernel_bytes,
    kernel_flops,
    sustained_rates,
)
from lowcomm.compress.codec import CODECS
from lowcomm.errors import UsageError

SHAPES = [(64, 3, 3, 3), (64,), (128, 64, 3, 3), (10, 512), (10,)]
N = sum(math.prod(s) for s in SHAPES)


def test_every_registered_compressor_has_a_bound() -> None:
    assert set(CODECS.names()) <= set(KNOWN)


def test_cast_reads_fp32_and_writes_half_both_ways() -> None:
    assert kernel_bytes("fp16", 1000, world=4) == {"encode": 6000, "decode": 6000, "feedback": 0}


def test_sign_payload_decode_reads_every_worker_once_and_writes_once() -> None:
    n, t = 1001, 3
    payload = (n + 7) // 8 + 4 * t
    for world in (4, 16):
        b = kernel_bytes("signum", n, world=world, tensors=t)
        assert b["decode"] == world * payload + 4 * n
        assert b["feedback"] == 12 * n and b["encode"] == 16 * n + payload
    ef = kernel_bytes("signsgd", n, world=4, tensors=t)  # velocity 16n + residual memory 20n
    assert ef["feedback"] == 36 * n and ef["encode"] == 40 * n + payload
    no_velocity = kernel_bytes("signsgd", n, world=4, tensors=t, momentum_correction=False)
    assert no_velocity["feedback"] == 20 * n


def test_qsgd_payload_is_a_byte_per_element_and_a_norm_per_bucket() -> None:
    b = kernel_bytes("qsgd", N, world=4, shapes=SHAPES, bucket_size=512)
    payload = N + 4 * sum(-(-math.prod(s) // 512) for s in SHAPES)
    assert b == {"encode": 4 * N + payload, "decode": 4 * payload + 4 * N, "feedback": 0}


def test_topk_counts_values_and_int32_indices_per_tensor() -> None:
    b = kernel_bytes("topk", N, world=4, shapes=SHAPES, density=0.01)
    payload = 8 * sum(max(1, math.ceil(0.01 * math.prod(s))) for s in SHAPES)
    assert b["decode"] == 4 * N + 4 * payload
    assert b["encode"] == b["feedback"] + 4 * N + payload
    g = kernel_bytes("gtopk", N, world=16, shapes=SHAPES, density=0.01)
    assert g["decode"] == 4 * N + 3 * payload * 4  # log2(16) rounds


def test_lowrank_bytes_split_compressed_and_uncompressed_tensors() -> None:
    # rank 4: (64, 27) -> 91*4*2 < 1728: compressed; (128, 576) compressed; (10, 512): 522*4*2 = 4176 < 5120
    n_c = 64 * 27 + 128 * 576 + 10 * 512
    n_u = 64 + 10
    p_elems = 4 * (64 + 128 + 10)
    b = kernel_bytes("powersgd", N, world=4, shapes=SHAPES, rank=4)
    assert b["encode"] == 16 * N + 12 * n_c + 8 * n_u + 4 * n_c + 4 * p_elems
    assert b["decode"] == 16 * n_c + 8 * n_u + 8 * n_c  # + the velocity's masking (default on)
    unmasked = kernel_bytes("powersgd", N, world=4, shapes=SHAPES, rank=4, momentum_masking=False)
    assert unmasked["decode"] == 16 * n_c + 8 * n_u
    assert kernel_bytes("powersgd", N, world=4, shapes=SHAPES, rank=4, momentum_correction=False)["decode"] \
        == 16 * n_c + 8 * n_u  # no velocity, nothing to mask
    a = kernel_bytes("acpsgd", N, world=4, shapes=SHAPES, rank=4)
    assert a["encode"] == 16 * N + 24 * n_c + 8 * n_u and a["decode"] == 4 * n_c + 8 * n_u


def test_matmul_flops_are_only_for_the_lowrank_codecs() -> None:
    abr = 4 * (64 * 27 + 128 * 576 + 10 * 512)
    assert kernel_flops("powersgd", SHAPES, rank=4, world=4) == {"encode": 2 * abr, "decode": 8 * abr}
    assert kernel_flops("powersgd", SHAPES, rank=4, world=4, masking=False) == {"encode": 2 * abr, "decode": 4 * abr}
    assert kernel_flops("acpsgd", SHAPES, rank=4, world=4) == {"encode": 4 * abr, "decode": 2 * abr}
    assert kernel_flops("signsgd", SHAPES, rank=4, world=4) == {}


def test_bound_is_the_larger_of_bytes_and_flops_per_kernel() -> None:
    b = kernel_bytes("powersgd", N, world=4, shapes=SHAPES)
    f = kernel_flops("powersgd", SHAPES, rank=4, world=4)
    bytes_only = compression_bound_s("powersgd", SHAPES, world=4, bandwidth=1e9)
    assert bytes_only == pytest.approx((b["encode"] + b["decode"]) / 1e9)
    slow_flops = compression_bound_s("powersgd", SHAPES, world=4, bandwidth=1e9, flops_per_s=1e6)
    assert slow_flops == pytest.approx((f["encode"] + f["decode"]) / 1e6)


def test_bad_input_says_what_is_valid() -> None:
    with pytest.raises(UsageError, match="valid: acpsgd"):
        kernel_bytes("nope", 10, world=2)
    with pytest.raises(UsageError, match="bandwidth"):
        compression_bound_s("fp16", SHAPES, world=2, bandwidth=0)
    with pytest.raises(UsageError, match="repeats"):
        copy_bandwidth_bytes_per_s(16, repeats=0)


def test_copy_bandwidth_is_a_positive_rate() -> None:
    assert copy_bandwidth_bytes_per_s(1 << 12, repeats=1) > 0


def test_sustained_rates_start_each_window_when_told_and_count_its_work() -> None:
    starts: list[int] = []
    rates = sustained_rates(0.02, start=lambda: starts.append(1), n=1 << 12, size=32)
    assert len(starts) == 2  # one window for the copies, one for the products
    assert set(rates) == {"copy_bytes_per_s", "matmul_flops_per_s"} and min(rates.values()) > 0
    with pytest.raises(UsageError, match="window"):
        sustained_rates(0.0)


def test_benchmark_writes_one_row_per_kernel_with_its_bound(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("kernels_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.model_shapes = lambda name: SHAPES  # type: ignore[attr-defined]  # a tiny model: rows, not speed
    out = tmp_path / "k.json"
    assert mod.main(["--json", str(out), "--markdown", str(tmp_path / "k.md"), "--models", "resnet18",
                     "--compressors", "signum,fp16", "--worlds", "2,3", "--reps", "1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    kinds = {(r["compressor"], r["kernel"], r["world"]) for r in rows}
    assert kinds == {("signum", "encode", 2), ("signum", "feedback", 2), ("signum", "decode", 2),
                     ("signum", "decode", 3), ("fp16", "encode", 2), ("fp16", "decode", 2), ("fp16", "decode", 3)}
    for r in rows:
        assert {"compressor", "kernel", "model", "world", "ms", "bound_ms", "ratio_to_bound"} <= set(r)
        assert r["bound_ms"] > 0
    assert "| signum | decode | resnet18 | 3 |" in (tmp_path / "k.md").read_text()
    assert mod.main(["--compressors", "nope"]) == 2

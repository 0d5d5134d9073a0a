"""The fast CPU kernels of sign, cast and feedback give the old kernels' results bit for bit.

The references below are the torch-only kernels as they were before the CPU fast paths (they
are also what a CUDA tensor still runs): every fast path is compared with them on random data
with lengths that are not a multiple of 8, zeros, negative zeros, NaN and infinities.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tolerance import assert_close_eps
from lowcomm.compress import ErrorFeedback, MajoritySign, Momentum, ScaledSign, pack_signs, unpack_signs
from kernels_testlib import require_compiled
from lowcomm.compress import native
from lowcomm.compress.cast import CastCodec
from lowcomm.compress.codec import Layout, codec_class
from lowcomm.compress.feedback import finite_flag, keep_where_, poison_

SEGS = [[13], [5, 8, 1, 100], [3, 3, 3, 3, 3, 3, 3, 3, 3, 6]]


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def sign_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test twice: with the compiled lookups (numba) and with the numpy ones a machine
    without numba runs; both must give the reference's bits."""
    if request.param == "numpy":
        monkeypatch.setitem(native._LOADED, "signjit", None)
    else:
        require_compiled("signjit")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --- the reference (pre-fast-path) kernels ------------------------------------------------
def ref_pack(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    bits = (flat >= 0).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def ref_unpack(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bits = ((packed.reshape(-1, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:numel]
    return bits.to(dtype).mul_(2).sub_(1)


def ref_expand(scales: torch.Tensor, seg: list[int], dtype: torch.dtype) -> torch.Tensor:
    s = scales.to(dtype)
    return torch.cat([s[i].expand(n) for i, n in enumerate(seg)])


def ref_scales(x: torch.Tensor, seg: list[int]) -> torch.Tensor:
    return torch.stack([p.abs().mean() for p in x.split(seg)]).to(torch.float32)


def ref_decompress(payload: list[torch.Tensor], numel: int, dtype: torch.dtype, seg: list[int]) -> torch.Tensor:
    return ref_unpack(payload[0], numel, dtype).mul_(ref_expand(payload[1], seg, dtype))


def ref_mean(payloads: list[list[torch.Tensor]], numel: int, dtype: torch.dtype, seg: list[int]) -> torch.Tensor:
    out = ref_decompress(payloads[0], numel, dtype, seg).clone()
    for p in payloads[1:]:
        out.add_(ref_decompress(p, numel, dtype, seg))
    return out.div_(len(payloads))


def ref_majority(payloads: list[list[torch.Tensor]], numel: int, dtype: torch.dtype, seg: list[int]) -> torch.Tensor:
    votes = ref_unpack(payloads[0][0], numel, dtype)
    scales = payloads[0][1].clone()
    for p in payloads[1:]:
        votes.add_(ref_unpack(p[0], numel, dtype))
        scales.add_(p[1])
    scales.div_(len(payloads))
    return votes.sign_().mul_(ref_expand(scales, seg, dtype))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.isnan(), b.isnan())) and bool(
        torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))) and bool(
        torch.equal(a.signbit() | a.isnan(), b.signbit() | b.isnan()))


def tricky(n: int, seed: int, dtype: torch.dtype = torch.float32, *, nan: bool = False) -> torch.Tensor:
    """Random values with zeros, negative zeros (and a NaN and infinities when asked)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.1] = 0.0
    x[torch.rand(n, generator=g) < 0.1] = -0.0
    if nan and n > 3:
        x[1], x[2], x[3] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


# --- packing ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 1001])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_unpack_match_the_reference_bit_for_bit(n: int, dtype: torch.dtype) -> None:
    x = tricky(n, n, dtype, nan=True)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and torch.equal(packed, ref_pack(x))
    assert same(unpack_signs(packed, n, dtype), ref_unpack(packed, n, dtype))


def test_negative_zero_packs_as_plus_and_nan_as_minus() -> None:
    x = torch.tensor([-0.0, float("nan"), 0.0, -1.0, 1.0])
    assert unpack_signs(pack_signs(x), 5).tolist() == [1.0, -1.0, 1.0, -1.0, 1.0]


# --- decode, residual and aggregates ----------------------------------------------------------
@pytest.mark.parametrize("seg", SEGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_sign_decode_and_residual_match_the_reference(seg: list[int], dtype: torch.dtype) -> None:
    n = sum(seg)
    x = tricky(n, 1, dtype)
    comp = ScaledSign()
    payload, ctx = comp.compress(x, seg)
    assert torch.equal(payload[1], ref_scales(x, seg))
    assert same(comp.decompress(payload, ctx), ref_decompress(payload, n, dtype, seg))
    assert same(comp.residual(x, payload, ctx), x - ref_decompress(payload, n, dtype, seg))


def worker_payloads(comp: Any, seg: list[int], world: int, seed: int, dtype: torch.dtype = torch.float32) -> list[Any]:
    """The payloads ``world`` workers send: each compresses its own gradient (seed + rank)."""
    return [comp.compress(tricky(sum(seg), seed + w, dtype), seg)[0] for w in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4, 7, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_sign_mean_of_up_to_8_workers_is_bit_identical(world: int, dtype: torch.dtype) -> None:
    seg, comp = SEGS[1], ScaledSign()
    payloads = worker_payloads(comp, seg, world, 10, dtype)
    assert same(comp.aggregate(payloads, (sum(seg), dtype, seg)), ref_mean(payloads, sum(seg), dtype, seg))


@pytest.mark.parametrize("world", [9, 16])
def test_scaled_sign_mean_of_more_workers_differs_by_summation_order_only(world: int) -> None:
    seg, comp = SEGS[2], ScaledSign()
    payloads = worker_payloads(comp, seg, world, 20)
    got = comp.aggregate(payloads, (sum(seg), torch.float32, seg))
    # P terms added in another order: at most P - 1 roundings along the longest chain
    assert_close_eps(got, ref_mean(payloads, sum(seg), torch.float32, seg), ops=world - 1, msg=f"P={world}")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 16, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_majority_vote_matches_the_reference_bit_for_bit(world: int, dtype: torch.dtype) -> None:
    seg, comp = SEGS[1], MajoritySign()
    payloads = worker_payloads(comp, seg, world, 30, dtype)
    payloads[0][1][1] = float("nan")  # a non-finite scale poisons its segment as before
    assert same(comp.aggregate(payloads, (sum(seg), dtype, seg)), ref_majority(payloads, sum(seg), dtype, seg))


@pytest.mark.parametrize("world", [4, 63, 64])
def test_majority_vote_over_several_chunks_and_segments_across_them_is_bit_identical(world: int) -> None:
    """Segments that start and end inside the vote's chunks (of 8 * CHUNK_BYTES elements), a
    length that is not a whole number of bytes, and the largest world the int8 vote takes (and
    the first it leaves to the table)."""
    from lowcomm.compress import signbits

    chunk = 8 * signbits.CHUNK_BYTES
    seg = [chunk + 1, 5, chunk - 3, 7, 13]
    comp = MajoritySign()
    payloads = [comp.compress(tricky(sum(seg), 60 + w), seg)[0] for w in range(world)]
    payloads[1][1][3] = float("nan")
    ctx = (sum(seg), torch.float32, seg)
    expected = ref_majority(payloads, sum(seg), torch.float32, seg)
    assert same(comp.aggregate(payloads, ctx), expected)
    out = torch.full((sum(seg),), 7.0)
    comp.aggregate_out(payloads, ctx, out)
    assert same(out, expected)


# --- the state: error feedback and momentum -------------------------------------------------
def _layout(seg: list[int]) -> Layout:
    names = [f"p{i}" for i in range(len(seg))]
    return Layout.of(names, [(s,) for s in seg], {})


@pytest.mark.parametrize("finite_step", [True, False])
def test_error_feedback_memory_matches_the_reference_over_steps(finite_step: bool) -> None:
    seg = SEGS[1]
    n, layout = sum(seg), _layout(seg)
    ef = ErrorFeedback(ScaledSign())
    mem = torch.zeros(n)
    for step in range(3):
        g = tricky(n, 40 + step, nan=(step == 1 and not finite_step))
        finite = finite_flag(g)
        payload, _ = ef.compress(g, layout, finite)
        comp = g + mem
        expected_payload = [ref_pack(comp), ref_scales(comp, seg)]
        assert torch.equal(payload[0], expected_payload[0]) and same(payload[1], expected_payload[1])
        mem = torch.where(finite, comp - ref_decompress(expected_payload, n, torch.float32, seg), mem)
        assert same(ef.memory.get(layout.names, layout.sizes, g), mem)


def test_momentum_matches_the_reference_and_keeps_state_on_nonfinite_input() -> None:
    seg = SEGS[0]
    n, layout = sum(seg), _layout(seg)
    mo = Momentum(MajoritySign(), beta=0.9)
    m = torch.zeros(n)
    for step in range(3):
        g = tricky(n, 50 + step, nan=(step == 1))
        payload, _ = mo.compress(g, layout, finite_flag(g))
        new = m * 0.9
        new.add_(g, alpha=1.0 - 0.9)
        assert torch.equal(payload[0], ref_pack(new)) and same(payload[1], ref_scales(new, seg))
        if step != 1:
            m = new
        assert same(mo.memory.get(layout.names, layout.sizes, g), m)


def test_poison_and_keep_where_on_cpu_behave_as_the_branch_free_forms() -> None:
    t, bad = torch.randn(9), torch.zeros((), dtype=torch.bool)
    assert poison_(t.clone(), bad).isnan().all() and torch.equal(poison_(t.clone(), ~bad), t)
    dst, new = torch.randn(9), torch.randn(9)
    assert torch.equal(keep_where_(dst.clone(), bad, new), dst)
    assert torch.equal(keep_where_(dst.clone(), ~bad, new), new)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_finite_flag_sees_every_nonfinite_entry(dtype: torch.dtype) -> None:
    x = torch.randn(101).to(dtype)
    assert bool(finite_flag(x))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[57] = bad
        assert not bool(finite_flag(y))
    big = torch.full((8,), torch.finfo(dtype).max, dtype=dtype)  # finite, whatever its sum
    assert bool(finite_flag(big))


# --- cast -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("pad_to", [1, 8])
def test_cast_encode_matches_a_division_into_the_wire_dtype(name: str, pad_to: int) -> None:
    codec = codec_class(name)(world=4)
    assert isinstance(codec, CastCodec)
    x, layout = tricky(1001, 60, nan=False), _layout([1001])
    msg = codec.encode(x, layout, finite_flag(x), pad_to=pad_to)
    ref = torch.zeros(math.ceil(1001 / pad_to) * pad_to, dtype=codec.dtype)
    torch.div(x, 4, out=ref[:1001])
    assert same(msg.buf, ref)


def test_fp16_encode_poisons_a_value_that_overflows_only_after_the_cast() -> None:
    codec = codec_class("fp16")(world=4)
    x = tricky(1001, 61)
    x[5] = 70000.0 * 4  # finite in fp32, inf in fp16 after the division
    assert codec.encode(x, _layout([1001]), finite_flag(x)).buf.isnan().all()


# --- the device (torch-only) paths, run on the CPU with the fast paths switched off ----------
@pytest.mark.parametrize("name", ["signsgd", "signum", "fp16", "bf16"])
def test_codec_steps_are_the_same_with_and_without_the_cpu_fast_paths(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seg = SEGS[1]
    layout = _layout(seg)
    results = []
    for fast in ("1", "0"):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        codec = codec_class(name)(world=4).as_trained()
        outs = []
        for step in range(3):
            g = tricky(sum(seg), 70 + step, nan=(step == 1))
            finite = finite_flag(g)
            codec.accumulate(g, layout, finite)
            msg = codec.encode(g, layout, finite)
            received = msg.buf.unsqueeze(0).expand(4, -1).contiguous() if msg.collective == "all_gather" \
                else msg.buf * 4
            out = torch.empty(sum(seg))
            codec.decode(msg, received, out)
            outs += [msg.buf.clone(), out]
        results.append(outs)
    for a, b in zip(*results):
        assert same(a, b)


@pytest.mark.parametrize("world", [3, 8, 11])
def test_decoding_in_many_small_chunks_gives_the_same_result(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowcomm.compress import signbits

    monkeypatch.setattr(signbits, "CHUNK_BYTES", 3)  # 24 elements per chunk, a partial last one
    seg = SEGS[1]
    n = sum(seg)
    payloads = [ScaledSign().compress(tricky(n, 80 + w), seg)[0] for w in range(world)]
    ctx = (n, torch.float32, seg)
    assert same(MajoritySign().aggregate(payloads, ctx), ref_majority(payloads, n, torch.float32, seg))
    got = ScaledSign().aggregate(payloads, ctx)
    assert_close_eps(got, ref_mean(payloads, n, torch.float32, seg), ops=world - 1)
    if world <= 8:
        assert same(got, ref_mean(payloads, n, torch.float32, seg))

"""Payload axis (pure tensor math): packing, selection, error feedback, options, byte formulas."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tolerance import assert_close_eps
from lowcomm import hooks, methods
from lowcomm.compress import (
    ErrorFeedback,
    MajoritySign,
    Momentum,
    ScaledSign,
    TopK,
    fast_topk_indices,
    pack_payload,
    pack_signs,
    topk_indices,
    unpack_payload,
    unpack_signs,
)
from lowcomm.compress.base import payload_spec
from lowcomm.compress.cast import CastCompressor
from lowcomm.compress.codec import Layout
from lowcomm.compress.lowrank import orthogonalize, should_compress
from lowcomm.compress.topk import merge_sparse, num_selected
from lowcomm.errors import UsageError


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_sign_packing_round_trips_for_any_length(n: int) -> None:
    x = torch.randn(n)
    x[0] = 0.0  # zero is sent as +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    signs = unpack_signs(packed, n)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(signs, expected)


def test_sign_bits_are_little_endian_within_a_byte() -> None:
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 1])  # bits 0 and 7 set
    assert pack_signs(x).tolist() == [1 + 128]


def test_payload_packing_round_trips_mixed_dtypes_and_odd_offsets() -> None:
    parts = [torch.arange(5, dtype=torch.uint8), torch.randn(3), torch.arange(4, dtype=torch.int32)]
    buf = pack_payload(parts)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 + 12 + 16
    back = unpack_payload(buf, payload_spec(parts))
    for a, b in zip(parts, back):
        assert torch.equal(a, b)


def test_fast_topk_selects_exactly_the_topk_set() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300_000, generator=g)
    k = 300
    fast = fast_topk_indices(x, k, generator=torch.Generator().manual_seed(1))
    exact = topk_indices(x, k)
    assert fast.numel() == k
    assert set(fast.tolist()) == set(exact.tolist())


def test_fast_topk_retries_then_falls_back_when_sample_threshold_is_too_high() -> None:
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(2))
    k = 500
    exact = set(topk_indices(x, k).tolist())
    # oversample < 1 aims at fewer than k survivors: the first try must miss
    retried = fast_topk_indices(x, k, generator=torch.Generator().manual_seed(3), oversample=0.2)
    fallback = fast_topk_indices(x, k, generator=torch.Generator().manual_seed(3), oversample=0.2, max_tries=1)
    assert set(retried.tolist()) == exact
    assert set(fallback.tolist()) == exact


def test_topk_selects_per_tensor_so_bucket_layout_does_not_matter() -> None:
    a, b = torch.randn(100), torch.randn(50) * 10  # b would dominate a fused selection
    c = TopK(0.1)
    payload, _ = c.compress(torch.cat([a, b]), [100, 50])
    idx = payload[1].long()
    assert (idx < 100).sum() == num_selected(100, 0.1) and (idx >= 100).sum() == num_selected(50, 0.1)
    alone, _ = c.compress(a, [100])
    assert set(alone[1].tolist()) == set(idx[idx < 100].tolist())


def test_merge_sparse_sums_coinciding_indices_and_is_symmetric() -> None:
    va, ia = torch.tensor([1.0, -5.0, 2.0]), torch.tensor([0, 3, 7], dtype=torch.int32)
    vb, ib = torch.tensor([4.0, 0.5, -1.5]), torch.tensor([3, 5, 7], dtype=torch.int32)
    v, i = merge_sparse([va, vb], [ia, ib], 2)  # sums: {0: 1, 3: -1, 5: .5, 7: .5}
    assert i.tolist() == [0, 3]  # |1| tie between 0 and 3; both beat 0.5
    assert torch.equal(v, torch.tensor([1.0, -1.0]))  # small integers: exact in float32
    v2, i2 = merge_sparse([vb, va], [ib, ia], 2)
    assert torch.equal(i, i2) and torch.equal(v, v2)
    v3, i3 = merge_sparse([va, vb], [ia, ib], 3)
    # ties in magnitude are broken towards the smaller index
    assert i3.tolist() == [0, 3, 5]


def flat_layout(names: list[str], sizes: list[int]) -> Layout:
    """A layout of 1-D tensors (the wrappers only need names and sizes)."""
    return Layout.of(names, [(s,) for s in sizes], {})


def test_error_feedback_keeps_exactly_what_was_not_sent() -> None:
    ef = ErrorFeedback(TopK(0.1))
    names, sizes = ["w"], [200]
    layout = flat_layout(names, sizes)
    x1, x2 = torch.randn(200), torch.randn(200)
    p1, ctx = ef.compress(x1, layout)
    sent1 = ef.decompress(p1, ctx)
    mem1 = ef.memory.get(names, sizes, x1).clone()
    # Each entry is either sent whole or kept whole (memory = c - sent, one exact subtraction
    # of x or 0), so the split is exact: bit-for-bit, no tolerance.
    assert torch.equal(sent1 + mem1, x1)
    p2, ctx = ef.compress(x2, layout)
    sent2 = ef.decompress(p2, ctx)
    assert torch.equal(sent2 + ef.memory.get(names, sizes, x2), x2 + mem1)


def test_error_feedback_never_folds_nonfinite_input_and_its_payload_decodes_nonfinite() -> None:
    # The wrapper decides on the device (no warning here: that would need a host sync per
    # bucket; the step's single check after backward warns, see test_host_sync.py).
    ef = ErrorFeedback(ScaledSign())
    names, sizes = ["w"], [16]
    ef.compress(torch.randn(16), flat_layout(names, sizes))
    before = ef.memory.get(names, sizes, torch.zeros(16)).clone()
    bad = torch.randn(16)
    bad[3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning from inside the compressor
        payload, ctx = ef.compress(bad, flat_layout(names, sizes))
    assert torch.equal(ef.memory.get(names, sizes, bad), before)
    assert not torch.isfinite(ef.decompress(payload, ctx)).all()


def test_momentum_is_not_updated_by_nonfinite_input() -> None:
    mom = Momentum(MajoritySign(), beta=0.9)
    names, sizes = ["w"], [8]
    mom.compress(torch.ones(8), flat_layout(names, sizes))
    before = mom.memory.get(names, sizes, torch.zeros(8)).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided on the device, silently (no host sync)
        mom.compress(torch.full((8,), float("inf")), flat_layout(names, sizes))
    assert torch.equal(mom.memory.get(names, sizes, torch.zeros(8)), before)
    # 0.9 * 0 + (1 - 0.9) * 1: the float64 constant 1 - 0.9 rounded to float32, a multiply
    # and an add: 2 rounding steps
    assert_close_eps(before, torch.full((8,), 0.1), torch.float32, ops=2)


def test_param_store_keeps_state_per_name_across_bucket_layouts() -> None:
    ef = ErrorFeedback(TopK(0.5))
    x = torch.arange(1.0, 7.0)
    ef.compress(x, flat_layout(["a", "b"], [4, 2]))  # one bucket [a | b]
    mem = ef.memory.state_dict()
    assert set(mem) == {"a", "b"} and mem["a"].numel() == 4
    # DDP rebuilt its buckets: b alone, then a alone -- the memory follows the names
    got_b = ef.memory.get(["b"], [2], x)
    got_a = ef.memory.get(["a"], [4], x)
    assert torch.equal(got_a, mem["a"]) and torch.equal(got_b, mem["b"])


def test_scaled_sign_decodes_l1_scaled_signs_per_tensor() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5])
    c = ScaledSign()
    payload, ctx = c.compress(x, [2, 3])
    out = c.decompress(payload, ctx)
    # scale = mean |x| of each tensor: a sum of up to 3 terms and a division
    assert_close_eps(out, torch.tensor([2.0, -2.0, 1.5, -1.5, 1.5]), torch.float32, ops=3)


def test_majority_vote_follows_the_majority_and_mean_scale() -> None:
    c = MajoritySign()
    xs = [torch.tensor([1.0, -1.0]), torch.tensor([2.0, -2.0]), torch.tensor([-3.0, 3.0])]
    payloads, ctx = zip(*[c.compress(x) for x in xs])
    out = c.aggregate(list(payloads), ctx[0])
    # vote (+,-), mean |x| = 2: a mean over 2 entries per worker and over 3 workers
    assert_close_eps(out, torch.tensor([2.0, -2.0]), torch.float32, ops=2 + 3)


def test_cast_rounds_to_half_precision() -> None:
    x = torch.randn(100)
    c = CastCompressor(torch.bfloat16)
    payload, ctx = c.compress(x)
    assert payload[0].dtype == torch.bfloat16
    assert torch.equal(c.decompress(payload, ctx), x.to(torch.bfloat16).float())


def test_payload_bytes_match_the_documented_formulas() -> None:
    assert CastCompressor(torch.float16).payload_bytes(1000, torch.float32) == 2000
    assert ScaledSign().payload_bytes(1001, torch.float32, num_tensors=3) == 126 + 12
    assert TopK(0.01).payload_bytes(1001, torch.float32) == 11 * 8
    payload, _ = ScaledSign().compress(torch.randn(1001), [500, 500, 1])
    assert pack_payload(payload).numel() == ScaledSign().payload_bytes(1001, torch.float32, 3)


def test_low_rank_helpers_compress_only_worthwhile_matrices_and_orthonormalize() -> None:
    assert not should_compress((100,), 4, 2.0)
    assert should_compress((64, 64), 4, 2.0)
    assert not should_compress((4, 16), 2, 2.0)
    q = orthogonalize(torch.randn(3, 20, 4))
    eye = torch.eye(4).expand(3, 4, 4)
    # Householder QR gives |Q^T Q - I| <= gamma_{m n} (Higham Thm 19.4), m x n = 20 x 4
    assert_close_eps(q.transpose(1, 2) @ q, eye, torch.float32, ops=20 * 4)
    z = orthogonalize(torch.zeros(10, 2))
    assert torch.isfinite(z).all()


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("powersgd:rank=0", "rank must be an integer >= 1"),
        ("acpsgd:rank=-2", "rank must be an integer >= 1"),
        ("topk:density=0", "density must be in (0, 1]"),
        ("gtopk:density=1.5", "density must be in (0, 1]"),
        ("topk:start_iter=-1", "start_iter must be an integer >= 0"),
        ("signum:momentum=1", "momentum must be in [0, 1)"),
        ("powersgd:rnak=4", "valid: rank, start_iter"),
        ("topk:density=abc", "must be a float"),
        ("powersdg", "did you mean 'powersgd'"),
    ],
)
def test_bad_method_options_are_refused_with_what_is_valid(spec: str, needle: str) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(spec)
    assert needle in str(e.value)


def test_hooks_register_refuses_unknown_method_and_option() -> None:
    with pytest.raises(UsageError, match="valid: acpsgd, bf16"):
        hooks.options_for("sparsify")
    with pytest.raises(UsageError, match="valid: clip, density"):
        hooks.options_for("topk", rank=3)


def test_hooks_register_accepts_a_spec_string_and_keywords_win() -> None:
    class FakeDDP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.hook: object = None

        def register_comm_hook(self, state: object, hook: object) -> None:
            self.hook = (state, hook)

    import torch.distributed as dist

    from lowcomm.testing.distributed import free_port

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ddp = FakeDDP()
        state = hooks.register(ddp, "topk:density=0.2,start_iter=3", start_iter=5)
        assert state.options.density == 0.2 and state.options.start_iter == 5
        assert ddp.hook is not None and ddp.hook[0] is state
    finally:
        if mine:
            dist.destroy_process_group()


def test_every_compression_method_is_in_the_method_namespace() -> None:
    """Every registered codec (and ssgd) is a ``--method`` with its codec's default options."""
    import dataclasses

    from lowcomm.compress.codec import CODECS, codec_class

    assert CODECS.names()  # the registry did discover the compressor modules
    for name in ["ssgd", *CODECS.names()]:
        assert name in methods.names()
    for name in CODECS.names():
        assert methods.create(name).options == codec_class(name).Options(), name
        assert dataclasses.asdict(hooks.options_for(name)) == dataclasses.asdict(codec_class(name).Options()), name
    assert methods.create("acpsgd").options.rank == 4
    assert methods.create("topk").options.density == 0.01
    assert methods.create("powersgd").options.start_iter == "min(1.5ep,10%)"
    assert methods.create("signsgd").options.error_feedback is True


def test_docs_have_one_paragraph_per_registered_codec() -> None:
    """docs/compression.md: a ``### <name>`` heading and paragraph for every codec."""
    from pathlib import Path

    from lowcomm.compress.codec import CODECS

    text = (Path(__file__).resolve().parents[1] / "docs" / "compression.md").read_text()
    for name in CODECS.names():
        head = f"\n### {name}\n"
        assert head in text, f"docs/compression.md lacks a '### {name}' paragraph"
        assert text.split(head, 1)[1].strip(), name


def test_the_table_of_original_references_holds_only_registered_methods() -> None:
    """tests/compress_testlib.py's REFERENCES is not a list of what needs a reference (that
    is read from the registry); it must not keep a removed codec nor shadow a module's."""
    import compress_testlib

    assert compress_testlib.table_problems() == []
    assert not compress_testlib.has_reference("no_such_codec")

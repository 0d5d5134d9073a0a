"""Low-rank layers: exact at full rank, better with more rank, gradients flow, bad input."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.lowrank import (
    LowRankConv,
    LowRankLinear,
    LowRankLSTM,
    LowRankMultiheadAttention,
    factorize,
    factorized_ranks,
)
from lowcomm.lowrank.layers import svd_factors
from tolerance import assert_close_eps, tolerance

torch.manual_seed(0)


class Tiny(nn.Module):
    """Every layer type factorize() handles, plus ones it must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, stride=2, padding=1, dilation=1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.conv1d = nn.Conv1d(16, 12, 3, padding=2, dilation=2)
        self.lstm = nn.LSTM(12, 10, num_layers=2, batch_first=True)
        self.attn = nn.MultiheadAttention(10, 2, batch_first=True)
        self.fc = nn.Linear(10, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.depthwise(torch.relu(self.conv(x)))  # (B,16,4,4)
        h = self.conv1d(h.flatten(2))  # (B,12,16)
        h, _ = self.lstm(h.transpose(1, 2))  # (B,16,10)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.fc(h.mean(1))


# Tolerances (tests/tolerance.py): at full rank a factorized layer computes x B^T A^T with the
# float64 SVD factors rounded to float32, where the dense layer computes x W^T. Along the
# forward chain each dense dot product of length k and each factor product of rank r adds at
# most k (resp. r) rounding steps, so ops = the sum of (k + r) over the layers on the path,
# once per time step for recurrent layers. Measured differences are 1-3 eps.


def _full(model: nn.Module) -> nn.Module:
    return factorize(model, rank_ratio=1.0, full_rank=[], require_savings=False, inplace=False)


def test_full_rank_reproduces_every_layer_type_to_float_precision() -> None:
    model = Tiny().eval()
    x = torch.randn(2, 3, 8, 8)
    ref = model(x)
    fact = _full(model)
    kinds = {type(m) for m in fact.modules()}
    assert {LowRankConv, LowRankLSTM, LowRankMultiheadAttention} <= kinds
    assert isinstance(fact.fc, LowRankLinear)
    assert isinstance(fact.depthwise, nn.Conv2d), "grouped convs must stay dense"
    # conv 3*3*3 + r 16; conv1d 16*3 + r 12; LSTM 2 layers x 16 steps x (ih 12 + r 12, hh 10 + r 10);
    # attention in-proj 10 + r 10, scores 5, softmax 16, values 16, out-proj 10 + r 10; mean 16;
    # fc 10 + r 7 (the depthwise conv stays dense on both sides: same arithmetic)
    ops = (27 + 16) + (48 + 12) + 2 * 16 * (24 + 20) + (20 + 5 + 16 + 16 + 20) + 16 + (10 + 7)
    assert_close_eps(fact(x), ref, torch.float32, ops=ops)


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: nn.Linear(20, 30), torch.randn(4, 5, 20)),
        (lambda: nn.Conv2d(6, 8, 3, stride=2, padding=1), torch.randn(2, 6, 9, 9)),
        (lambda: nn.Conv1d(6, 8, 5, padding=2), torch.randn(2, 6, 11)),
    ],
)
@torch.no_grad()
def test_reconstruction_error_decreases_with_rank_and_vanishes_at_full_rank(make, x) -> None:  # type: ignore[no-untyped-def]
    dense = make()
    ref = dense(x)
    errors = []
    full = min(dense.weight.shape[0], dense.weight[0].numel())
    tol = tolerance(torch.float32, ops=dense.weight[0].numel() + full)  # k + r, see above
    for r in range(1, full + 1):
        cls = LowRankLinear if isinstance(dense, nn.Linear) else LowRankConv
        lr = cls.from_dense(dense, r)
        errors.append(float((lr(x) - ref).norm() / ref.norm()))
    assert all(b <= a + tol for a, b in zip(errors, errors[1:])), errors  # up to round-off
    assert errors[0] > 0.05 and errors[-1] <= tol


def test_svd_factors_are_truncated_svd_with_split_singular_values() -> None:
    w = torch.randn(12, 7, dtype=torch.float64)
    a, b = svd_factors(w, 3)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    best = (u[:, :3] * s[:3]) @ vh[:3]
    # float64 throughout; (U Σ^½)(Σ^½ V^T) vs (U Σ) V^T: a square root, two products, rank 3
    assert_close_eps(a @ b, best, ops=3 + 3)  # Eckart-Young optimum
    # column / row norms of 12 / 7 entries, both Σ^½ times a unit vector
    assert_close_eps(a.norm(dim=0), b.norm(dim=1), ops=12 + 2)  # Σ^½ on both sides


def test_lstm_per_gate_factorization_matches_nn_lstm_and_counts_params() -> None:
    lstm = nn.LSTM(8, 6, num_layers=2, batch_first=False)
    x = torch.randn(5, 3, 8)
    h0 = (torch.randn(2, 3, 6), torch.randn(2, 3, 6))
    low = LowRankLSTM(lstm, LowRankLSTM.full_ranks(lstm))
    out, (h, c) = low(x, h0)
    ref, (rh, rc) = lstm(x, h0)
    ops = 2 * 5 * ((8 + 6) + (6 + 6))  # 2 layers x 5 steps x (ih k 8 + r 6, hh k 6 + r 6)
    assert_close_eps(out, ref, torch.float32, ops=ops)
    assert_close_eps(h, rh, torch.float32, ops=ops)
    assert_close_eps(c, rc, torch.float32, ops=ops)
    small = LowRankLSTM(lstm, [(2, 2), (2, 2)])
    # per gate r*(in+h): layer0 ih 4*2*(8+6), hh 4*2*(6+6); layer1 both 4*2*12; biases 2*2*24
    assert sum(p.numel() for p in small.parameters()) == 4 * 2 * 14 + 3 * 4 * 2 * 12 + 4 * 24


def test_attention_matches_nn_multihead_attention_with_masks_and_weights() -> None:
    for batch_first in (True, False):
        mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, bias=True).eval()
        holder = nn.Module()
        holder.attn = mha
        low = factorize(holder, rank_ratio=1.0, full_rank=[], require_savings=False, inplace=False).attn
        assert isinstance(low, LowRankMultiheadAttention)
        q = torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)
        kv = torch.randn(2, 7, 16) if batch_first else torch.randn(7, 2, 16)
        causal = torch.ones(5, 7, dtype=torch.bool).triu(3)
        kpm = torch.zeros(2, 7, dtype=torch.bool)
        kpm[1, -2:] = True
        for kwargs in (
            {},
            {"attn_mask": causal},
            {"key_padding_mask": kpm, "need_weights": False},
            {"attn_mask": causal, "key_padding_mask": kpm, "average_attn_weights": False},
        ):
            ref = mha(q, kv, kv, **kwargs)
            got = low(q, kv, kv, **kwargs)
            # in-proj 16 + r 16, scores 4 (head dim), softmax 7, values 7, out-proj 16 + r 16,
            # head average 4
            assert_close_eps(got[0], ref[0], torch.float32, ops=32 + 4 + 7 + 7 + 32, msg=kwargs)
            if ref[1] is not None:
                assert_close_eps(got[1], ref[1], torch.float32, ops=32 + 4 + 7 + 4, msg=kwargs)


def test_transformer_encoder_layer_works_after_factorizing() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 32)
    ref = enc(x)
    fact = _full(enc)
    assert isinstance(fact.layers[0].self_attn, LowRankMultiheadAttention)
    assert isinstance(fact.layers[0].linear1, LowRankLinear)
    # per layer: attention in-proj 32 + r 32, scores 8, softmax 6, values 6, out-proj 32 + r 32,
    # two LayerNorms over 32, linear1 32 + r 32, linear2 64 + r 32; 2 layers
    assert_close_eps(fact(x), ref, torch.float32, ops=2 * (64 + 8 + 6 + 6 + 64 + 2 * 2 * 32 + 64 + 96))
    with torch.no_grad():  # inference fast path must be skipped, not crash
        fact(x, src_key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))


def test_gradients_flow_to_every_factor() -> None:
    model = factorize(Tiny(), rank_ratio=0.5, full_rank=[])
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_factorize_only_where_params_drop_and_keeps_tied_weights() -> None:
    # (no forward here: only which layers get replaced)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(100, 100), nn.Linear(100, 50))
    emb = nn.Embedding(50, 100)
    model[3].weight = emb.weight  # tied: (50 x 100) shared
    model.emb = emb
    factorize(model, rank_ratio=0.25, full_rank=[], inplace=True)
    assert isinstance(model[0], nn.Linear)  # rank 1: 1*(2+2) params is not fewer than 2*2
    assert isinstance(model[2], LowRankLinear) and model[2].rank == 25
    assert isinstance(model[3], nn.Linear), "tied weights must never be factorized"
    assert factorized_ranks(model) == {"2": 25}


def test_full_rank_regex_and_names_select_dense_layers() -> None:
    model = Tiny()
    fact = factorize(model, rank_ratio=0.5, full_rank=r"lstm|fc", inplace=False)
    assert isinstance(fact.lstm, nn.LSTM) and isinstance(fact.fc, nn.Linear)
    assert isinstance(fact.conv, LowRankConv)
    fact2 = factorize(model, rank_ratio=0.25, full_rank=["conv", "attn"], inplace=False)
    assert isinstance(fact2.conv, nn.Conv2d) and isinstance(fact2.attn, nn.MultiheadAttention)
    assert isinstance(fact2.lstm, LowRankLSTM)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_rank_ratio_outside_unit_interval_is_refused(ratio: float) -> None:
    with pytest.raises(UsageError, match="rank_ratio"):
        factorize(Tiny(), rank_ratio=ratio)


def test_full_rank_that_matches_nothing_is_refused() -> None:
    with pytest.raises(UsageError, match="matches no module"):
        factorize(Tiny(), full_rank=r"layer9")
    with pytest.raises(UsageError, match="match no module"):
        factorize(Tiny(), full_rank=["fc", "nope"])
    with pytest.raises(UsageError, match="invalid"):
        factorize(Tiny(), full_rank="(")


def test_model_with_nothing_to_factorize_warns_and_is_unchanged() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Embedding(10, 4))
    with pytest.warns(UserWarning, match="nothing to factorize"):
        out = factorize(model)
    assert isinstance(out[0], nn.Linear)


def test_explicit_ranks_rebuild_the_same_structure() -> None:
    model = Tiny()
    fact = factorize(model, rank_ratio=0.5, full_rank=[], inplace=False)
    ranks = factorized_ranks(fact)
    again = factorize(Tiny(), full_rank=[], ranks=ranks)
    assert factorized_ranks(again) == ranks
    again.load_state_dict(fact.state_dict())  # same parameter names and shapes
    with pytest.raises(UsageError, match="rank"):
        factorize(Tiny(), full_rank=[], ranks={"fc": 999})


def test_extra_bn_inserts_batchnorm_between_factors() -> None:
    model = factorize(Tiny(), rank_ratio=0.5, full_rank=[], extra_bn=True)
    assert isinstance(model.conv.bn, nn.BatchNorm2d) and isinstance(model.fc.bn, nn.BatchNorm1d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(3, 3, 8, 8)).sum().backward()


def test_factorize_returns_a_copy_and_leaves_the_original_model_unchanged() -> None:
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    small = factorize(model, rank_ratio=0.5, full_rank=[])
    assert small is not model
    assert any(isinstance(m, LowRankLinear) for m in small.modules())
    assert [type(m) for m in model.modules()] == kinds  # no layer of the original replaced
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert not {id(p) for p in small.parameters()} & {id(p) for p in model.parameters()}


def test_factorize_inplace_rewrites_the_given_model() -> None:
    model = Tiny()
    out = factorize(model, rank_ratio=0.5, full_rank=[], inplace=True)
    assert out is model and isinstance(model.fc, LowRankLinear)

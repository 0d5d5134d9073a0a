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
    torch.testing.assert_close(fact(x), ref, rtol=1e-5, atol=1e-5)


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
    for r in range(1, full + 1):
        cls = LowRankLinear if isinstance(dense, nn.Linear) else LowRankConv
        lr = cls.from_dense(dense, r)
        errors.append(float((lr(x) - ref).norm() / ref.norm()))
    assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.05 and errors[-1] < 1e-5


def test_svd_factors_are_truncated_svd_with_split_singular_values() -> None:
    w = torch.randn(12, 7, dtype=torch.float64)
    a, b = svd_factors(w, 3)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    best = (u[:, :3] * s[:3]) @ vh[:3]
    torch.testing.assert_close(a @ b, best)  # Eckart-Young optimum
    torch.testing.assert_close(a.norm(dim=0), b.norm(dim=1))  # Σ^½ on both sides


def test_lstm_per_gate_factorization_matches_nn_lstm_and_counts_params() -> None:
    lstm = nn.LSTM(8, 6, num_layers=2, batch_first=False)
    x = torch.randn(5, 3, 8)
    h0 = (torch.randn(2, 3, 6), torch.randn(2, 3, 6))
    low = LowRankLSTM(lstm, LowRankLSTM.full_ranks(lstm))
    out, (h, c) = low(x, h0)
    ref, (rh, rc) = lstm(x, h0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, rh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c, rc, rtol=1e-5, atol=1e-5)
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
            torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
            if ref[1] is not None:
                torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_transformer_encoder_layer_works_after_factorizing() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 32)
    ref = enc(x)
    fact = _full(enc)
    assert isinstance(fact.layers[0].self_attn, LowRankMultiheadAttention)
    assert isinstance(fact.layers[0].linear1, LowRankLinear)
    torch.testing.assert_close(fact(x), ref, rtol=1e-5, atol=1e-5)
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
    factorize(model, rank_ratio=0.25, full_rank=[])
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

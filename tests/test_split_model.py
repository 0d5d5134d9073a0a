"""The cut: edge then cloud computes the unsplit (factorized) model, forward and backward; the
SVD factorization is exact at full rank and optimal below it; bad splits are refused.

All in one process on a tiny random BERT (tests/split_testlib.py); the link is replaced by
what it does to autograd: the cloud gets a detached leaf and the edge backprops its gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.split.bert import attention_mask_bias
from lowcomm.split.model import CloudModel, EdgeModel, SplitModel
from lowcomm.split.factorize import SplitLinear, check_rank, factorize_linear, truncation_error
from split_testlib import CLASSES, FFN, HIDDEN, LAYERS, tiny_batch, tiny_classifier
from tolerance import assert_close_eps

SPLITS = [  # (compress, keep_residual)
    pytest.param(True, False, id="compressed"),
    pytest.param(True, True, id="compressed-keep-residual"),
    pytest.param(False, False, id="uncompressed"),
]


def _through_link(edge: EdgeModel, cloud: CloudModel, ids: torch.Tensor, mask: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """One split training step's autograd, with the tensors handed over directly."""
    out = edge(ids, mask)
    sent = list(out) if isinstance(out, tuple) else [out]
    received = [t.detach().requires_grad_() for t in sent]
    logits = cloud(received, mask)
    F.cross_entropy(logits, labels).backward()
    torch.autograd.backward(sent, [r.grad for r in received])
    return logits


@pytest.mark.parametrize("split_layer", [2, LAYERS])  # a middle layer; the last (the authors' placement)
@pytest.mark.parametrize("compress,keep_residual", SPLITS)
def test_edge_then_cloud_is_the_unsplit_model_forward_and_backward(compress: bool, keep_residual: bool,
                                                                   split_layer: int) -> None:
    model = tiny_classifier()
    kw = dict(split_layer=split_layer, rank=6, keep_residual=keep_residual, compress=compress)
    edge, cloud, whole = SplitModel.edge(model, **kw), SplitModel.cloud(model, **kw), SplitModel.unsplit(model, **kw)
    ids, mask, labels = tiny_batch()

    logits = _through_link(edge, cloud, ids, mask, labels)
    expected = whole(ids, mask)
    F.cross_entropy(expected, labels).backward()

    # same operations in the same order, except that with the residual kept the attention
    # output's gradient is a sum of two paths accumulated in either order, then carried back
    # through dot products of up to FFN = 64 terms: ops = FFN
    assert_close_eps(logits, expected, ops=FFN, msg="logits")
    grads = {**{n: p.grad for n, p in edge.named_parameters()}, **{n: p.grad for n, p in cloud.named_parameters()}}
    reference = dict(whole.named_parameters())
    assert set(grads) == set(reference)  # every parameter lives on exactly one side, same name
    for name, g in grads.items():
        assert g is not None, name
        assert_close_eps(g, reference[name].grad, ops=FFN, msg=name)


@pytest.mark.parametrize("compress,keep_residual", SPLITS)
def test_the_two_halves_state_dicts_merge_into_the_unsplit_model(compress: bool, keep_residual: bool) -> None:
    model = tiny_classifier()
    kw = dict(split_layer=1, rank=5, keep_residual=keep_residual, compress=compress)
    edge_sd, cloud_sd = SplitModel.edge(model, **kw).state_dict(), SplitModel.cloud(model, **kw).state_dict()
    whole = SplitModel.unsplit(model, **kw)
    assert not set(edge_sd) & set(cloud_sd)
    assert set(edge_sd) | set(cloud_sd) == set(whole.state_dict())
    fresh = SplitModel.unsplit(tiny_classifier(seed=7), **kw)
    fresh.load_state_dict({**edge_sd, **cloud_sd})
    ids, mask, _ = tiny_batch()
    assert torch.equal(fresh(ids, mask), whole(ids, mask))


def test_what_crosses_the_link_follows_rank_residual_and_compression() -> None:
    model = tiny_classifier()
    ids, mask, _ = tiny_batch(batch=3, seq=7)
    z = SplitModel.edge(model, split_layer=2, rank=4)(ids, mask)
    assert isinstance(z, torch.Tensor) and z.shape == (3, 7, 4)
    z, a = SplitModel.edge(model, split_layer=2, rank=4, keep_residual=True)(ids, mask)
    assert z.shape == (3, 7, 4) and a.shape == (3, 7, HIDDEN)
    full = SplitModel.edge(model, split_layer=2, compress=False)(ids, mask)
    assert isinstance(full, torch.Tensor) and full.shape == (3, 7, HIDDEN)
    # uncompressed, the edge's output is the original model's layer-2 output
    enc = model.encoder
    assert torch.equal(full, enc.run_layers(enc.embed(ids), attention_mask_bias(mask, torch.float32), 0, 2))
    # the residual matters: with and without it the model computes different functions
    kept = SplitModel.unsplit(model, split_layer=2, rank=4, keep_residual=True)(ids, mask)
    dropped = SplitModel.unsplit(model, split_layer=2, rank=4)(ids, mask)
    assert not torch.allclose(kept, dropped)


def test_uncompressed_split_is_the_original_model() -> None:
    model = tiny_classifier()
    ids, mask, _ = tiny_batch()
    edge = SplitModel.edge(model, split_layer=1, compress=False)
    cloud = SplitModel.cloud(model, split_layer=1, compress=False)
    assert torch.equal(cloud(edge(ids, mask), mask), model(ids, mask))


def test_building_the_parts_leaves_the_callers_model_untouched() -> None:
    model = tiny_classifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    SplitModel.edge(model, split_layer=1, rank=3)
    SplitModel.cloud(model, split_layer=1, rank=3, keep_residual=True)
    SplitModel.unsplit(model, split_layer=1, rank=3)
    assert type(model.encoder.layers[0].output.dense) is nn.Linear
    assert model.encoder.layers[0].output.keep_residual
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_full_rank_factorization_equals_the_dense_layer() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(FFN, HIDDEN)
    layer = SplitLinear.from_dense(dense, HIDDEN)  # full rank: below the refused boundary on purpose
    assert isinstance(layer, SplitLinear)
    assert layer.first.weight.shape == (HIDDEN, FFN) and layer.first.bias is None
    assert layer.second.weight.shape == (HIDDEN, HIDDEN) and torch.equal(layer.second.bias, dense.bias)
    x = torch.randn(5, FFN)
    # the factors are float64 SVD factors rounded to float32 (one rounding each), multiplied
    # through r = 32 then in = 64 terms: ops = 2 + HIDDEN + FFN
    assert_close_eps(layer.second.weight @ layer.first.weight, dense.weight, ops=2 + HIDDEN)
    assert_close_eps(layer(x), dense(x), ops=2 + HIDDEN + FFN)


def test_truncated_factorization_is_the_best_rank_r_approximation() -> None:
    torch.manual_seed(1)
    dense = nn.Linear(FFN, HIDDEN)
    w = dense.weight.detach().double()
    s = torch.linalg.svdvals(w)
    for r in (1, 4, 16):
        layer = factorize_linear(dense, r)
        approx = (layer.second.weight @ layer.first.weight).detach().double()
        # Eckart-Young: the Frobenius error of the best rank-r matrix is the tail of the spectrum
        err = float(torch.linalg.matrix_norm(w - approx) / torch.linalg.matrix_norm(w))
        tail = float(s[r:].square().sum().sqrt() / s.square().sum().sqrt())
        assert abs(err - tail) <= 1e-5 and abs(truncation_error(dense.weight, r) - tail) <= 1e-12
        assert layer.first.weight.requires_grad and layer.second.weight.requires_grad


@pytest.mark.parametrize("split_layer", [0, LAYERS + 1, -1, 1.5, True, "2"])
def test_split_layer_out_of_range_is_refused_naming_the_range(split_layer: object) -> None:
    with pytest.raises(UsageError, match=f"split layer must be an integer from 1 to {LAYERS}"):
        SplitModel.edge(tiny_classifier(), split_layer=split_layer, rank=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [0, -3, HIDDEN, HIDDEN + 1, 2.0, None])
def test_rank_out_of_range_is_refused_naming_the_range(rank: object) -> None:
    with pytest.raises(UsageError, match=f"rank must be an integer from 1 to {HIDDEN - 1}"):
        SplitModel.cloud(tiny_classifier(), split_layer=1, rank=rank)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=f"from 1 to {HIDDEN - 1}"):
        check_rank(rank, FFN, HIDDEN)


def test_other_bad_options_are_refused_with_what_is_valid() -> None:
    model = tiny_classifier()
    with pytest.raises(UsageError, match="role must be one of edge, cloud"):
        SplitModel(model, split_layer=1, rank=4, role="server")
    with pytest.raises(UsageError, match="valid: fp32, fp16, bf16"):
        SplitModel(model, split_layer=1, rank=4, role="edge", wire="fp8")
    with pytest.raises(UsageError, match="compressed split only"):
        SplitModel.edge(model, split_layer=1, compress=False, keep_residual=True)
    with pytest.raises(UsageError, match="BertClassifier"):
        SplitModel.edge(nn.Linear(3, 3), split_layer=1, rank=1)
    with pytest.raises(UsageError, match="at least 2"):
        SplitModel.edge(tiny_classifier(layers=1), split_layer=1, rank=1)


def test_split_model_sides_hold_only_their_own_parameters() -> None:
    model = tiny_classifier()
    edge = SplitModel(model, split_layer=2, rank=4, role="edge", wire="bf16")
    cloud = SplitModel(model, split_layer=2, rank=4, role="cloud", wire="bf16")
    assert edge.role == "edge" and cloud.role == "cloud"
    n_edge = sum(p.numel() for p in edge.parameters())
    n_cloud = sum(p.numel() for p in cloud.parameters())
    whole = SplitModel.unsplit(model, split_layer=2, rank=4)
    assert n_edge + n_cloud == sum(p.numel() for p in whole.parameters())
    assert cloud.part.head.out_features == CLASSES

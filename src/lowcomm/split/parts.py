"""The edge part and the cloud part of a BERT classifier cut at a split layer (the modules).

:func:`plan` checks a split; :func:`factorized_copy` is the whole model with layer K's FFN output
matrix factorized (the unsplit baseline); :class:`EdgeModel` / :class:`CloudModel` carve that
copy into the two halves. Each half holds its modules under the names they have in the unsplit
model (small holder modules such as ``output.dense.v`` exist only for that), so the halves'
state dicts are disjoint and merge into the unsplit model's. :mod:`lowcomm.split.model` says
what crosses the link and why; this module only builds and runs the halves.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

from torch import Tensor, nn

from lowcomm.errors import UsageError
from lowcomm.split.bert import (
    BertAttention,
    BertClassifier,
    BertEmbeddings,
    BertFFNOutput,
    BertLayer,
    attention_mask_bias,
    mean_pool,
)
from lowcomm.split.factorize import SplitLinear, check_rank, factorize_linear

__all__ = ["CloudModel", "EdgeModel", "SplitPlan", "factorized_copy", "plan"]


@dataclass(frozen=True)
class SplitPlan:
    """Where a model is cut and what crosses the link (validated by :func:`plan`)."""

    split_layer: int  #: K: the edge runs layers 1..K (K's FFN output matrix factorized)
    rank: int | None  #: r (None without compression)
    keep_residual: bool
    compress: bool
    hidden_size: int

    @property
    def widths(self) -> list[int]:
        """Last-dimension widths of the tensors that cross edge -> cloud, in order."""
        if not self.compress:
            return [self.hidden_size]
        assert self.rank is not None
        return [self.rank, self.hidden_size] if self.keep_residual else [self.rank]


def check_split_layer(split_layer: object, layers: int, *, what: str = "split layer", model: str = "") -> None:
    """UsageError unless ``split_layer`` is an integer from 1 to ``layers`` (the one rule, for
    the CLI's check before any process starts and for :func:`plan`)."""
    if not isinstance(split_layer, int) or isinstance(split_layer, bool) or not 1 <= split_layer <= layers:
        of = f" for {model!r}" if model else ""
        raise UsageError(f"{what} must be an integer from 1 to {layers}{of} (the edge runs layers 1..K, "
                         f"the cloud the rest, the pooling and the head), got {split_layer!r}")


def plan(model: nn.Module, *, split_layer: int, rank: int | None, keep_residual: bool = False,
         compress: bool = True) -> SplitPlan:
    """Check a split of ``model``; every bad value -> UsageError naming the valid range."""
    if not isinstance(model, BertClassifier):
        raise UsageError("a split needs a lowcomm.split.bert.BertClassifier (build one with "
                         f"lowcomm.split.checkpoint), got {type(model).__name__}")
    n = len(model.encoder.layers)
    if n < 2:
        raise UsageError(f"the model has {n} layer(s); a split needs at least 2 (one per side)")
    check_split_layer(split_layer, n)
    cfg = model.encoder.config
    if compress:
        check_rank(rank, cfg.intermediate_size, cfg.hidden_size)
    elif keep_residual:
        raise UsageError("keep_residual applies to the compressed split only (without compression "
                         "the edge sends layer K's whole output, residual included)")
    return SplitPlan(split_layer, rank if compress else None, bool(keep_residual), bool(compress),
                     cfg.hidden_size)


def _layer(model: BertClassifier, index: int) -> BertLayer:
    """Layer ``index + 1`` (0-based ``index``) of ``model``, typed."""
    layer = model.encoder.layers[index]
    assert isinstance(layer, BertLayer)
    return layer


# -- the parts: small modules whose attribute names repeat the unsplit model's -----------------


class _EdgeFactor(nn.Module):
    """Holds the edge's SVD factor under the name it has in :class:`SplitLinear` (``v``)."""

    def __init__(self, v: nn.Linear) -> None:
        super().__init__()
        self.v = v


class _EdgeFFNOutput(nn.Module):
    """The edge's share of layer K's :class:`BertFFNOutput`: only ``dense.v``."""

    def __init__(self, v: nn.Linear) -> None:
        super().__init__()
        self.dense = _EdgeFactor(v)


class _EdgeSplitLayer(nn.Module):
    """Layer K on the edge: attention block, FFN intermediate activation, first factor."""

    def __init__(self, attention: BertAttention, intermediate: nn.Linear, act: nn.Module, v: nn.Linear,
                 keep_residual: bool) -> None:
        super().__init__()
        self.attention = attention
        self.intermediate = intermediate
        self.act = act
        self.output = _EdgeFFNOutput(v)
        self.keep_residual = keep_residual

    def forward(self, x: Tensor, mask_bias: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        a = self.attention(x, mask_bias)
        z = self.output.dense.v(self.act(self.intermediate(a)))
        return (z, a) if self.keep_residual else z


class _SecondFactor(nn.Module):
    """The cloud's SVD factor (r -> H, with the bias) under its :class:`SplitLinear` name ``u``."""

    def __init__(self, u: nn.Linear) -> None:
        super().__init__()
        self.u = u

    def forward(self, z: Tensor) -> Tensor:
        return self.u(z)


class _CloudSplitLayer(nn.Module):
    """Layer K on the cloud: ``output`` (second factor, dropout, LayerNorm [+ residual])."""

    def __init__(self, output: BertFFNOutput) -> None:
        super().__init__()
        self.output = output

    def forward(self, z: Tensor, residual: Tensor | None = None) -> Tensor:
        return self.output(z, residual)


class _EdgeEncoder(nn.Module):
    def __init__(self, embeddings: BertEmbeddings, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.layers = layers


class _CloudEncoder(nn.Module):
    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.layers = layers


class EdgeModel(nn.Module):
    """The edge part: ``forward(input_ids, attention_mask) ->`` what crosses the link.

    Compressed: ``z`` (B, T, r), or ``(z, a)`` with ``a`` (B, T, H) when the residual is kept;
    uncompressed: layer K's output (B, T, H).
    """

    def __init__(self, model: BertClassifier, split: SplitPlan) -> None:
        super().__init__()
        self.plan = split
        enc, k = model.encoder, split.split_layer
        layers = nn.ModuleDict({str(i): enc.layers[i] for i in range(k)})
        if split.compress:
            layer = _layer(model, k - 1)
            dense = layer.output.dense
            assert isinstance(dense, SplitLinear)
            layers[str(k - 1)] = _EdgeSplitLayer(layer.attention, layer.intermediate, layer.act,
                                                 dense.first, split.keep_residual)
        self.encoder = _EdgeEncoder(enc.embeddings, layers)

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                token_type_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Embeddings and layers 1..K (K: up to the first factor when compressed)."""
        if attention_mask.shape != input_ids.shape:
            raise UsageError(f"attention_mask shape {tuple(attention_mask.shape)} differs from "
                             f"input_ids shape {tuple(input_ids.shape)}")
        x = self.encoder.embeddings(input_ids, token_type_ids)
        bias = attention_mask_bias(attention_mask, x.dtype)
        out: Tensor | tuple[Tensor, Tensor] = x
        for layer in self.encoder.layers.values():
            out = layer(out, bias)
        return out


class CloudModel(nn.Module):
    """The cloud part: ``forward(link_tensors, attention_mask) -> logits`` (B, classes)."""

    def __init__(self, model: BertClassifier, split: SplitPlan) -> None:
        super().__init__()
        self.plan = split
        enc, k = model.encoder, split.split_layer
        layers = nn.ModuleDict()
        if split.compress:
            output = _layer(model, k - 1).output
            dense = output.dense
            assert isinstance(dense, SplitLinear)
            output.dense = _SecondFactor(dense.second)
            layers[str(k - 1)] = _CloudSplitLayer(output)  # first: it takes the link tensors
        for i in range(k, len(enc.layers)):
            layers[str(i)] = enc.layers[i]
        self.encoder = _CloudEncoder(layers)
        self.dropout = model.dropout
        self.head = model.head

    def forward(self, link_tensors: Tensor | Sequence[Tensor], attention_mask: Tensor) -> Tensor:
        """Layer K's rest (compressed), layers K+1..N, pooling and head; the mask is the edge's."""
        tensors = [link_tensors] if isinstance(link_tensors, Tensor) else list(link_tensors)
        widths = [t.shape[-1] for t in tensors]
        if widths != self.plan.widths:
            raise UsageError(f"the cloud part expects link tensors of widths {self.plan.widths}, "
                             f"got {widths}")
        layers = list(self.encoder.layers.values())
        if self.plan.compress:
            x = layers[0](*tensors)
            layers = layers[1:]
        else:
            x = tensors[0]
        bias = attention_mask_bias(attention_mask, x.dtype)
        for layer in layers:
            x = layer(x, bias)
        return self.head(self.dropout(mean_pool(x, attention_mask)))


def factorized_copy(model: BertClassifier, split: SplitPlan) -> BertClassifier:
    """A deep copy of ``model`` with layer K's FFN output matrix factorized and the residual
    choice applied (untouched without compression)."""
    whole = copy.deepcopy(model)
    if split.compress:
        assert split.rank is not None
        output = _layer(whole, split.split_layer - 1).output
        dense = output.dense
        if not isinstance(dense, nn.Linear):
            raise UsageError(f"layer {split.split_layer}'s FFN output is already {type(dense).__name__}, "
                             "not a dense nn.Linear: split the original model")
        output.dense = factorize_linear(dense, split.rank)
        output.keep_residual = split.keep_residual
    return whole

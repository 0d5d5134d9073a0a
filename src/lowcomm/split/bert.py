"""A small BERT encoder whose parameters line up one-to-one with Hugging Face's ``BertModel``.

Why our own and not ``transformers``: split fine-tuning needs to cut the model *inside* a
layer (between the FFN's intermediate activation and its output matrix, Shi et al.), to
replace that output matrix with two SVD factors and to drop the residual around it. Those
pieces are attributes here (:class:`BertLayer` ``.attention``, ``.intermediate``, ``.act``,
``.output``), so :mod:`lowcomm.split.model` can run the edge and the cloud halves without
patching a library's forward. The numerics follow BERT exactly (post-LN layers, exact erf
GELU, additive attention mask, LayerNorm eps from the config), so a real checkpoint loaded
by :mod:`lowcomm.split.checkpoint` computes what it was trained to compute.

Layers are post-LN as in BERT: ``x = LN(x + Attn(x)); x = LN(x + W_out act(W_in x))``.
:class:`BertFFNOutput` has the ``keep_residual`` switch: ``False`` computes
``LN(W_out h)`` without the ``+ x``, the "link elimination" at the split layer, so nothing
full-width has to cross from edge to cloud.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowcomm.errors import UsageError, check_count, check_range

#: activation names of HF configs (``hidden_act``) that we implement, and their modules
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass
class BertConfig:
    """The sizes of a BERT encoder, named as in HF ``config.json`` (so one dict serves both)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            check_count(f"config {name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"config hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UsageError(f"config hidden_act {self.hidden_act!r} is not supported; "
                             f"valid: {', '.join(ACTIVATIONS)}")
        check_range("config layer_norm_eps", self.layer_norm_eps, 0.0, 1.0, low_open=True)
        check_range("config hidden_dropout_prob", self.hidden_dropout_prob, 0.0, 1.0, high_open=True)
        check_range("config attention_probs_dropout_prob", self.attention_probs_dropout_prob,
                    0.0, 1.0, high_open=True)
        check_range("config initializer_range", self.initializer_range, 0.0, 1.0, low_open=True)
        check_count("config pad_token_id", self.pad_token_id, minimum=0, maximum=self.vocab_size - 1)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> BertConfig:
        """Read a HF ``config.json`` dict; keys we do not use (``architectures``, ...) are
        ignored, but a config that is not BERT's architecture is refused: its weights would
        load into the wrong places or not at all."""
        if not isinstance(raw, dict):
            raise UsageError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "bert")
        if model_type != "bert":
            raise UsageError(f"{source}: model_type {model_type!r} is not a BERT encoder; "
                             "valid: 'bert' (BERT, MiniLM and other BertModel checkpoints)")
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise UsageError(f"{source}: position_embedding_type {position_type!r} is not "
                             "supported; valid: 'absolute'")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        missing = [k for k in required if k not in raw]
        if missing:
            raise UsageError(f"{source}: missing {', '.join(missing)} (a BERT config.json has "
                             f"{', '.join(required)})")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known and v is not None}
        try:
            return cls(**kwargs)
        except UsageError as e:
            raise UsageError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The HF-named dict (``config.json`` form) of these sizes."""
        return {"model_type": "bert", **asdict(self)}


def activation(name: str) -> nn.Module:
    """HF's ``hidden_act``: ``gelu`` is the exact (erf) GELU that BERT and MiniLM use."""
    if name == "gelu":
        return nn.GELU()
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    raise UsageError(f"activation {name!r} is not supported; valid: {', '.join(ACTIVATIONS)}")


def attention_mask_bias(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, T)`` 1/0 mask -> ``(B, 1, 1, T)`` additive bias: 0 where attended, the dtype's
    most negative finite value at padding (finite, so a row never becomes NaN)."""
    if attention_mask.dim() != 2:
        raise UsageError(f"attention_mask must be (batch, length), got shape "
                         f"{tuple(attention_mask.shape)}")
    keep = attention_mask.to(dtype)[:, None, None, :]
    return (1.0 - keep) * torch.finfo(dtype).min


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the token vectors over the attended positions (sentence-transformers' pooling
    for all-MiniLM-L6-v2): padding must not dilute a short sentence's embedding."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.max_positions = config.max_position_embeddings
        self.word_embeddings = nn.Embedding(config.vocab_size, h, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """``(B, T)`` ids (token types default to 0, one sentence) -> ``(B, T, H)``."""
        length = input_ids.shape[1]
        if length > self.max_positions:
            raise UsageError(f"sequence length {length} exceeds the model's "
                             f"max_position_embeddings ({self.max_positions}); use a max length "
                             f"<= {self.max_positions}")
        positions = torch.arange(length, device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.norm(x))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product attention (``F.scaled_dot_product_attention``) with
    separate Q/K/V projections, as BERT's checkpoints store them."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.dropout_p = config.attention_probs_dropout_prob
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, mask_bias: Tensor | None) -> Tensor:
        """``(B, T, H)`` -> ``(B, T, H)``; ``mask_bias`` from :func:`attention_mask_bias`."""
        b, t, h = x.shape
        out = F.scaled_dot_product_attention(
            self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x)),
            attn_mask=mask_bias, dropout_p=self.dropout_p if self.training else 0.0,
        )
        return out.transpose(1, 2).reshape(b, t, h)


class BertAttention(nn.Module):
    """Self-attention, output projection, dropout, then ``LayerNorm(. + x)``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = BertSelfAttention(config)
        self.dense = nn.Linear(h, h)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.norm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, mask_bias: Tensor | None) -> Tensor:
        """The attention block's output (the residual of the FFN that follows)."""
        return self.norm(self.dropout(self.dense(self.self_attn(x, mask_bias))) + x)


class BertFFNOutput(nn.Module):
    """The FFN's second half: ``LayerNorm(dropout(dense(h)) + residual)``.

    ``dense`` is any module mapping the intermediate width to the hidden width, so the split
    layer can hold a factorized (two-matrix) one. ``keep_residual=False`` drops the
    ``+ residual`` (Shi et al.'s link elimination): the layer's output then depends on ``h``
    alone, which is what lets only a rank-r projection of ``h`` cross the link.
    """

    def __init__(self, intermediate_size: int, hidden_size: int, *, eps: float = 1e-12,
                 dropout: float = 0.1, keep_residual: bool = True) -> None:
        super().__init__()
        self.dense: nn.Module = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.keep_residual = keep_residual

    def forward(self, h_intermediate: Tensor, residual: Tensor | None = None) -> Tensor:
        """``(B, T, I)`` intermediate (+ ``(B, T, H)`` residual) -> ``(B, T, H)``."""
        y = self.dropout(self.dense(h_intermediate))
        if self.keep_residual:
            if residual is None:
                raise UsageError("BertFFNOutput with keep_residual=True needs the residual "
                                 "tensor (the attention block's output)")
            y = y + residual
        return self.norm(y)


class BertLayer(nn.Module):
    """One post-LN encoder layer: attention block, then ``act(intermediate(.))`` and output.

    The two halves are separate methods (:meth:`ffn_hidden`) so a split can stop after the
    intermediate activation and resume at ``output`` on the other machine.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)
        self.output = BertFFNOutput(config.intermediate_size, config.hidden_size,
                                    eps=config.layer_norm_eps, dropout=config.hidden_dropout_prob)

    def ffn_hidden(self, a: Tensor) -> Tensor:
        """The FFN's intermediate activation ``act(W_in a + b_in)``, (B, T, I)."""
        return self.act(self.intermediate(a))

    def forward(self, x: Tensor, mask_bias: Tensor | None) -> Tensor:
        """``(B, T, H)`` -> ``(B, T, H)``."""
        a = self.attention(x, mask_bias)
        return self.output(self.ffn_hidden(a), a)


def init_bert_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT's initialization (normal(0, std) weights, zero biases, unit LayerNorms, a zero
    padding row): what a model without a checkpoint, and the new classifier head, start from."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BertEncoder(nn.Module):
    """Embeddings and ``num_hidden_layers`` layers, pooler-free: ``(B, T) -> (B, T, H)``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        init_bert_weights(self, config.initializer_range)

    def embed(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """The embedding layer's output, (B, T, H)."""
        return self.embeddings(input_ids, token_type_ids)

    def run_layers(self, x: Tensor, mask_bias: Tensor | None, start: int = 0,
                   stop: int | None = None) -> Tensor:
        """Layers ``start .. stop-1`` (0-based, as ``self.layers[start:stop]``) on ``x``."""
        for layer in self.layers[start:stop]:
            x = layer(x, mask_bias)
        return x

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """``(B, T)`` ids and 1/0 mask (default: all attended) -> ``(B, T, H)``."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise UsageError(f"attention_mask shape {tuple(attention_mask.shape)} differs from "
                             f"input_ids shape {tuple(input_ids.shape)}")
        x = self.embed(input_ids, token_type_ids)
        return self.run_layers(x, attention_mask_bias(attention_mask, x.dtype))


class BertClassifier(nn.Module):
    """Encoder, mean pooling over the mask, dropout and a linear head: ``-> (B, classes)``.

    Mean pooling rather than BERT's [CLS] pooler because all-MiniLM-L6-v2 was trained as a
    sentence encoder with mean pooling (it ships no pooler weights that were trained).
    """

    def __init__(self, config: BertConfig, num_classes: int, *, dropout: float = 0.1) -> None:
        super().__init__()
        check_count("num_classes", num_classes, minimum=2)
        check_range("dropout", dropout, 0.0, 1.0, high_open=True)
        self.encoder = BertEncoder(config)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(config.hidden_size, num_classes)
        init_bert_weights(self.head, config.initializer_range)

    def classify(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits from the last layer's token vectors: pooling, dropout, head."""
        return self.head(self.dropout(mean_pool(hidden, attention_mask)))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """``(B, T)`` ids and 1/0 mask -> ``(B, num_classes)`` logits."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.classify(self.encoder(input_ids, attention_mask, token_type_ids),
                             attention_mask)

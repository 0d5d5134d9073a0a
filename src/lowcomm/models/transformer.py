"""Transformers: an encoder-decoder (``transformer``) and a decoder-only LM (``transformer_lm``).

Attention is ``nn.MultiheadAttention`` and the FFN plain ``nn.Linear`` layers, so the
low-rank converter can swap attention for a factorized equivalent and factorize the FFN.

``transformer`` matches Pufferfish's Transformer (from jadore801120's
attention-is-all-you-need-pytorch): Q/K/V/O projections **without bias**, FFN with bias, one
LayerNorm per sub-layer plus one for the encoder and one for the decoder stack. With 6+6
layers, d_model 512, FFN 2048 that is **44,103,680** non-embedding parameters
(:func:`lowcomm.models.non_embedding_parameters`):

* encoder layer: attention 4 x 512² = 1,048,576; FFN 2 x 512 x 2048 + 2048 + 512 =
  2,099,712; 2 LayerNorms 2,048 -> 3,150,336, x 6 = 18,902,016;
* decoder layer: 2 attentions 2,097,152; FFN 2,099,712; 3 LayerNorms 3,072 -> 4,199,936,
  x 6 = 25,199,616;
* ``encoder.norm`` + ``decoder.norm``: 2,048.

Embeddings: one table shared by source, target and the output projection (Pufferfish's
"+512V"); positions are sinusoidal (no parameters). Layers are pre-LN by default
(``norm_first=True``: stable without long LR warm-up; the stack norms are the final norms);
``norm_first=False`` gives the original post-LN layout, where the stack norm is applied to
the embeddings as in jadore's code. Both have the same parameter count.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lowcomm.models import ModelInfo, register_model


def sinusoidal_positions(length: int, dim: int, *, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``(length, dim)`` sine/cosine position table of Vaswani et al."""
    pos = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32)
                    * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device, dtype=torch.float32)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div[: dim // 2])
    return table.to(dtype)


def causal_mask(length: int, device: torch.device) -> Tensor:
    """Boolean ``(T, T)`` mask, True where attention is forbidden (future positions)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)


class EncoderLayer(nn.Module):
    """Self-attention + FFN, each with residual, dropout and LayerNorm."""

    def __init__(self, d_model: int, nhead: int, dim_ff: int, dropout: float, *,
                 attn_bias: bool, norm_first: bool) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, bias=attn_bias,
                                               batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_ff)
        self.linear2 = nn.Linear(dim_ff, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = nn.ReLU()

    def _sa(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.dropout(self.self_attn(x, x, x, attn_mask=mask, need_weights=False)[0])

    def _ff(self, x: Tensor) -> Tensor:
        return self.dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        if self.norm_first:
            x = x + self._sa(self.norm1(x), mask)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, mask))
        return self.norm2(x + self._ff(x))


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, FFN."""

    def __init__(self, d_model: int, nhead: int, dim_ff: int, dropout: float, *,
                 attn_bias: bool, norm_first: bool) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, bias=attn_bias,
                                               batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, bias=attn_bias,
                                                batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_ff)
        self.linear2 = nn.Linear(dim_ff, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = nn.ReLU()

    def _sa(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.dropout(self.self_attn(x, x, x, attn_mask=mask, need_weights=False)[0])

    def _ca(self, x: Tensor, memory: Tensor) -> Tensor:
        return self.dropout(self.cross_attn(x, memory, memory, need_weights=False)[0])

    def _ff(self, x: Tensor) -> Tensor:
        return self.dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        if self.norm_first:
            x = x + self._sa(self.norm1(x), mask)
            x = x + self._ca(self.norm2(x), memory)
            return x + self._ff(self.norm3(x))
        x = self.norm1(x + self._sa(x, mask))
        x = self.norm2(x + self._ca(x, memory))
        return self.norm3(x + self._ff(x))


class _Stack(nn.Module):
    """``layers`` plus the stack's own LayerNorm ``norm`` (final norm when pre-LN)."""

    def __init__(self, layers: list[nn.Module], d_model: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(d_model)


class Transformer(nn.Module):
    """Encoder-decoder; ``forward(src (B,S), tgt (B,T) | None) -> logits (B, T, V)``.

    ``tgt`` is the decoder *input* (already shifted right by the caller). With ``tgt=None``
    the model runs the copy task: the decoder reads ``src`` shifted right (``bos_id`` first)
    under a causal mask, so position t predicts ``src[:, t]`` -> logits ``(B, S, V)``.
    """

    output_projection_name = "lm_head"

    def __init__(self, *, vocab_size: int, d_model: int, nhead: int, num_encoder_layers: int,
                 num_decoder_layers: int, dim_feedforward: int, dropout: float,
                 norm_first: bool, bos_id: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.norm_first = norm_first
        self.bos_id = bos_id
        self.embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model ** -0.5)
        self.drop = nn.Dropout(dropout)
        kw = dict(attn_bias=False, norm_first=norm_first)
        self.encoder = _Stack([EncoderLayer(d_model, nhead, dim_feedforward, dropout, **kw)
                               for _ in range(num_encoder_layers)], d_model)
        self.decoder = _Stack([DecoderLayer(d_model, nhead, dim_feedforward, dropout, **kw)
                               for _ in range(num_decoder_layers)], d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight

    def _embed(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens) * math.sqrt(self.d_model)
        pos = sinusoidal_positions(tokens.shape[1], self.d_model, device=x.device, dtype=x.dtype)
        return self.drop(x + pos)

    def encode(self, src: Tensor) -> Tensor:
        """Encoder stack over the source tokens (the memory the decoder attends to)."""
        x = self._embed(src)
        if not self.norm_first:
            x = self.encoder.norm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.encoder.norm(x) if self.norm_first else x

    def decode(self, tgt: Tensor, memory: Tensor) -> Tensor:
        """Decoder stack over the target tokens, causally masked, attending to ``memory``."""
        x = self._embed(tgt)
        if not self.norm_first:
            x = self.decoder.norm(x)
        mask = causal_mask(tgt.shape[1], tgt.device)
        for layer in self.decoder.layers:
            x = layer(x, memory, mask)
        return self.decoder.norm(x) if self.norm_first else x

    def forward(self, src: Tensor, tgt: Tensor | None = None) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        if tgt is None:
            bos = torch.full_like(src[:, :1], self.bos_id)
            tgt = torch.cat([bos, src[:, :-1]], dim=1)
        return self.lm_head(self.decode(tgt, self.encode(src)))


class Block(nn.Module):
    """Pre-LN GPT block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d_model: int, nhead: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, 4 * d_model)
        self.linear2 = nn.Linear(4 * d_model, d_model)
        self.activation = nn.GELU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        h = self.norm1(x)
        x = x + self.dropout(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self.dropout(self.linear2(self.activation(self.linear1(self.norm2(x)))))


class TransformerLM(nn.Module):
    """Decoder-only causal LM; ``forward(tokens (B, T)) -> logits (B, T, V)``, T <= max_len."""

    output_projection_name = "lm_head"

    def __init__(self, *, vocab_size: int, d_model: int, nhead: int, num_layers: int,
                 max_len: int, dropout: float) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, nhead, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        for m in self.modules():  # GPT-2 initialization
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
        mask = causal_mask(t, tokens.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.norm(x))


@register_model("transformer", info=ModelInfo(
    "language_model", (64,), default_vocab_size=32000, lm_target="input",
    description="encoder-decoder Transformer 6+6, d512 (Pufferfish); copy task if tgt is None"))
def transformer(
    *,
    vocab_size: int = 32000,
    d_model: int = 512,
    nhead: int = 8,
    num_encoder_layers: int = 6,
    num_decoder_layers: int = 6,
    dim_feedforward: int = 2048,
    dropout: float = 0.1,
    norm_first: bool = True,
    bos_id: int = 0,
) -> Transformer:
    """Registry entry: the encoder-decoder Transformer (Pufferfish's WMT16 model, smaller defaults)."""
    return Transformer(vocab_size=vocab_size, d_model=d_model, nhead=nhead,
                       num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers,
                       dim_feedforward=dim_feedforward, dropout=dropout, norm_first=norm_first,
                       bos_id=bos_id)


@register_model("transformer_lm", info=ModelInfo(
    "language_model", (128,), default_vocab_size=33278,
    description="decoder-only causal Transformer LM (4 layers, d256)"))
def transformer_lm(
    *,
    vocab_size: int = 33278,
    d_model: int = 256,
    nhead: int = 4,
    num_layers: int = 4,
    max_len: int = 256,
    dropout: float = 0.1,
) -> TransformerLM:
    """Registry entry: a decoder-only Transformer language model."""
    return TransformerLM(vocab_size=vocab_size, d_model=d_model, nhead=nhead,
                         num_layers=num_layers, max_len=max_len, dropout=dropout)

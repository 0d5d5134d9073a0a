"""Multi-head attention whose Q, K, V and output projections may each be low-rank."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.lowrank.svd import copy_bias


class LowRankMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` with separate Q, K, V and output projections, each of which
    may be a :class:`LowRankLinear` (or a plain ``nn.Linear`` if factorizing it does not pay).

    Same call signature and masking rules as ``nn.MultiheadAttention`` (boolean masks mean
    "not allowed", float masks are added; ``is_causal`` is a hint that needs ``attn_mask``),
    so transformer blocks need no change. It exposes ``in_proj_bias = None`` and
    ``_qkv_same_embed_dim = False`` so PyTorch's fused inference fast path (which reads the
    packed weights) is skipped for the blocks that hold it.
    """

    in_proj_weight = None
    in_proj_bias = None
    bias_k = None
    bias_v = None
    add_zero_attn = False
    _qkv_same_embed_dim = False

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        out_proj: nn.Module,
        dropout: float = 0.0,
        batch_first: bool = False,
    ) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first = dropout, batch_first
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj

    @staticmethod
    def dense_projections(mha: nn.MultiheadAttention) -> dict[str, nn.Linear]:
        """The four projections of ``mha`` as separate ``nn.Linear`` layers (copies)."""
        e = mha.embed_dim
        dev, dt = mha.out_proj.weight.device, mha.out_proj.weight.dtype
        if mha._qkv_same_embed_dim:
            weights = list(mha.in_proj_weight.chunk(3))
        else:
            weights = [mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight]
        biases = list(mha.in_proj_bias.chunk(3)) if mha.in_proj_bias is not None else [None] * 3
        out: dict[str, nn.Linear] = {}
        for name, wt, b in zip(("q", "k", "v"), weights, biases):
            lin = nn.Linear(wt.shape[1], e, bias=b is not None, device=dev, dtype=dt)
            with torch.no_grad():
                lin.weight.copy_(wt)
                copy_bias(lin.bias, b)
            out[name] = lin
        o = nn.Linear(e, e, bias=mha.out_proj.bias is not None, device=dev, dtype=dt)
        with torch.no_grad():
            o.weight.copy_(mha.out_proj.weight)
            copy_bias(o.bias, mha.out_proj.bias)
        out["out"] = o
        return out

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention``'s call: ``(output, attention weights or None)``."""
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        tgt_len, bsz, _ = query.shape
        src_len = key.shape[0]
        heads, hd = self.num_heads, self.head_dim

        def split(t: torch.Tensor, length: int) -> torch.Tensor:  # (L, B, E) -> (B, H, L, hd)
            return t.reshape(length, bsz, heads, hd).permute(1, 2, 0, 3)

        q = split(self.q_proj(query), tgt_len)
        k = split(self.k_proj(key), src_len)
        v = split(self.v_proj(value), src_len)

        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        mask = _float_mask(attn_mask, query.dtype)
        if mask is not None and mask.dim() == 3:  # (B*H, L, S)
            mask = mask.reshape(bsz, heads, tgt_len, src_len)
        kpm = _float_mask(key_padding_mask, query.dtype)
        if kpm is not None:
            kpm = kpm.reshape(bsz, 1, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        dropout_p = self.dropout if self.training else 0.0

        weights = None
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / hd), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            attn = torch.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                attn = F.dropout(attn, p=dropout_p)
            ctx = torch.matmul(attn, v)
            weights = attn.mean(dim=1) if average_attn_weights else attn
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        ctx = ctx.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim)
        out = self.out_proj(ctx)
        if not batched:
            return out.squeeze(1), (weights.squeeze(0) if weights is not None else None)
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask ("not allowed") as the additive float mask attention kernels take."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise TypeError("only bool and floating attention masks are supported")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))

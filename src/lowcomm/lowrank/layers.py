"""Low-rank drop-in replacements for Linear, Conv1d/2d, LSTM and MultiheadAttention.

Each layer stores a weight ``W`` (out x in) as two factors ``W ≈ U·Vᵀ`` with rank ``r``:
the *first* factor ``v`` maps the input to ``r`` features (``Σ^½·Vᵀ``) and the *second*
factor ``u`` maps them to the outputs (``U·Σ^½``), following Pufferfish. Gradients of a
factorized layer are ``r·(in+out)`` numbers instead of ``in·out``, so every later all-reduce is
smaller with no compression step. ``from_dense`` constructors initialize the factors from a
trained dense layer by truncated SVD; at full rank they reproduce the dense layer's output to
float precision. An optional BatchNorm between the factors (``extra_bn``) is what Cuttlefish
uses; it breaks that exactness, so it is off by default.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def svd_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of a 2-D ``weight`` (out x in) -> ``(U·Σ^½ [out x r], Σ^½·Vᵀ [r x in])``.

    Computed on the CPU in float64 so that every data-parallel rank, given identical weights,
    gets bit-identical factors (LAPACK on one machine is deterministic; GPU SVD need not be).
    """
    if weight.device.type == "meta":  # shape-only models (counting parameters / MACs)
        return (
            torch.empty(weight.shape[0], rank, device="meta", dtype=weight.dtype),
            torch.empty(rank, weight.shape[1], device="meta", dtype=weight.dtype),
        )
    w = weight.detach().to(device="cpu", dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:rank].sqrt()
    first = u[:, :rank] * root  # out x r
    second = root[:, None] * vh[:rank]  # r x in
    return (
        first.to(device=weight.device, dtype=weight.dtype),
        second.to(device=weight.device, dtype=weight.dtype),
    )


def _bn_over_features(bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """BatchNorm1d over the last dimension of an input with any number of leading dims."""
    if x.dim() == 2:
        return bn(x)
    shape = x.shape
    return bn(x.reshape(-1, shape[-1])).reshape(shape)


class LowRankLinear(nn.Module):
    """``Linear(in, r, bias=False)`` then ``Linear(r, out)`` (Pufferfish's factorized FC).

    With ``blocks=g > 1`` the output is ``g`` independent blocks of ``out/g`` rows (the four
    gates of an LSTM matrix), each factorized at rank ``r``: the ``g`` first factors are one
    stacked ``Linear(in, g·r)`` and the second factors a ``(g, out/g, r)`` tensor applied with
    one batched matmul — no Python loop over blocks.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        bias: bool = True,
        blocks: int = 1,
        extra_bn: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if out_features % blocks:
            raise ValueError(f"out_features={out_features} is not divisible into {blocks} blocks")
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.rank, self.blocks = in_features, out_features, rank, blocks
        self.v = nn.Linear(in_features, blocks * rank, bias=False, **kw)
        self.bn = nn.BatchNorm1d(blocks * rank, **kw) if extra_bn else None
        if blocks == 1:
            self.u = nn.Linear(rank, out_features, bias=bias, **kw)
        else:
            self.u_blocks = nn.Parameter(torch.empty(blocks, out_features // blocks, rank, **kw))
            self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
            self._init_blocks()

    @torch.no_grad()
    def _init_blocks(self) -> None:
        """Initialize each block as ``nn.Linear(rank, out/blocks)`` would be initialized.

        A directly constructed layer must never hold ``torch.empty`` garbage (NaN or huge
        values would train, or poison a gradient all-reduce, silently); ``from_dense``
        overwrites these values with the SVD factors anyway.
        """
        for g in range(self.blocks):
            nn.init.kaiming_uniform_(self.u_blocks[g], a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.rank)
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_dense(
        cls, dense: nn.Linear, rank: int, *, blocks: int = 1, extra_bn: bool = False
    ) -> "LowRankLinear":
        w = dense.weight
        layer = cls(
            dense.in_features,
            dense.out_features,
            rank,
            bias=dense.bias is not None,
            blocks=blocks,
            extra_bn=extra_bn,
            device=w.device,
            dtype=w.dtype,
        )
        rows = dense.out_features // blocks
        # One SVD per block at conversion time (not per step).
        pairs = [svd_factors(w[g * rows : (g + 1) * rows], rank) for g in range(blocks)]
        with torch.no_grad():
            layer.v.weight.copy_(torch.cat([second for _, second in pairs]))
            if blocks == 1:
                layer.u.weight.copy_(pairs[0][0])
                if dense.bias is not None:
                    layer.u.bias.copy_(dense.bias)
            else:
                layer.u_blocks.copy_(torch.stack([first for first, _ in pairs]))
                if dense.bias is not None:
                    layer.bias.copy_(dense.bias)
        layer.train(dense.training)
        return layer

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block ``(A [out/g x r], B [r x in])`` with block weight ``A·B`` (no extra_bn)."""
        vs = self.v.weight.reshape(self.blocks, self.rank, self.in_features)
        if self.blocks == 1:
            return [(self.u.weight, self.v.weight)]
        return [(self.u_blocks[g], vs[g]) for g in range(self.blocks)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.v(x)
        if self.bn is not None:
            h = _bn_over_features(self.bn, h)
        if self.blocks == 1:
            return self.u(h)
        lead = h.shape[:-1]
        h = h.reshape(-1, self.blocks, self.rank).transpose(0, 1)  # (g, N, r)
        out = torch.bmm(h, self.u_blocks.transpose(1, 2))  # (g, N, out/g)
        out = out.transpose(0, 1).reshape(*lead, self.out_features)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        blocks = f", blocks={self.blocks}" if self.blocks > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}{blocks}"


_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}


class LowRankConv(nn.Module):
    """k×k conv to ``r`` channels (same stride/padding/dilation) then a 1×1 conv to ``out``."""

    def __init__(self, conv: nn.Conv1d | nn.Conv2d, rank: int, *, extra_bn: bool = False) -> None:
        super().__init__()
        if conv.groups != 1:
            raise ValueError("grouped convolutions are not factorized")
        cls = type(conv)
        dims = len(conv.kernel_size)
        w = conv.weight
        kw = {"device": w.device, "dtype": w.dtype}
        self.in_channels, self.out_channels, self.rank = conv.in_channels, conv.out_channels, rank
        self.v = cls(
            conv.in_channels,
            rank,
            conv.kernel_size,  # type: ignore[arg-type]
            stride=conv.stride,  # type: ignore[arg-type]
            padding=conv.padding,  # type: ignore[arg-type]
            dilation=conv.dilation,  # type: ignore[arg-type]
            bias=False,
            padding_mode=conv.padding_mode,
            **kw,
        )
        self.bn = _BN[dims](rank, **kw) if extra_bn else None
        self.u = cls(rank, conv.out_channels, 1, bias=conv.bias is not None, **kw)

    @classmethod
    def from_dense(cls, conv: nn.Conv1d | nn.Conv2d, rank: int, *, extra_bn: bool = False) -> "LowRankConv":
        layer = cls(conv, rank, extra_bn=extra_bn)
        w = conv.weight
        first, second = svd_factors(w.reshape(w.shape[0], -1), rank)
        with torch.no_grad():
            layer.u.weight.copy_(first.reshape(layer.u.weight.shape))
            layer.v.weight.copy_(second.reshape(layer.v.weight.shape))
            if conv.bias is not None:
                layer.u.bias.copy_(conv.bias)
        layer.train(conv.training)
        return layer

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(A [out x r], B [r x in·k·k])]`` with the flattened kernel ``A·B``."""
        return [(self.u.weight.reshape(self.out_channels, self.rank), self.v.weight.reshape(self.rank, -1))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.v(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.u(h)

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, out_channels={self.out_channels}, rank={self.rank}"


class LowRankLSTM(nn.Module):
    """An ``nn.LSTM`` whose four gate matrices (input->hidden and hidden->hidden, every layer)
    are each factorized at rank ``r`` — Pufferfish's per-gate scheme, which reproduces its
    85,962,278 -> 67,962,278 parameter counts.

    The gates are batched: the four ``Σ^½Vᵀ`` factors of a matrix are stacked into one
    ``(4r x in)`` weight (one GEMM) and the four ``UΣ^½`` factors form a ``(4, h, r)`` tensor
    applied with one batched matmul, so there is no Python loop over gates. The input
    projections of all time steps are computed at once; only the recurrence loops over time.
    Unidirectional, ``proj_size=0``, tensor inputs (no PackedSequence).
    """

    def __init__(self, lstm: nn.LSTM, ranks: list[tuple[int, int]]) -> None:
        super().__init__()
        if lstm.bidirectional or lstm.proj_size:
            raise ValueError("bidirectional or projected LSTMs are not factorized")
        self.input_size, self.hidden_size = lstm.input_size, lstm.hidden_size
        self.num_layers, self.batch_first = lstm.num_layers, lstm.batch_first
        self.dropout, self.has_bias = float(lstm.dropout), bool(lstm.bias)
        self.ranks = [tuple(r) for r in ranks]
        if len(self.ranks) != self.num_layers:
            raise ValueError(f"need one (rank_ih, rank_hh) pair per layer, got {ranks}")
        h = self.hidden_size
        w0 = lstm.weight_ih_l0
        kw = {"device": w0.device, "dtype": w0.dtype}
        for layer, (r_ih, r_hh) in enumerate(self.ranks):
            in_l = self.input_size if layer == 0 else h
            for kind, r, n_in in (("ih", r_ih, in_l), ("hh", r_hh, h)):
                self.register_parameter(f"weight_{kind}_v_l{layer}", nn.Parameter(torch.empty(4 * r, n_in, **kw)))
                self.register_parameter(f"weight_{kind}_u_l{layer}", nn.Parameter(torch.empty(4, h, r, **kw)))
                if self.has_bias:
                    self.register_parameter(f"bias_{kind}_l{layer}", nn.Parameter(torch.empty(4 * h, **kw)))
        self._init_from(lstm)
        self.train(lstm.training)

    @staticmethod
    def full_ranks(lstm: nn.LSTM) -> list[tuple[int, int]]:
        """Per layer, the largest useful rank of one gate block (min of its two sides)."""
        h = lstm.hidden_size
        return [(min(h, lstm.input_size if l == 0 else h), h) for l in range(lstm.num_layers)]

    @torch.no_grad()
    def _init_from(self, lstm: nn.LSTM) -> None:
        h = self.hidden_size
        for layer, (r_ih, r_hh) in enumerate(self.ranks):
            for kind, r in (("ih", r_ih), ("hh", r_hh)):
                dense = getattr(lstm, f"weight_{kind}_l{layer}")  # (4h x in), gate order i,f,g,o
                us, vs = [], []
                for gate in range(4):  # one-off SVD per gate at conversion time, not per step
                    first, second = svd_factors(dense[gate * h : (gate + 1) * h], r)
                    us.append(first)
                    vs.append(second)
                getattr(self, f"weight_{kind}_u_l{layer}").copy_(torch.stack(us))
                getattr(self, f"weight_{kind}_v_l{layer}").copy_(torch.cat(vs))
                if self.has_bias:
                    getattr(self, f"bias_{kind}_l{layer}").copy_(getattr(lstm, f"bias_{kind}_l{layer}"))

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, matrix and gate ``(A [h x r], B [r x in])``: that gate's weight is ``A·B``."""
        out = []
        for layer in range(self.num_layers):
            for kind in ("ih", "hh"):
                u = getattr(self, f"weight_{kind}_u_l{layer}")
                v = getattr(self, f"weight_{kind}_v_l{layer}")
                vs = v.reshape(4, u.shape[2], v.shape[1])
                out.extend((u[g], vs[g]) for g in range(4))
        return out

    def _project(self, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """``x (..., in)`` -> stacked gate pre-activations ``(..., 4h)``."""
        u = getattr(self, f"weight_{kind}_u_l{layer}")  # (4, h, r)
        low = F.linear(x, getattr(self, f"weight_{kind}_v_l{layer}"))  # (..., 4r)
        lead = low.shape[:-1]
        low = low.reshape(-1, 4, u.shape[2]).transpose(0, 1)  # (4, N, r)
        out = torch.bmm(low, u.transpose(1, 2))  # (4, N, h)
        return out.transpose(0, 1).reshape(*lead, 4 * self.hidden_size)

    def forward(
        self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if not isinstance(input, torch.Tensor):
            raise TypeError("LowRankLSTM takes a padded tensor, not a PackedSequence")
        unbatched = input.dim() == 2
        x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if self.batch_first else input)
        steps, batch = x.shape[0], x.shape[1]
        if hx is None:
            zeros = x.new_zeros(self.num_layers, batch, self.hidden_size)
            h0, c0 = zeros, zeros
        else:
            h0, c0 = hx
            if unbatched:
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        hs, cs = [], []
        for layer in range(self.num_layers):
            pre = self._project(x, layer, "ih")  # all time steps at once: (T, B, 4h)
            if self.has_bias:
                pre = pre + getattr(self, f"bias_ih_l{layer}") + getattr(self, f"bias_hh_l{layer}")
            h, c = h0[layer], c0[layer]
            outs = []
            for t in range(steps):
                gates = pre[t] + self._project(h, layer, "hh")
                i, f, g, o = gates.chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outs.append(h)
            x = torch.stack(outs)
            hs.append(h)
            cs.append(c)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        h_n, c_n = torch.stack(hs), torch.stack(cs)
        if unbatched:
            return x.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        return (x.transpose(0, 1) if self.batch_first else x), (h_n, c_n)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, ranks={self.ranks}"


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
                if b is not None:
                    lin.bias.copy_(b)
            out[name] = lin
        o = nn.Linear(e, e, bias=mha.out_proj.bias is not None, device=dev, dtype=dt)
        with torch.no_grad():
            o.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                o.bias.copy_(mha.out_proj.bias)
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
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise TypeError("only bool and floating attention masks are supported")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))

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
from typing import Any, Callable

import torch
from torch import nn

from lowcomm.lowrank.attention import LowRankMultiheadAttention
from lowcomm.lowrank.recurrent import LowRankLSTM
from lowcomm.lowrank.svd import copy_bias, svd_factors

__all__ = ["LowRankConv", "LowRankLSTM", "LowRankLinear", "LowRankMultiheadAttention", "svd_factors"]


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
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
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
        """The factorized copy of ``dense`` (SVD per block): at full rank, the same outputs."""
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
                copy_bias(layer.u.bias, dense.bias)
            else:
                layer.u_blocks.copy_(torch.stack([first for first, _ in pairs]))
                copy_bias(layer.bias, dense.bias)
        layer.train(dense.training)
        return layer

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block ``(A [out/g x r], B [r x in])`` with block weight ``A·B`` (no extra_bn)."""
        vs = self.v.weight.reshape(self.blocks, self.rank, self.in_features)
        if self.blocks == 1:
            return [(self.u.weight, self.v.weight)]
        return [(self.u_blocks[g], vs[g]) for g in range(self.blocks)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``u(v(x))`` (blocks: one batched matmul), as the dense layer's ``x·Wᵀ + b``."""
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
        """Shown by ``print(model)``: the rank next to the dense shape."""
        blocks = f", blocks={self.blocks}" if self.blocks > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}{blocks}"


_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}


class LowRankConv(nn.Module):
    """k×k conv to ``r`` channels (same stride/padding/dilation) then a 1×1 conv to ``out``."""

    def __init__(self, conv: nn.Conv1d | nn.Conv2d, rank: int, *, extra_bn: bool = False) -> None:
        super().__init__()
        if conv.groups != 1:
            raise ValueError("grouped convolutions are not factorized")
        # the same class as ``conv`` (Conv1d or Conv2d): its size arguments are ``conv``'s own
        make: Callable[..., nn.Conv1d | nn.Conv2d] = type(conv)
        dims = len(conv.kernel_size)
        w = conv.weight
        self.in_channels, self.out_channels, self.rank = conv.in_channels, conv.out_channels, rank
        self.v = make(
            conv.in_channels,
            rank,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            bias=False,
            padding_mode=conv.padding_mode,
            device=w.device,
            dtype=w.dtype,
        )
        self.bn = _BN[dims](rank, device=w.device, dtype=w.dtype) if extra_bn else None
        self.u = make(rank, conv.out_channels, 1, bias=conv.bias is not None, device=w.device, dtype=w.dtype)

    @classmethod
    def from_dense(cls, conv: nn.Conv1d | nn.Conv2d, rank: int, *, extra_bn: bool = False) -> "LowRankConv":
        """The factorized copy of ``conv`` (SVD of the flattened kernel)."""
        layer = cls(conv, rank, extra_bn=extra_bn)
        w = conv.weight
        first, second = svd_factors(w.reshape(w.shape[0], -1), rank)
        with torch.no_grad():
            layer.u.weight.copy_(first.reshape(layer.u.weight.shape))
            layer.v.weight.copy_(second.reshape(layer.v.weight.shape))
            copy_bias(layer.u.bias, conv.bias)
        layer.train(conv.training)
        return layer

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(A [out x r], B [r x in·k·k])]`` with the flattened kernel ``A·B``."""
        return [(self.u.weight.reshape(self.out_channels, self.rank), self.v.weight.reshape(self.rank, -1))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``u(v(x))``: the k×k conv to ``r`` channels, then the 1×1 conv to ``out``."""
        h = self.v(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.u(h)

    def extra_repr(self) -> str:
        """Shown by ``print(model)``: the rank next to the dense shape."""
        return f"in_channels={self.in_channels}, out_channels={self.out_channels}, rank={self.rank}"

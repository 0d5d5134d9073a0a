"""Pufferfish's factorized LSTM: every gate matrix of every layer at its own rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.lowrank.svd import svd_factors


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
        kw: dict[str, Any] = {"device": w0.device, "dtype": w0.dtype}
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
        return [(min(h, lstm.input_size if layer == 0 else h), h) for layer in range(lstm.num_layers)]

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
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
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
        """``nn.LSTM``'s call: ``(output, (h_n, c_n))`` for a padded (or unbatched) input."""
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
        """Shown by ``print(model)``: the per-layer ranks."""
        return f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, ranks={self.ranks}"

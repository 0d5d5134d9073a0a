"""Word-level LSTM language model (PyTorch ``word_language_model`` / Pufferfish shape).

Defaults are Pufferfish's WikiText-2 model: 2 layers, embedding = hidden = 1500, tied
input/output embeddings, vocabulary 33,278. Pufferfish reports **85,962,278** parameters and
this model has exactly that with the default ``impl="linear"``:

* ``encoder`` 33,278 x 1,500 = 49,917,000 (shared with ``decoder.weight``),
* per layer an input projection ``ih = Linear(in, 4h)`` **with** bias and a recurrent
  projection ``hh = Linear(h, 4h, bias=False)``: 4h(in + h) + 4h = 18,006,000, x 2 layers,
* ``decoder`` bias 33,278.

So the count corresponds to *one* bias vector per gate block. ``nn.LSTM`` keeps two
(``bias_ih`` and ``bias_hh``; they are redundant, their sum is what matters), giving
85,974,278 (+12,000); that variant is available as ``impl="torch"`` (cuDNN-fast on GPUs).

The ``linear`` implementation keeps the gate matrices as plain ``nn.Linear`` layers (gates
batched: one ``4h x in`` matrix), so generic low-rank factorization applies to them; the
input projection of all time steps is one matmul, only the recurrent part loops over time.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from lowcomm.errors import UsageError
from lowcomm.models import ModelInfo, register_model


class LSTMLayer(nn.Module):
    """One LSTM layer, gate order (input, forget, cell, output) as in ``nn.LSTM``."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.ih = nn.Linear(input_size, 4 * hidden_size, bias=True)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size, bias=False)
        bound = 1.0 / math.sqrt(hidden_size)  # nn.LSTM's initialization
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        """``x: (B, T, in) -> (B, T, h)``, starting from a zero state."""
        b, t, _ = x.shape
        gi = self.ih(x)  # all time steps in one matmul
        h = x.new_zeros(b, self.hidden_size)
        c = x.new_zeros(b, self.hidden_size)
        outs = []
        for step in range(t):
            gates = gi[:, step] + self.hh(h)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, dim=1)


class LSTM(nn.Module):
    """Stack of :class:`LSTMLayer` with dropout between layers (batch-first)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        sizes = [input_size] + [hidden_size] * (num_layers - 1)
        self.layers = nn.ModuleList(LSTMLayer(s, hidden_size) for s in sizes)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        for k, layer in enumerate(self.layers):
            if k:
                x = self.drop(x)
            x = layer(x)
        return x


class LSTMLanguageModel(nn.Module):
    """``forward(tokens: (B, T) int64) -> logits (B, T, vocab_size)``; no state across batches."""

    output_projection_name = "decoder"

    def __init__(
        self,
        *,
        vocab_size: int,
        emb_size: int,
        hidden_size: int,
        num_layers: int,
        dropout: float,
        tie_weights: bool,
        impl: Literal["linear", "torch"],
    ) -> None:
        super().__init__()
        if tie_weights and emb_size != hidden_size:
            raise UsageError(
                f"lstm_lm: tie_weights needs emb_size == hidden_size, got {emb_size} and {hidden_size}"
            )
        self.encoder = nn.Embedding(vocab_size, emb_size)
        self.drop = nn.Dropout(dropout)
        self.impl = impl
        if impl == "linear":
            self.rnn: nn.Module = LSTM(emb_size, hidden_size, num_layers, dropout)
        elif impl == "torch":
            self.rnn = nn.LSTM(emb_size, hidden_size, num_layers, dropout=dropout, batch_first=True)
        else:
            raise UsageError(f"lstm_lm: impl must be 'linear' or 'torch', got {impl!r}")
        self.decoder = nn.Linear(hidden_size, vocab_size)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        else:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits for every position."""
        x = self.drop(self.encoder(tokens))
        out = self.rnn(x)
        if isinstance(out, tuple):  # nn.LSTM returns (output, (h, c))
            out = out[0]
        return self.decoder(self.drop(out))


@register_model("lstm_lm", info=ModelInfo("language_model", (35,), default_vocab_size=33278,
                                         description="2-layer tied LSTM LM (Pufferfish WikiText-2)"))
def lstm_lm(
    *,
    vocab_size: int = 33278,
    emb_size: int = 1500,
    hidden_size: int = 1500,
    num_layers: int = 2,
    dropout: float = 0.65,
    tie_weights: bool = True,
    impl: Literal["linear", "torch"] = "linear",
) -> LSTMLanguageModel:
    """Registry entry: the LSTM language model (Pufferfish's WikiText-2 model by default)."""
    return LSTMLanguageModel(vocab_size=vocab_size, emb_size=emb_size, hidden_size=hidden_size,
                             num_layers=num_layers, dropout=dropout, tie_weights=tie_weights,
                             impl=impl)

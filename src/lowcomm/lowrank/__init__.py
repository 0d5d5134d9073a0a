"""Model axis: Pufferfish low-rank pre-factorized training.

``factorize(model, rank_ratio=0.25, full_rank=None)`` rewrites Linear, Conv1d/2d, LSTM and
multi-head attention layers into SVD-initialized low-rank factors (hybrid presets keep the
paper's full-rank layers); :func:`summary` reports parameters, multiply-adds and gradient
bytes before and after; the ``pufferfish`` method (``lowcomm.methods.pufferfish``) trains
full-rank for a warm-up, then switches.
"""

from __future__ import annotations

from lowcomm.lowrank.factorize import candidates, factorize, factorized_ranks, plan
from lowcomm.lowrank.layers import LowRankConv, LowRankLinear, LowRankLSTM, LowRankMultiheadAttention
from lowcomm.lowrank.presets import PRESETS, Preset, get_preset
from lowcomm.lowrank.rank import ratio_rank, scaled_stable_rank, stable_rank

__all__ = [
    "LowRankConv",
    "LowRankLSTM",
    "LowRankLinear",
    "LowRankMultiheadAttention",
    "PRESETS",
    "Preset",
    "candidates",
    "factorize",
    "factorized_ranks",
    "get_preset",
    "plan",
    "ratio_rank",
    "scaled_stable_rank",
    "stable_rank",
]

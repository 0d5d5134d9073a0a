"""The split layer's FFN output matrix as two trainable SVD factors, one on each side of the link.

Shi et al.'s compression: the FFN output matrix ``W`` (H x I) of the split layer is replaced by
its truncated SVD ``W ≈ (U_r Σ_r^½)(Σ_r^½ V_rᵀ)``. The *first* factor ``Σ_r^½ V_rᵀ`` (I -> r, no
bias) runs on the edge, so only ``r`` numbers per token cross the link instead of ``H``; the
*second* factor ``U_r Σ_r^½`` (r -> H, with the original bias) runs on the cloud. Both factors
stay trainable: fine-tuning repairs what the truncation lost.

Why reuse :class:`lowcomm.lowrank.LowRankLinear`: it is the Pufferfish factorized linear layer
with the same factor convention and the one SVD (:func:`lowcomm.lowrank.svd.svd_factors`, float64
on the CPU, so both processes derive bit-identical factors from identical weights). The split
only adds names that say which side each factor lives on, and the rank check.
"""

from __future__ import annotations

import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.lowrank.layers import LowRankLinear

__all__ = ["SplitLinear", "check_rank", "factorize_linear", "truncation_error"]


class SplitLinear(LowRankLinear):
    """A :class:`LowRankLinear` (one block, no BatchNorm) whose factors are named by side.

    ``first`` (``Linear(I, r, bias=False)``, the Pufferfish ``v``) is the edge's half and
    ``second`` (``Linear(r, H)`` with the dense bias, the Pufferfish ``u``) the cloud's. The
    parameters keep the ``v``/``u`` names of the low-rank layers, so state dicts and the
    low-rank summaries read them alike.
    """

    @property
    def first(self) -> nn.Linear:
        """The edge's factor ``Σ_r^½ V_rᵀ``: I -> r, no bias (what its output crosses the link)."""
        return self.v

    @property
    def second(self) -> nn.Linear:
        """The cloud's factor ``U_r Σ_r^½``: r -> H, with the dense layer's bias."""
        return self.u


def check_rank(rank: object, in_features: int, out_features: int, *, what: str = "rank") -> int:
    """Refuse a rank outside ``1 <= r < min(I, H)`` with a message naming the valid range.

    Why ``r < min(I, H)``: at ``r = min(I, H)`` the factorization is exact but the edge would send
    at least as many numbers per token as the uncompressed split (``H``), so nothing is gained.
    """
    limit = min(in_features, out_features)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < limit:
        raise UsageError(
            f"{what} must be an integer from 1 to {limit - 1} (below min(in, out) = "
            f"min({in_features}, {out_features}) of the factorized matrix), got {rank!r}"
        )
    return rank


def factorize_linear(linear: nn.Linear, rank: int) -> SplitLinear:
    """The rank-``rank`` SVD factorization of ``linear`` (both factors trainable, bias kept).

    The result sits on ``linear``'s device and dtype and in its train/eval mode. At full rank
    (only reachable through ``SplitLinear.from_dense``, which skips :func:`check_rank`) it
    reproduces ``linear`` to float precision.
    """
    if not isinstance(linear, nn.Linear):
        raise UsageError(f"the split layer's FFN output must be an nn.Linear, got {type(linear).__name__}")
    check_rank(rank, linear.in_features, linear.out_features)
    layer = SplitLinear.from_dense(linear, rank)
    assert isinstance(layer, SplitLinear)  # from_dense builds cls
    return layer


def truncation_error(weight: torch.Tensor, rank: int) -> float:
    """``||W - W_r||_F / ||W||_F`` of the rank-``rank`` truncation (from the singular values).

    What the factorization loses before any fine-tuning: the report's accuracy-vs-rank table
    can show it next to the accuracy.
    """
    s = torch.linalg.svdvals(weight.detach().to(device="cpu", dtype=torch.float64))
    total = float(s.square().sum())
    return 0.0 if total == 0.0 else float(s[rank:].square().sum() / total) ** 0.5

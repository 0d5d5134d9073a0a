"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017) and the client-side base of the FedAvg family.

Each sampled client runs local SGD from the global weights; the server takes the average of
the client models weighted by sample count, ``w <- sum_i n_i w_i / sum_i n_i`` (the paper's
``n_k / n`` weights; Flower's ``FedAvg`` weights by ``num_examples``, the same rule). It is
written as a step from the global weights, ``w <- w + server_lr * sum_i n_i (w_i - w) /
sum_i n_i``, which equals the average at ``server_lr=1`` (up to rounding) and lets the
server learning rate of Hsu et al. / Reddi et al. be tried without a new class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from lowcomm.errors import check_positive
from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.api import Algorithm, ClientContext, scalar, weighted_delta
from lowcomm.fl.local import GradientCorrection, flat_view, local_sgd


@dataclass
class FedAvgOptions:
    """``fedavg:server_lr=1.0``: the step the server takes along the averaged client update."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        check_positive("server_lr", self.server_lr)


@register_algorithm
class FedAvg(Algorithm):
    """Sample-weighted model averaging; the base of FedProx and FedOpt (same client side)."""

    name = "fedavg"
    Options: ClassVar[type] = FedAvgOptions

    def local_correction(self, ctx: ClientContext) -> GradientCorrection | None:
        """The term added to local gradients: none for FedAvg (FedProx overrides it)."""
        return None

    def contribution_spec(self, num_params: int) -> dict[str, int]:
        """``delta = n_i (w_i - w)`` and ``weight = n_i``."""
        return {"delta": num_params, "weight": 1}

    def client_update(self, ctx: ClientContext) -> dict[str, Tensor]:
        """Local SGD, then the client's sample-weighted model change."""
        local_sgd(ctx, self.local_correction(ctx))
        n = ctx.num_samples
        return {"delta": weighted_delta(flat_view(ctx.model), ctx.global_params, n),
                "weight": scalar(n, ctx.global_params)}

    def average_delta(self, sums: dict[str, Tensor]) -> Tensor | None:
        """``sum_i n_i (w_i - w) / sum_i n_i``; None when no sampled client had data."""
        total = float(sums["weight"].sum())
        if total <= 0.0:
            return None
        return sums["delta"] / total

    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """``w + server_lr * (weighted average of w_i - w)``."""
        delta = self.average_delta(sums)
        if delta is None:
            return global_params.clone()
        return global_params.add(delta, alpha=self.options.server_lr)

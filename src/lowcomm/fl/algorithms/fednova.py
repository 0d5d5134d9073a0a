"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020).

Clients that run more local steps would pull FedAvg's average towards their own optimum.
FedNova divides each client's change by its number of effective steps ``||a_i||_1`` and
rescales the weighted average by ``tau_eff = sum_i p_i ||a_i||_1``:
``w <- w + server_lr * tau_eff * sum_i p_i (w_i - w) / ||a_i||_1`` with ``p_i = n_i / sum_j n_j``
(sample weights, as in the paper and the authors' code). For plain local SGD ``a_i`` is all
ones and ``||a_i||_1 = tau_i``, the client's number of steps; with heavy-ball momentum
``rho`` the authors' closed form ``sum_{k=1..tau} (1 - rho^k) / (1 - rho)`` is used. The
learning rate cancels out. Weight decay is not part of ``a_i`` (as in the authors' code), and
the optional server momentum of their code is not included. With equal ``tau_i`` it is FedAvg.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.algorithms.fedavg import FedAvgOptions
from lowcomm.fl.api import Algorithm, ClientContext, scalar, weighted_delta
from lowcomm.fl.local import flat_view, local_sgd, momentum_steps_norm


@register_algorithm
class FedNova(Algorithm):
    """Normalized averaging: every client's update counts per step, not per epoch."""

    name = "fednova"
    Options: ClassVar[type] = FedAvgOptions

    def contribution_spec(self, num_params: int) -> dict[str, int]:
        """``dnorm = n_i (w_i - w) / ||a_i||_1``, ``weight = n_i``, ``weighted_tau = n_i ||a_i||_1``."""
        return {"dnorm": num_params, "weight": 1, "weighted_tau": 1}

    def client_update(self, ctx: ClientContext) -> dict[str, Tensor]:
        """Local SGD, then the client's change per effective step, sample-weighted."""
        steps = local_sgd(ctx)
        n = ctx.num_samples
        a_norm = momentum_steps_norm(steps, ctx.train.momentum)
        scale = n / a_norm if a_norm > 0 else 0.0
        return {"dnorm": weighted_delta(flat_view(ctx.model), ctx.global_params, scale),
                "weight": scalar(n, ctx.global_params),
                "weighted_tau": scalar(n * a_norm, ctx.global_params)}

    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """``w + server_lr * tau_eff * sum_i p_i d_i``."""
        total = float(sums["weight"].sum())
        if total <= 0.0:
            return global_params.clone()
        tau_eff = float(sums["weighted_tau"].sum()) / total
        return global_params.add(sums["dnorm"], alpha=self.options.server_lr * tau_eff / total)

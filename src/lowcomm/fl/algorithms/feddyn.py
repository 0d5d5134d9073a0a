"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021).

Client ``k`` minimizes ``L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta_{t-1}||^2`` by
local SGD (gradient correction ``-g_k + alpha (theta - theta_{t-1})``), then updates its
state ``g_k <- g_k - alpha (theta_k - theta_{t-1})`` (the first-order condition: ``g_k`` is
``grad L_k`` at its last local solution; zeros on the first visit, kept in the client state
store). The server, as in the paper's Algorithm 1 with uniform averages,
``h <- h - alpha (1/m) sum_{k in P_t} (theta_k - theta_{t-1})`` with ``m`` the number of
registered clients, and ``theta_t = mean_{k in P_t} theta_k - h / alpha``. The authors' code
also rescales ``alpha`` per client by its share of the data; this follows the paper and
uses one ``alpha`` for all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lowcomm.errors import check_positive
from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.api import Algorithm, ClientContext
from lowcomm.fl.local import GradientCorrection, flat_view, local_sgd


@dataclass
class FedDynOptions:
    """``feddyn:alpha=0.01``: weight of the dynamic regularizer, > 0 (paper's grid: 0.1-0.001)."""

    alpha: float = 0.01

    def __post_init__(self) -> None:
        check_positive("alpha", self.alpha)


@register_algorithm
class FedDyn(Algorithm):
    """Dynamic regularization: each client's objective is corrected so that the stationary
    points of the local and global objectives agree."""

    name = "feddyn"
    stateful = True
    Options: ClassVar[type] = FedDynOptions

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.h: Tensor | None = None

    def setup(self, num_params: int, device: torch.device) -> None:
        """Server state ``h = 0``."""
        super().setup(num_params, device)
        self.h = torch.zeros(num_params, dtype=torch.float32, device=self.device)

    def client_state_spec(self, num_params: int) -> dict[str, int]:
        """``grad``: the client's ``g_k``."""
        return {"grad": num_params}

    def contribution_spec(self, num_params: int) -> dict[str, int]:
        """``dtheta = theta_k - theta_{t-1}`` (unweighted: the paper averages uniformly)."""
        return {"dtheta": num_params}

    def client_update(self, ctx: ClientContext) -> dict[str, Tensor]:
        """Regularized local SGD, then ``g_k -= alpha * dtheta``."""
        alpha = self.options.alpha
        grad = ctx.state["grad"]
        local_sgd(ctx, GradientCorrection(offset=-grad, mu=alpha, anchor=ctx.global_params))
        dtheta = torch.sub(flat_view(ctx.model), ctx.global_params)
        grad.sub_(dtheta, alpha=alpha)
        return {"dtheta": dtheta}

    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """``h -= alpha sum(dtheta) / m``; ``theta + mean(dtheta) - h / alpha``."""
        if self.h is None:
            raise RuntimeError("FedDyn.setup() must run before server_update()")
        if num_sampled <= 0:
            return global_params.clone()
        alpha = self.options.alpha
        self.h.sub_(sums["dtheta"], alpha=alpha / num_clients)
        return global_params.add(sums["dtheta"], alpha=1.0 / num_sampled).sub_(self.h, alpha=1.0 / alpha)

    def state_dict(self) -> dict[str, Any]:
        """``h`` (CPU copy)."""
        return {} if self.h is None else {"h": self.h.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``h`` exactly."""
        if state:
            if self.h is None:
                raise RuntimeError("FedDyn.setup() must run before load_state_dict()")
            self.h.copy_(state["h"])

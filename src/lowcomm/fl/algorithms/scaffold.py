"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020), with the paper's option II control-variate update.

Server state ``c`` (broadcast every round), client state ``c_i`` (zeros on the first visit,
kept in the client state store). A client runs ``K`` local SGD steps on the corrected
gradient ``g(y) - c_i + c``, then ``c_i+ = c_i - c + (x - y_i) / (K lr)`` (option II).
The server, as in the paper's Algorithm 1, averages uniformly:
``x <- x + server_lr * (1/|S|) sum_i (y_i - x)`` and ``c <- c + (1/N) sum_i (c_i+ - c_i)``
with ``N`` the number of registered clients. Option II assumes plain SGD (momentum 0,
weight decay 0); a client without samples takes no step and changes nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.algorithms.fedavg import FedAvgOptions
from lowcomm.fl.api import Algorithm, ClientContext
from lowcomm.fl.local import GradientCorrection, flat_view, local_sgd


@register_algorithm
class Scaffold(Algorithm):
    """Control variates correct each client's drift towards its own optimum."""

    name = "scaffold"
    stateful = True
    Options: ClassVar[type] = FedAvgOptions

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.c: Tensor | None = None

    def setup(self, num_params: int, device: torch.device) -> None:
        """Server control variate ``c = 0``."""
        super().setup(num_params, device)
        self.c = torch.zeros(num_params, dtype=torch.float32, device=self.device)

    def client_state_spec(self, num_params: int) -> dict[str, int]:
        """The client control variate ``c_i``."""
        return {"c": num_params}

    def server_broadcast_spec(self, num_params: int) -> dict[str, int]:
        """The server control variate ``c``."""
        return {"c": num_params}

    def server_broadcast(self) -> dict[str, Tensor]:
        """``c`` for this round."""
        if self.c is None:
            raise RuntimeError("Scaffold.setup() must run before server_broadcast()")
        return {"c": self.c}

    def contribution_spec(self, num_params: int) -> dict[str, int]:
        """``dy = y_i - x`` and ``dc = c_i+ - c_i`` (unweighted: the paper averages uniformly)."""
        return {"dy": num_params, "dc": num_params}

    def client_update(self, ctx: ClientContext) -> dict[str, Tensor]:
        """Corrected local SGD, then option II for ``c_i``."""
        c, ci = ctx.server["c"], ctx.state["c"]
        steps = local_sgd(ctx, GradientCorrection(offset=c - ci))
        dy = torch.sub(flat_view(ctx.model), ctx.global_params)
        if steps == 0:
            return {"dy": dy, "dc": torch.zeros_like(dy)}
        # c_i+ - c_i = (x - y_i) / (K lr) - c
        dc = dy.mul(-1.0 / (steps * ctx.train.lr)).sub_(c)
        ci.add_(dc)
        return {"dy": dy, "dc": dc}

    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """``x + server_lr * mean(dy)``; ``c += sum(dc) / N``."""
        if self.c is None:
            raise RuntimeError("Scaffold.setup() must run before server_update()")
        if num_sampled <= 0:
            return global_params.clone()
        self.c.add_(sums["dc"], alpha=1.0 / num_clients)
        return global_params.add(sums["dy"], alpha=self.options.server_lr / num_sampled)

    def state_dict(self) -> dict[str, Any]:
        """The server control variate (CPU copy)."""
        return {} if self.c is None else {"c": self.c.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``c`` exactly."""
        if state:
            if self.c is None:
                raise RuntimeError("Scaffold.setup() must run before load_state_dict()")
            self.c.copy_(state["c"])

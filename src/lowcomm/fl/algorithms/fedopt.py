"""FedOpt (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): FedAdam, FedYogi,
FedAdagrad.

Clients run FedAvg's local SGD. The server treats the sample-weighted average client change
``Delta = sum_i n_i (w_i - w) / sum_i n_i`` as a pseudo-gradient (the paper averages
uniformly; the sample weights follow Flower's FedOpt strategies, so both sides of the Flower
comparison aggregate alike) and applies the paper's Algorithm 2:

* ``m <- beta1 m + (1 - beta1) Delta``
* Adagrad: ``v <- v + Delta^2``; Adam: ``v <- beta2 v + (1 - beta2) Delta^2``;
  Yogi: ``v <- v - (1 - beta2) Delta^2 sign(v - Delta^2)``
* ``w <- w + server_lr * m / (sqrt(v) + tau)``

with ``m`` starting at 0 and ``v`` at ``tau^2`` (the paper's ``v_{-1} >= tau^2``), and no
bias correction (the paper has none; Flower's FedAdam adds one). ``tau`` is the paper's
adaptivity ``tau`` (the ``eps`` of Adam). ``fedadam``, ``fedyogi`` and ``fedadagrad`` are
``fedopt`` with ``server`` fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lowcomm.errors import UsageError, check_positive, check_range
from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.algorithms.fedavg import FedAvg

SERVERS = ("adam", "yogi", "adagrad")


@dataclass
class AdaptiveOptions:
    """The server optimizer's hyperparameters (``fedadam:server_lr=0.01,beta1=0.9,...``)."""

    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        check_positive("server_lr", self.server_lr)
        check_range("beta1", self.beta1, 0.0, 1.0, high_open=True)
        check_range("beta2", self.beta2, 0.0, 1.0, high_open=True)
        check_positive("tau", self.tau)


@dataclass
class FedOptOptions(AdaptiveOptions):
    """``fedopt:server=adam|yogi|adagrad`` plus :class:`AdaptiveOptions`."""

    server: str = "adam"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server not in SERVERS:
            raise UsageError(f"fedopt server {self.server!r} is unknown; valid: {', '.join(SERVERS)}")


@register_algorithm
class FedOpt(FedAvg):
    """FedAvg's clients with an adaptive server optimizer (state ``m``, ``v`` on the server)."""

    name = "fedopt"
    Options: ClassVar[type] = FedOptOptions
    #: the server optimizer of an alias whose options have no ``server`` key
    fixed_server = "adam"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.server = str(getattr(self.options, "server", self.fixed_server))
        self.m: Tensor | None = None
        self.v: Tensor | None = None

    def setup(self, num_params: int, device: torch.device) -> None:
        """Allocate ``m = 0`` and ``v = tau^2``."""
        super().setup(num_params, device)
        self.m = torch.zeros(num_params, dtype=torch.float32, device=self.device)
        self.v = torch.full((num_params,), self.options.tau ** 2, dtype=torch.float32, device=self.device)

    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """One step of the server optimizer along the averaged client change."""
        if self.m is None or self.v is None:
            raise RuntimeError("FedOpt.setup() must run before server_update()")
        delta = self.average_delta(sums)
        if delta is None:
            return global_params.clone()
        o = self.options
        self.m.mul_(o.beta1).add_(delta, alpha=1.0 - o.beta1)
        sq = delta.square()
        if self.server == "adagrad":
            self.v.add_(sq)
        elif self.server == "adam":
            self.v.mul_(o.beta2).add_(sq, alpha=1.0 - o.beta2)
        else:  # yogi
            self.v.sub_(sq.mul_(torch.sign(self.v - sq)), alpha=1.0 - o.beta2)
        return global_params.addcdiv(self.m, self.v.sqrt().add_(o.tau), value=o.server_lr)

    def state_dict(self) -> dict[str, Any]:
        """``m`` and ``v`` (CPU copies)."""
        if self.m is None or self.v is None:
            return {}
        return {"m": self.m.cpu().clone(), "v": self.v.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``m`` and ``v`` exactly."""
        if not state:
            return
        if self.m is None or self.v is None:
            raise RuntimeError("FedOpt.setup() must run before load_state_dict()")
        self.m.copy_(state["m"])
        self.v.copy_(state["v"])


@register_algorithm
class FedAdam(FedOpt):
    """``fedopt:server=adam``."""

    name = "fedadam"
    Options: ClassVar[type] = AdaptiveOptions
    fixed_server = "adam"


@register_algorithm
class FedYogi(FedOpt):
    """``fedopt:server=yogi``."""

    name = "fedyogi"
    Options: ClassVar[type] = AdaptiveOptions
    fixed_server = "yogi"


@register_algorithm
class FedAdagrad(FedOpt):
    """``fedopt:server=adagrad``."""

    name = "fedadagrad"
    Options: ClassVar[type] = AdaptiveOptions
    fixed_server = "adagrad"

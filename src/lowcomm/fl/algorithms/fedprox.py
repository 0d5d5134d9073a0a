"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Each client minimizes ``F_i(w) + mu/2 ||w - w_t||^2`` with local SGD, i.e. its gradients get
``mu (w - w_t)`` added; ``mu=0`` is FedAvg. Aggregation is FedAvg's, weighted by sample
count as in the authors' implementation (it averages the local solutions weighted by their
number of samples). Clients always run the full local epochs here: the paper's partial work
of stragglers (``gamma``-inexact solutions) is not emulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowcomm.errors import check_positive
from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.algorithms.fedavg import FedAvg, FedAvgOptions
from lowcomm.fl.api import ClientContext
from lowcomm.fl.local import GradientCorrection


@dataclass
class FedProxOptions(FedAvgOptions):
    """``fedprox:mu=0.01,server_lr=1.0``: ``mu`` >= 0 weighs the proximal term (paper's grid: 0.001-1)."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("mu", self.mu, allow_zero=True)


@register_algorithm
class FedProx(FedAvg):
    """FedAvg whose clients are pulled towards the global weights by a proximal term."""

    name = "fedprox"
    Options: ClassVar[type] = FedProxOptions

    def local_correction(self, ctx: ClientContext) -> GradientCorrection | None:
        """``mu (w - w_t)``, the gradient of the proximal term."""
        if self.options.mu == 0.0:
            return None
        return GradientCorrection(mu=self.options.mu, anchor=ctx.global_params)

"""A new federated algorithm written outside lowcomm: FedAvgM (FedAvg with server momentum).

Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification" (2019): the server keeps a momentum buffer of the averaged client
change, ``v <- beta v + Delta``, and steps ``w <- w + server_lr * v``. With ``momentum=0``
it is FedAvg.

Run it (from the repository root; the module is imported by every worker process):

    lowcomm fl --algorithm-module examples/fl_fedavgm.py --algorithm fedavgm:momentum=0.9 \
        --clients 100 --per-round 20 --nproc 2 --model mlp --data mnist1d \
        --partition dirichlet:alpha=0.5 --rounds 10 --local-epochs 1 --batch-size 16 --lr 0.05

or ``python examples/fl_fedavgm.py`` for that same command.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lowcomm.errors import check_positive, check_range
from lowcomm.fl.algorithms import register_algorithm
from lowcomm.fl.api import Algorithm, ClientContext, scalar, weighted_delta
from lowcomm.fl.local import flat_view, local_sgd


@dataclass
class FedAvgMOptions:
    """``fedavgm:server_lr=1.0,momentum=0.9``; checked when the spec is parsed."""

    server_lr: float = 1.0
    momentum: float = 0.9

    def __post_init__(self) -> None:
        check_positive("server_lr", self.server_lr)
        check_range("momentum", self.momentum, 0.0, 1.0, high_open=True)


@register_algorithm
class FedAvgM(Algorithm):
    """FedAvg's clients; the server adds momentum to the sample-weighted average change."""

    name = "fedavgm"
    Options: ClassVar[type] = FedAvgMOptions

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.velocity: Tensor | None = None

    def setup(self, num_params: int, device: torch.device) -> None:
        """Server state: the momentum buffer (every rank allocates it; only the server uses it)."""
        super().setup(num_params, device)
        self.velocity = torch.zeros(num_params, dtype=torch.float32, device=self.device)

    def contribution_spec(self, num_params: int) -> dict[str, int]:
        """What each client sends: its weighted change and its weight."""
        return {"delta": num_params, "weight": 1}

    def client_update(self, ctx: ClientContext) -> dict[str, Tensor]:
        """Plain local SGD from the global weights, then ``n_i (w_i - w)`` and ``n_i``."""
        local_sgd(ctx)
        n = ctx.num_samples
        return {"delta": weighted_delta(flat_view(ctx.model), ctx.global_params, n),
                "weight": scalar(n, ctx.global_params)}

    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """``v <- momentum v + Delta``; ``w <- w + server_lr v`` (sums are over all clients)."""
        assert self.velocity is not None, "setup() runs before the first round"
        total = float(sums["weight"].sum())
        if total > 0:
            self.velocity.mul_(self.options.momentum).add_(sums["delta"], alpha=1.0 / total)
        return global_params.add(self.velocity, alpha=self.options.server_lr)

    def state_dict(self) -> dict[str, Any]:
        """The momentum buffer, so that ``--resume`` continues exactly."""
        return {} if self.velocity is None else {"velocity": self.velocity.cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the momentum buffer (after :meth:`setup`)."""
        if state and self.velocity is not None:
            self.velocity.copy_(state["velocity"])


def main() -> int:
    """Run the command of the module docstring through lowcomm's CLI."""
    from lowcomm.cli import main as lowcomm_main

    argv = [
        "fl", "--algorithm-module", __file__, "--algorithm", "fedavgm:momentum=0.9",
        "--clients", "100", "--per-round", "20", "--nproc", "2", "--model", "mlp", "--data", "mnist1d",
        "--partition", "dirichlet:alpha=0.5", "--rounds", "10", "--local-epochs", "1",
        "--batch-size", "16", "--lr", "0.05", *sys.argv[1:],
    ]
    return lowcomm_main(argv)


if __name__ == "__main__":
    sys.exit(main())

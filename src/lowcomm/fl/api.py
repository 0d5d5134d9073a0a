"""The federated-algorithm API: what a researcher writes to add an algorithm (contract C1).

An algorithm is two functions and a little bookkeeping:

* :meth:`Algorithm.client_update` runs on a worker, once per sampled client, with the one
  model of that worker already holding the global weights. It returns the client's
  *contribution*: a dict of flat tensors, already weighted (``n_i * delta_i`` and ``n_i``).
* :meth:`Algorithm.server_update` runs on the server rank once per round with the *sums* of
  every contribution entry over all sampled clients, and returns the new global weights.

Why sums and not lists: the engine can then add the contributions of the clients a worker
trained into one accumulator and bring all workers' accumulators to the server with one
reduce per round (Parrot's local-then-global aggregation). Memory does not grow with the
number of clients per round, and the same class runs unchanged with one client per process
(cross-silo): a sum over one client is that client's contribution.

Per-client state (SCAFFOLD's control variate, FedDyn's gradient term) is declared by
:meth:`Algorithm.client_state_spec`; the engine loads it from the client state store into
:attr:`ClientContext.state` and writes it back after :meth:`client_update`. Server state
that clients need (SCAFFOLD's ``c``) is declared by :meth:`Algorithm.server_broadcast_spec`
and arrives in :attr:`ClientContext.server`.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor, nn

from lowcomm.errors import check_count, check_positive, check_range

__all__ = ["Algorithm", "ClientContext", "LocalTraining", "NoOptions", "scalar", "weighted_delta"]


@dataclass
class LocalTraining:
    """The client's local-training hyperparameters (from the CLI: ``--lr``, ``--local-epochs``, ...).

    Validated here so that the CLI, the engine and a user's own driver refuse the same bad
    values with the same message.
    """

    lr: float
    local_epochs: int
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_count("local_epochs", self.local_epochs)
        check_count("batch_size", self.batch_size)
        check_range("momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)


def _mean_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits, target)


@dataclass
class ClientContext:
    """Everything :meth:`Algorithm.client_update` may use for one client, handed in by the engine.

    ``model`` is the worker's one model: on entry it holds the global weights, and what the
    algorithm leaves in it is discarded (the engine reloads the global weights before the
    next client). ``state`` is this client's stored state (zeros on the first visit); the
    engine stores whatever ``state`` holds after :meth:`Algorithm.client_update` returns, so
    modify the tensors in place or assign new ones of the same size.
    """

    client_id: int
    round: int
    model: nn.Module
    x: Tensor
    y: Tensor
    global_params: Tensor
    server: dict[str, Tensor]
    state: dict[str, Tensor]
    train: LocalTraining
    generator: torch.Generator
    loss_fn: Callable[[Tensor, Tensor], Tensor] = field(default=_mean_cross_entropy)

    @property
    def num_samples(self) -> int:
        """``n_i``, the weight most algorithms give this client's contribution."""
        return int(self.x.shape[0])


@dataclass
class NoOptions:
    """Options of an algorithm that takes none (``--algorithm name`` with nothing after it)."""


class Algorithm(abc.ABC):
    """Base class of a federated algorithm; subclass it and register it with
    :func:`lowcomm.fl.algorithms.register_algorithm`.

    Call order, per round: ``server_broadcast`` (server rank) -> ``load_server_broadcast``
    (other ranks) -> ``client_update`` for each sampled client (every rank, its clients one
    after another, in increasing client id) -> the engine sums the contributions ->
    ``server_update`` (server rank). ``setup`` runs once on every rank before the first
    round, and before ``load_state_dict`` on resume.
    """

    #: registry name, e.g. ``"fedprox"``
    name: ClassVar[str]
    #: True when :meth:`client_state_spec` is non-empty (the engine then opens a state store)
    stateful: ClassVar[bool] = False
    #: dataclass of the ``--algorithm name:key=value`` options; validate in ``__post_init__``
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        self.options = self.Options() if options is None else options
        self.num_params = 0
        self.device = torch.device("cpu")

    def setup(self, num_params: int, device: torch.device) -> None:
        """Allocate server state for a model of ``num_params`` parameters (every rank).

        Subclasses that hold server state call ``super().setup(...)`` first.
        """
        self.num_params = int(num_params)
        self.device = torch.device(device)

    def client_state_spec(self, num_params: int) -> dict[str, int]:
        """Per-client state, name -> number of fp32 elements; ``{}`` for a stateless algorithm."""
        return {}

    def server_broadcast_spec(self, num_params: int) -> dict[str, int]:
        """Extras the server sends with the global model each round, name -> numel; ``{}`` for none."""
        return {}

    def server_broadcast(self) -> dict[str, Tensor]:
        """Server rank: the values of :meth:`server_broadcast_spec` for this round."""
        return {}

    def load_server_broadcast(self, values: dict[str, Tensor]) -> None:
        """Other ranks: receive this round's broadcast extras.

        The default keeps nothing: the engine hands the same values to every client in
        :attr:`ClientContext.server`. Override to keep a copy.
        """
        return None

    @abc.abstractmethod
    def contribution_spec(self, num_params: int) -> dict[str, int]:
        """What :meth:`client_update` returns, name -> numel (a scalar is 1); fixed per run."""

    @abc.abstractmethod
    def client_update(self, ctx: ClientContext) -> dict[str, Tensor]:
        """Train one client and return its contribution, already weighted by the algorithm.

        Each entry is a flat fp32 tensor on the model's device with the numel of
        :meth:`contribution_spec`; the engine sums each entry over all clients of the round.
        """

    @abc.abstractmethod
    def server_update(self, global_params: Tensor, sums: dict[str, Tensor], *, round: int,
                      num_sampled: int, num_clients: int) -> Tensor:
        """Server rank: the new flat global weights from the summed contributions.

        ``num_sampled`` is the number of clients of this round, ``num_clients`` the number
        of registered clients (SCAFFOLD and FedDyn average their server state over it).
        """

    def state_dict(self) -> dict[str, Any]:
        """Server-side state (optimizer moments, control variates) for an exact resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (called after :meth:`setup`); stateless servers ignore it."""
        return None

    def describe(self) -> dict[str, Any]:
        """The algorithm and its options, for the run's JSON."""
        return {"algorithm": self.name, "options": dataclasses.asdict(self.options)}


def weighted_delta(model_params: Tensor, global_params: Tensor, weight: float) -> Tensor:
    """``weight * (w_i - w)`` as a new tensor: the contribution most algorithms return.

    Why one helper: two kernels (sub, then in-place mul), no temporary beyond the result.
    """
    return torch.sub(model_params, global_params).mul_(weight)


def scalar(value: float, like: Tensor) -> Tensor:
    """A 1-element fp32 tensor on ``like``'s device, for scalar contributions (``n_i``, ``tau_i``)."""
    return torch.full((1,), float(value), dtype=torch.float32, device=like.device)

"""The supernet API every elastic model implements, latency units, BN re-calibration.

:class:`Supernet` is what the training loop (progressive shrinking), the search and the CLI
talk to, whatever the network computes (classes, disparities): set a config, sample one,
extract a plain sub-network, sort channels before shrinking, and cut the network of a config
into :class:`LatencyUnit` pieces whose times add up to the whole (OFA's latency lookup table
is built from such pieces: a block with the same configuration and input shape costs the same
wherever it sits, so each distinct key is timed once).

BN re-calibration (OFA): the running statistics of the shared BN layers were accumulated over
many different sub-networks, so they fit none of them; before evaluating a sub-network its
statistics are recomputed on a few training batches.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lowcomm.elastic.space import Config, SearchSpace
from lowcomm.errors import UsageError


@dataclass(frozen=True)
class LatencyUnit:
    """One piece of a network to time alone.

    ``key`` identifies the module's configuration *and* its input shapes: equal keys mean the
    same cost. ``build`` makes a plain module (e.g. a block's ``extract``); ``inputs`` are the
    shapes (batch 1) of the tensors its forward takes.
    """

    key: str
    build: Callable[[], nn.Module]
    inputs: tuple[tuple[int, ...], ...]


class Supernet(nn.Module, metaclass=abc.ABCMeta):
    """Base class of elastic networks: subclasses set ``self.space`` and implement the hooks
    :meth:`_apply_config`, :meth:`_extract`, :meth:`sort_channels`, :meth:`latency_units`.

    A forward always runs the active config (the max config until :meth:`set_active`).
    """

    space: SearchSpace

    def __init__(self) -> None:
        super().__init__()
        self._active: Config | None = None

    def set_active(self, config: Config) -> None:
        """Validate ``config`` and make later forwards run that sub-network."""
        cfg = self.space.validate(config)
        self._apply_config(cfg)
        self._active = cfg

    def active_config(self) -> Config:
        """A copy of the config forwards run now."""
        if self._active is None:
            self._active = self.space.max_config()
        return {k: list(v) for k, v in self._active.items()}

    def sample_config(self, rng: random.Random, elastic: Collection[str] | None = None) -> Config:
        """A random config (dims outside ``elastic`` at their max); see :meth:`SearchSpace.sample`."""
        return self.space.sample(rng, elastic)

    def extract(self, config: Config) -> nn.Module:
        """The sub-network of ``config`` as a plain module with copied weights (no elastic class
        inside), in this supernet's train/eval mode. The active config is left unchanged."""
        cfg = self.space.validate(config)
        previous = self.active_config()
        try:
            self._apply_config(cfg)
            with torch.no_grad():
                module = self._extract(cfg)
        finally:
            self._apply_config(previous)
        module.train(self.training)
        return module

    @abc.abstractmethod
    def _apply_config(self, config: Config) -> None:
        """Set the active choices of every elastic module (config already validated)."""

    @abc.abstractmethod
    def _extract(self, config: Config) -> nn.Module:
        """Build the plain module of the active ``config`` (called under ``no_grad``)."""

    @abc.abstractmethod
    def sort_channels(self) -> None:
        """Reorder channels by importance (OFA) without changing the function computed."""

    @abc.abstractmethod
    def latency_units(self, config: Config, sample_shape: tuple[int, ...]) -> list[LatencyUnit]:
        """The network of ``config`` at batch 1 and per-sample input ``sample_shape``, cut into
        consecutive pieces whose run times add up to the whole."""


def _first_tensor(batch: object) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise UsageError(f"BN re-calibration needs input tensors (or (x, y) pairs), got {type(batch).__name__}")


def recalibrate_bn(model: nn.Module, batches: Iterable[object], *, num_batches: int) -> None:
    """OFA's BN re-calibration: reset every BN's running statistics, switch it to a cumulative
    average (momentum ``None``), forward ``num_batches`` batches in train mode without
    gradients, then restore the momenta and each module's train/eval mode.

    ``batches`` yields input tensors or ``(x, y)`` pairs (a DataLoader works as is); inputs
    are moved to the model's device. Fewer batches than asked for is fine, none is an error.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise UsageError(f"num_batches must be a positive integer, got {num_batches!r}")
    bns = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if not bns:
        return
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in bns}
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    seen = 0
    try:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        model.train()
        with torch.no_grad():
            for batch in batches:
                if seen >= num_batches:
                    break
                model(_first_tensor(batch).to(device))
                seen += 1
    finally:
        for bn, momentum in momenta.items():
            bn.momentum = momentum
        for module, training in modes.items():
            module.training = training
    if seen == 0:
        raise UsageError("BN re-calibration got no batches (the data iterable was empty)")


__all__ = ["LatencyUnit", "Supernet", "recalibrate_bn"]

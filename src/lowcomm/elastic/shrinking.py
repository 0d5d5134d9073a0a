"""Progressive shrinking (Once-for-All, EASNet): the phases, the sub-networks of each step, and
the one wrapped forward that trains several of them at once.

Why a schedule of phases: training every sub-network from the start lets the small ones drag
the large ones down; OFA trains the full network first, then lets one dimension after another
become elastic (kernel, then depth, then expansion ratio/width; EASNet adds the number of
pyramid scales), each phase sampling more sub-networks per step and starting from the weights
the previous phase ended with.

Why one forward for all sub-networks of a step: every lowcomm method (DDP hooks, the layer-wise
engine of DeAR/lee18, compression with error feedback) expects one forward and one backward per
step. :class:`MultiNet` runs the step's configurations inside a single ``forward`` and returns
their outputs, the trainer sums their losses, and one backward gives the sum of the
sub-networks' gradients: what OFA obtains by accumulating several backward passes.
"""

from __future__ import annotations

import copy
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowcomm.elastic.space import Config
from lowcomm.elastic.supernet import Supernet
from lowcomm.errors import UsageError

#: Phases in OFA/EASNet order and the dimensions each one makes elastic (cumulative); a
#: dimension the supernet does not have is skipped (a classifier has no ``scales``).
PHASE_DIMS: dict[str, tuple[str, ...]] = {
    "full": (),
    "kernel": ("kernel",),
    "depth": ("kernel", "depth"),
    "expand": ("kernel", "depth", "expand", "width"),
    "scales": ("kernel", "depth", "expand", "width", "scales"),
}
#: The dimensions each phase adds; a phase is possible when the supernet has one of them.
NEW_DIMS = {name: tuple(d for d in dims if d not in prev)
            for (name, dims), prev in zip(PHASE_DIMS.items(), [(), *PHASE_DIMS.values()])}
#: Sub-networks sampled per step in each phase: EASNet's 1 / 1 / 2 / 4 / 6.
DEFAULT_SUBNETS = {"full": 1, "kernel": 1, "depth": 2, "expand": 4, "scales": 6}
#: Epochs per phase in EASNet's ratio 64 : 25 : 25 : 25 : 25, scaled by ``--epochs``.
EASNET_EPOCHS = {"full": 64, "kernel": 25, "depth": 25, "expand": 25, "scales": 25}


@dataclass(frozen=True)
class Phase:
    """One phase: its name, epochs, the dimensions sampled and sub-networks per step; ``lr``
    (None: the run's ``--lr``) restarts the schedule as OFA's phases do."""

    name: str
    epochs: int
    elastic: tuple[str, ...]
    subnets: int
    lr: float | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (the phase travels to workers and into the run's JSON)."""
        return {"name": self.name, "epochs": self.epochs, "elastic": list(self.elastic),
                "subnets": self.subnets, "lr": self.lr}


def parse_phases(text: str, dims: Sequence[str], *, subnets: dict[str, int] | None = None,
                 lrs: dict[str, float] | None = None) -> list[Phase]:
    """``"full:4,kernel:2,depth:2,expand:2,scales:2"`` -> phases for a space with ``dims``.

    Phases must come in OFA's order (each keeps the previous phases' dimensions elastic); a
    phase whose new dimensions the supernet lacks is refused, naming the valid phases.
    """
    for flag, given in (("--subnets", subnets), ("--phase-lr", lrs)):
        unknown = sorted(set(given or {}) - set(PHASE_DIMS))
        if unknown:
            raise UsageError(f"{flag}: unknown phase {', '.join(unknown)}; valid: {', '.join(PHASE_DIMS)}")
    counts = {**DEFAULT_SUBNETS, **(subnets or {})}
    valid = possible_phases(dims)
    phases: list[Phase] = []
    last = -1
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, epochs_text = item.partition(":")
        if name not in PHASE_DIMS:
            raise UsageError(f"--phases: unknown phase {name!r}; valid: {', '.join(valid)}")
        if name not in valid:
            raise UsageError(f"--phases: this supernet has no {name!r} dimension; valid phases: {', '.join(valid)}")
        order = list(PHASE_DIMS).index(name)
        if order <= last:
            raise UsageError(f"--phases: {name!r} out of order; phases run in the order {', '.join(valid)}")
        last = order
        try:
            epochs = int(epochs_text) if sep else 1
        except ValueError:
            raise UsageError(f"--phases: {item!r} needs NAME:EPOCHS with a whole number of epochs") from None
        if epochs < 1:
            raise UsageError(f"--phases: {item!r}: epochs must be >= 1")
        elastic = tuple(d for d in PHASE_DIMS[name] if d in dims)
        n = int(counts.get(name, 1))
        if n < 1:
            raise UsageError(f"--subnets: {name}={n} must be >= 1")
        lr = (lrs or {}).get(name)
        if lr is not None and not 0 < lr < float("inf"):
            raise UsageError(f"--phase-lr: {name}={lr} must be a positive number")
        phases.append(Phase(name, epochs, elastic, n, lr))
    if not phases:
        raise UsageError(f"--phases is empty; e.g. {default_phases_text(dims, 8)}")
    return phases


def possible_phases(dims: Sequence[str]) -> list[str]:
    """The phases a supernet with ``dims`` can run, in order."""
    return [p for p in PHASE_DIMS if p == "full" or set(NEW_DIMS[p]) & set(dims)]


def default_phases_text(dims: Sequence[str], epochs: int) -> str:
    """EASNet's phase lengths scaled to ``epochs`` in total (each phase at least one epoch)."""
    names = possible_phases(dims)
    total = sum(EASNET_EPOCHS[n] for n in names)
    return ",".join(f"{n}:{max(1, round(epochs * EASNET_EPOCHS[n] / total))}" for n in names)


def step_rng(seed: int, phase: str, step: int) -> random.Random:
    """The generator of one step's sub-networks: the same on every rank (no collective needed
    to agree), different for every step and phase, and reproduced exactly on resume."""
    return random.Random(zlib.crc32(f"{seed}:{phase}:{step}".encode()))


def phase_min_config(net: Supernet, elastic: Sequence[str]) -> Config:
    """The smallest sub-network a phase can sample: its elastic dimensions at their smallest
    choice, the others (not yet elastic) at their largest."""
    small, large = net.space.min_config(), net.space.max_config()
    return {name: (small if name in elastic else large)[name] for name in net.space.names}


def step_configs(net: Supernet, phase: Phase, seed: int, step: int, *, sandwich: bool = False) -> list[Config]:
    """The configurations trained at ``step``: the largest network in the ``full`` phase;
    otherwise, as OFA, ``phase.subnets`` random ones over the phase's elastic dimensions.

    ``sandwich`` (BigNAS's sandwich rule, its lower end): the phase's smallest sub-network is
    trained at every step too, first. Why: under uniform sampling the smallest networks are
    drawn rarely and their shared weights are tuned for larger neighbours; in a short run they
    end far behind the same architecture trained alone.
    """
    if not phase.elastic:
        return [net.space.max_config()]
    rng = step_rng(seed, phase.name, step)
    sampled = [net.sample_config(rng, elastic=phase.elastic) for _ in range(phase.subnets)]
    return [phase_min_config(net, phase.elastic), *sampled] if sandwich else sampled


class MultiNet(nn.Module):
    """The supernet as the trainer's model: one ``forward`` runs every configuration in
    :attr:`configs` (set before the step) and the distillation teacher, if any.

    ``"touch"`` is ``0 * (one element of every trainable parameter)``: a sub-network that skips
    blocks or scales leaves their parameters out of the graph, and a method that waits for
    every gradient (DDP without unused-parameter search, the layer-wise engines) would wait
    for ever; added to the loss it gives those parameters an exact zero gradient, on every
    rank alike.
    """

    def __init__(self, supernet: Supernet) -> None:
        super().__init__()
        self.supernet = supernet
        self.configs: list[Config] = [supernet.space.max_config()]
        self._teacher: list[nn.Module] = []  # in a list: not a submodule, not synchronized

    @property
    def max_disp(self) -> Any:
        """The supernet's largest disparity (stereo; the trainer's loss reads it), else None."""
        return getattr(self.supernet, "max_disp", None)

    def set_teacher(self, teacher: nn.Module | None) -> None:
        """A frozen copy of the full network (OFA's knowledge distillation), or None."""
        self._teacher = []
        if teacher is not None:
            teacher = copy.deepcopy(teacher).eval()
            for p in teacher.parameters():
                p.requires_grad_(False)
            self._teacher.append(teacher)

    @property
    def teacher(self) -> nn.Module | None:
        """The distillation teacher, if set."""
        return self._teacher[0] if self._teacher else None

    def _apply(self, fn: Any, recurse: bool = True) -> MultiNet:  # .to(device) moves the teacher too
        super()._apply(fn, recurse)
        for t in self._teacher:
            t._apply(fn, recurse)
        return self

    def forward(self, x: torch.Tensor) -> Any:
        """Training: ``{"outputs": [one per configuration], "teacher": output or None,
        "touch": 0-valued tensor}`` (a dict: DDP and the engines walk it for tensors);
        evaluation: the active configuration's output."""
        if not self.training:
            return self.supernet(x)  # evaluation: the active configuration
        teacher_out = None
        if self._teacher:
            with torch.no_grad():
                teacher_out = self._teacher[0](x)
        outputs = []
        for config in self.configs:
            self.supernet.set_active(config)
            outputs.append(self.supernet(x))
        touch = sum((p.reshape(-1)[:1].sum() for p in self.supernet.parameters() if p.requires_grad),
                    torch.zeros((), device=x.device))
        return {"outputs": outputs, "teacher": teacher_out, "touch": touch * 0.0}

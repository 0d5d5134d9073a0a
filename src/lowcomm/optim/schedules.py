"""Per-step learning-rate schedules, and the re-warm-up a method may add on top.

Why the re-warm-up lives here and not in the method: the LR is the update axis's business. A
method that needs a temporary LR ramp (Pufferfish after its switch: the optimizer state was
reset, so the full LR at once makes the loss jump) declares it as a :class:`Rewarmup`, a pure
function of the global step; the scheduler multiplies it into the schedule. The optimizer's
``param_groups`` then always hold the LR actually used (logged as such), and the schedule
replays exactly on resume and after a rebuild, since nothing depends on hidden counters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lowcomm.runtime.config import TrainConfig


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int, total_steps: int) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps (linear warm-up first).

    For large global batches (docs/largebatch.md): scale the base LR linearly with the global
    batch (``lr = base_lr * global_batch / base_batch``, Goyal et al. 2017), warm up over a
    few epochs (``--lr-warmup-epochs``) and decay with ``poly`` (``--poly-power``) or ``cosine``.
    """
    warm = int(cfg.lr_warmup_epochs * steps_per_epoch)
    if warm and step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / span)))
    if cfg.schedule == "poly":
        return poly_factor(step - warm, total_steps - warm, cfg.poly_power)
    if cfg.schedule == "step":
        return cfg.gamma ** (step // max(1, cfg.step_size_epochs * steps_per_epoch))
    # multistep: milestones are fractions of training (<= 1) or epoch numbers (> 1)
    marks = [int(m * total_steps) if m <= 1 else int(m * steps_per_epoch) for m in cfg.milestones]
    return cfg.gamma ** sum(step >= m for m in marks)


def poly_factor(done: int, span: int, power: float) -> float:
    """Polynomial decay ``(1 - done/span) ** power`` from 1 to 0 over ``span`` steps.

    Why a schedule of its own: LARS/LAMB's large-batch recipes (You et al. 2017, 2019; Goyal
    et al. 2017 for the warm-up) decay the LR polynomially, power 2, to zero after a linear
    warm-up; cosine is the other common choice. The last step's factor is ``(1/span)**power``
    rather than 0, so no step is taken with LR 0.
    """
    span = max(1, span)
    return max(0.0, 1.0 - min(done, span - 1) / span) ** power


@dataclass(frozen=True)
class Rewarmup:
    """A linear LR ramp from ``1/length`` to 1 over ``length`` steps starting at global step
    ``start``; 1 before and after. Frozen: a new ramp is a new object, so a scheduler built
    from it can be rebuilt (or resumed) and replays the same LRs."""

    start: int
    length: int

    @classmethod
    def epochs(cls, start: int, epochs: float, steps_per_epoch: int) -> Rewarmup | None:
        """A ramp of ``epochs`` epochs (at least one step), or None for ``epochs <= 0``."""
        if epochs <= 0:
            return None
        return cls(start, max(1, int(round(epochs * steps_per_epoch))))

    def factor(self, step: int) -> float:
        """The LR multiplier of optimizer step ``step`` (0-based, global)."""
        done = step - self.start
        if done < 0 or done >= self.length:
            return 1.0
        return (done + 1) / self.length


#: A multiplier of the scheduled LR as a function of the global step (see
#: :meth:`lowcomm.methods.base.Method.lr_multiplier`).
LRMultiplier = Callable[[int], float]


def build_scheduler(
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    total_steps: int,
    multiplier: LRMultiplier | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The per-step scheduler of ``cfg``'s schedule, times ``multiplier(step)`` if given (a
    method's re-warm-up). Stepped once per optimizer step, skipped steps included (as with
    a GradScaler)."""
    if multiplier is None:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(cfg, step, steps_per_epoch, total_steps)
        )
    extra = multiplier
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, step, steps_per_epoch, total_steps) * extra(step)
    )


def advance(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """``scheduler.step()`` after the method's update, without torch's "lr_scheduler.step()
    before optimizer.step()" warning.

    Why: torch counts calls of ``optimizer.step`` to detect a schedule stepped too early, but
    DeAR and lee18 update through their own sharded steps (the hyperparameters recorded at
    the step), so on the first step torch warns about an order the trainer never gets wrong:
    it always calls the method's update first. Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before",
                                category=UserWarning)
        scheduler.step()

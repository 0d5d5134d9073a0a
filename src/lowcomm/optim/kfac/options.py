"""K-FAC's hyperparameters: validation, and values that may be callables of the step.

Why a module of its own: every hyperparameter may be a number or a function of the step (as
kfac-pytorch's ``LambdaParamScheduler`` allows), so a value is checked twice: a number when
the preconditioner is built, a callable's result each time it is used. Both checks are the
same function, so a bad schedule fails with the same message as a bad constant, naming the
option, the step and what is valid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from lowcomm.errors import UsageError, check_count, check_positive, check_range

from lowcomm.optim.kfac.placement import STRATEGIES

Schedule = Union[float, int, None, Callable[[int], Any]]

COMPUTE = ("eigen", "inverse")


def _check(name: str, value: Any) -> None:
    """Refuse a value of option ``name`` that has no meaning (message: what is valid)."""
    if name in ("factor_update_steps", "inv_update_steps"):
        check_count(name, value)
    elif name == "damping" or name == "lr":
        check_positive(name, value)
    elif name == "factor_decay":
        check_range(name, value, 0.0, 1.0, high_open=True)
    elif name == "kl_clip":
        if value is not None:
            check_positive(name, value)
    else:  # pragma: no cover - a programming error, not a user's
        raise KeyError(name)


@dataclass
class Hyper:
    """The scheduled hyperparameters; :meth:`at` gives their values at one step."""

    factor_update_steps: Schedule
    inv_update_steps: Schedule
    damping: Schedule
    factor_decay: Schedule
    kl_clip: Schedule
    lr: Schedule

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not callable(value):
                _check(name, value)

    def at(self, name: str, step: int) -> Any:
        """The value of ``name`` at ``step`` (a callable is called with the step, then checked)."""
        value = getattr(self, name)
        if callable(value):
            value = value(step)
            try:
                _check(name, value)
            except UsageError as e:
                raise UsageError(f"{e} (returned by the {name} schedule at step {step})") from None
        return value


def check_choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    """Refuse a value of a string option outside ``valid``."""
    if value not in valid:
        raise UsageError(f"{name} must be one of {', '.join(map(repr, valid))}, got {value!r}")


def check_static(*, compute: Any, placement: Any, grad_worker_fraction: Any, pipeline: Any,
                 symmetric_comm: Any, defer_factor_comm: Any = True, local_inverse_below: Any, skip_layers: Any,
                 accumulation_steps: Any, grad_scaler: Any) -> tuple[str, ...]:
    """Check the options that are not scheduled; return ``skip_layers`` as a tuple of str."""
    check_choice("compute", compute, COMPUTE)
    check_choice("placement", placement, STRATEGIES)
    check_range("grad_worker_fraction", grad_worker_fraction, 0.0, 1.0, low_open=True)
    for name, flag in (("pipeline", pipeline), ("symmetric_comm", symmetric_comm),
                       ("defer_factor_comm", defer_factor_comm)):
        if not isinstance(flag, bool):
            raise UsageError(f"{name} must be True or False, got {flag!r}")
    check_count("local_inverse_below", local_inverse_below, minimum=0)
    check_count("accumulation_steps", accumulation_steps)
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise UsageError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
    names = (skip_layers,) if isinstance(skip_layers, str) else skip_layers
    try:
        names = tuple(names)
    except TypeError:
        raise UsageError(f"skip_layers must be a name, a regex or a sequence of them, got {skip_layers!r}") from None
    if not all(isinstance(n, str) for n in names):
        raise UsageError(f"skip_layers must hold strings (layer names, class names or regexes), got {names!r}")
    return names


def grad_workers(fraction: float, world_size: int) -> int:
    """Gradient workers per layer, ``g = world_size * fraction`` (KAISA's rule).

    ``g = world_size`` (fraction 1): every rank receives the decompositions ("COMM-OPT");
    ``g = 1`` (fraction ``1/world_size``, or less: KAISA takes ``max(1, ...)``): the owner
    broadcasts the preconditioned gradient ("MEM-OPT", DP-KFAC); in between, the hybrid on a
    grid of ``world_size / g`` groups of ``g`` (:class:`~lowcomm.optim.kfac.placement.Grid`).
    ``g`` must be a whole number that divides ``world_size`` (the grid has equal groups);
    anything else is refused with the valid fractions for this world size.
    """
    exact = fraction * world_size
    workers = max(1, round(exact))
    whole = exact <= 1 or abs(exact - round(exact)) <= 1e-9 * world_size
    if not whole or world_size % workers:
        valid = ", ".join(f"{d}/{world_size} = {d / world_size:g}" for d in range(1, world_size + 1) if world_size % d == 0)
        raise UsageError(
            f"grad_worker_fraction={fraction} on {world_size} ranks gives {exact:g} gradient workers "
            f"per layer; it must give a whole number that divides {world_size} (the ranks are split "
            f"into equal groups of gradient workers); valid fractions on {world_size} ranks: {valid} "
            f"(1/{world_size} or less: DP-KFAC, one worker per layer; 1: every rank)")
    return workers

"""Optimizers built from a :class:`~lowcomm.runtime.config.TrainConfig`, and the settings a
method may ask to change before they are built.

Why one module: every place that needs an optimizer (the trainer at start, the trainer again
after Pufferfish's switch, the tests) must build the *same* one from the same settings; a
second builder would drift. Each optimizer is one entry of :data:`OPTIMIZER_FACTORIES`
(LARS/LAMB: :mod:`lowcomm.optim.lars`, :mod:`lowcomm.optim.lamb`, their keys parsed by
:mod:`lowcomm.optim.adaptive_spec`) and a name in ``kfac_spec.BASE_OPTIMIZERS``. K-FAC is
not one: it preconditions ``p.grad`` in front of one of these (``--optimizer kfac:base=...``,
:mod:`lowcomm.optim.kfac_spec`; the trainer runs it through :mod:`lowcomm.runtime.kfac_hook`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.optim.adaptive import EXCLUDE_KEY

if TYPE_CHECKING:
    from lowcomm.methods.base import Method
    from lowcomm.runtime.config import TrainConfig

_FLAG = {"lr": "--lr", "momentum": "--momentum", "nesterov": "--nesterov", "optimizer": "--optimizer",
         "weight_decay": "--weight-decay"}


def apply_method_overrides(cfg: TrainConfig, method: Method, moved: dict[str, Any] | None = None) -> list[str]:
    """Apply the optimizer settings ``method`` needs to ``cfg`` (in place); return the lines
    to print (on rank 0).

    The rule, as a PyTorch user would expect it: what you typed is what runs. A setting left
    at the trainer's default is changed when the method needs another one (a notice says
    so, with the reason); a setting given on the command line (``cfg.explicit_flags``) is
    kept, with a warning saying what the method would use and why. An override that
    presupposes another (Signum's lr rescaling presupposes SGD momentum off) is applied
    only together with it. Called before the optimizer is built, so every rebuild (e.g.
    Pufferfish's switch) sees the same settings.

    A setting the method *moves* (``moves``: momentum correction keeps the optimizer's
    momentum inside the codec) is changed even when typed, in a line of its own saying so;
    ``moved`` (if given) receives each moved field's value before the move (the trainer hands
    the momentum to the codec). An override with no ``field`` is a notice only.
    """
    lines: list[str] = []
    changes: list[str] = []
    reasons: list[str] = []
    moves: list[str] = []
    applied: set[str] = set()
    explicit = set(cfg.explicit_flags)
    for o in method.optimizer_overrides(cfg):
        if not o.field:
            lines.append(f"--method {method.name}: {o.why}")
            continue
        flag = _FLAG.get(o.field, "--" + o.field.replace("_", "-"))
        current = getattr(cfg, o.field)
        if any(r not in applied for r in o.requires):
            continue  # its premise was not applied (e.g. the user's own --momentum)
        if o.moves:
            setattr(cfg, o.field, o.value)
            applied.add(o.field)
            if moved is not None:
                moved[o.field] = current
            moves.append(f"{flag} {_fmt(current)} -> {_fmt(o.value)} ({o.why})")
            continue
        if o.field in explicit:
            if current != o.value and o.conflict:
                raise UsageError(f"--method {method.name} with {flag} {_fmt(current)}: {o.why}; "
                                 f"use {flag} {_fmt(o.value)} (or leave it out)")
            if current != o.value:
                lines.append(f"warning: --method {method.name}: keeping {flag} {_fmt(current)} as given, but "
                             f"{o.why} (its default here: {flag} {_fmt(o.value)})")
            continue
        setattr(cfg, o.field, o.value)
        applied.add(o.field)
        changes.append(f"{flag} {_fmt(current)} -> {_fmt(o.value)}")
        reasons.append(o.why)
    if changes:  # one line for everything changed, before the warnings
        lines.insert(0, f"--method {method.name}: {', '.join(changes)} ({'; '.join(reasons)}); "
                        "give them explicitly to keep your own")
    if moves:
        lines.insert(0, f"--method {method.name}: moved, not overridden: {', '.join(moves)}")
    return lines


def _fmt(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool) -> list[dict[str, Any]]:
    """One group, or two when norms and biases are exempt from weight decay (decaying a
    norm's scale or a bias only pulls it towards a value nobody asked for). The exempt group
    is also marked ``exclude_from_adaptation``: LARS/LAMB give it no trust ratio either (a
    layer-wise ratio of a bias or a norm's scale is noise; You et al. 2017, Jia et al. 2018);
    other optimizers ignore the key."""
    if not no_decay_norm_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (no_decay if isinstance(module, _NORM_TYPES) or name == "bias" or p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0, EXCLUDE_KEY: True}]


def _sgd(groups: list[dict[str, Any]], cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


def _adamw(groups: list[dict[str, Any]], cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr)


def _adaptive_options(cfg: TrainConfig) -> dict[str, Any]:
    """The lars/lamb keys of ``cfg`` with every default filled in (``kfac:base=lars`` and
    Python callers that skipped ``validate`` leave them empty)."""
    from lowcomm.optim.adaptive_spec import check_adaptive

    return check_adaptive(cfg.optimizer, dict(getattr(cfg, "optimizer_options", None) or {}))


def _lars(groups: list[dict[str, Any]], cfg: TrainConfig) -> torch.optim.Optimizer:
    from lowcomm.optim.lars import LARS

    return LARS(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **_adaptive_options(cfg))


def _lamb(groups: list[dict[str, Any]], cfg: TrainConfig) -> torch.optim.Optimizer:
    from lowcomm.optim.lamb import LAMB

    opts = _adaptive_options(cfg)
    betas = (opts.pop("beta1"), opts.pop("beta2"))
    return LAMB(groups, lr=cfg.lr, betas=betas, **opts)


#: ``--optimizer`` name -> factory(param groups, config). Every name is also in
#: ``lowcomm.optim.kfac_spec.BASE_OPTIMIZERS`` (which K-FAC's ``base=`` accepts too).
OPTIMIZER_FACTORIES: dict[str, Callable[[list[dict[str, Any]], TrainConfig], torch.optim.Optimizer]] = {
    "sgd": _sgd,
    "adamw": _adamw,
    "lars": _lars,
    "lamb": _lamb,
}


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` asks for over ``model``'s trainable parameters; called again
    after every re-wrap that changes the parameters (Pufferfish's switch resets its state)."""
    factory = OPTIMIZER_FACTORIES.get(cfg.optimizer)
    if factory is None:
        raise UsageError(f"unknown optimizer {cfg.optimizer!r}; valid: {', '.join(OPTIMIZER_FACTORIES)} "
                         "(K-FAC: TrainConfig.validate turns 'kfac:...' into one of them plus cfg.kfac)")
    exempt = cfg.no_decay_norm_bias
    if cfg.optimizer in ("lars", "lamb"):  # their excluded tensors get no decay either
        exempt = exempt or bool(_adaptive_options(cfg)["exclude_1d"])
    return factory(param_groups(model, cfg.weight_decay, exempt), cfg)

"""Optimizers and per-step learning-rate schedules built from a :class:`TrainConfig`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.runtime.config import TrainConfig

if TYPE_CHECKING:
    from lowcomm.methods.base import Method

_FLAG = {"lr": "--lr", "momentum": "--momentum", "nesterov": "--nesterov", "optimizer": "--optimizer",
         "weight_decay": "--weight-decay"}


def apply_method_overrides(cfg: TrainConfig, method: Method) -> list[str]:
    """Apply the optimizer settings ``method`` needs to ``cfg`` (in place); return the lines
    to print (on rank 0).

    The rule, as a PyTorch user would expect it: what you typed is what runs. A setting left
    at the trainer's default is changed when the method needs another one (a notice says
    so, with the reason); a setting given on the command line (``cfg.explicit_flags``) is
    kept, with a warning saying what the method would use and why. An override that
    presupposes another (Signum's lr rescaling presupposes SGD momentum off) is applied
    only together with it. Called before the optimizer is built, so every rebuild (e.g.
    Pufferfish's switch) sees the same settings.
    """
    lines: list[str] = []
    changes: list[str] = []
    reasons: list[str] = []
    applied: set[str] = set()
    explicit = set(cfg.explicit_flags)
    for o in method.optimizer_overrides(cfg):
        flag = _FLAG.get(o.field, "--" + o.field.replace("_", "-"))
        current = getattr(cfg, o.field)
        if any(r not in applied for r in o.requires):
            continue  # its premise was not applied (e.g. the user's own --momentum)
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
    return lines


def _fmt(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool) -> list[dict]:
    """One group, or two when norms and biases are exempt from weight decay."""
    if not no_decay_norm_bias or weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            (no_decay if isinstance(module, _NORM_TYPES) or name == "bias" or p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_norm_bias)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)


def lr_factor(cfg: TrainConfig, step: int, steps_per_epoch: int, total_steps: int) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps (linear warm-up first)."""
    warm = int(cfg.lr_warmup_epochs * steps_per_epoch)
    if warm and step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / span)))
    if cfg.schedule == "step":
        return cfg.gamma ** (step // max(1, cfg.step_size_epochs * steps_per_epoch))
    # multistep: milestones are fractions of training (<= 1) or epoch numbers (> 1)
    marks = [int(m * total_steps) if m <= 1 else int(m * steps_per_epoch) for m in cfg.milestones]
    return cfg.gamma ** sum(step >= m for m in marks)


def build_scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(cfg, step, steps_per_epoch, total_steps)
    )

"""``--optimizer lars[:key=value,...]`` and ``lamb[:...]``: the layer-wise optimizers' own keys.

Why apart from :mod:`lowcomm.optim.lars` / :mod:`lowcomm.optim.lamb`: the command line is
checked before any worker starts and must not import torch (as :mod:`kfac_spec`). The keys
are the optimizer's own; what the trainer already has a flag for (``--lr`` and its
schedule, ``--momentum``, ``--nesterov``, ``--weight-decay``) is refused as a key with the
flag to use, so there is one place for each setting. Parsed by the ``--method`` parser
(same ``key=value`` syntax, types from the dataclass fields, unknown keys refused with the
valid ones).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from lowcomm.errors import UsageError

#: keys the trainer sets from its own flags, with the flag (refused as keys)
FROM_FLAGS = {"lr": "--lr (and its schedule)", "momentum": "--momentum", "nesterov": "--nesterov",
              "weight_decay": "--weight-decay"}


@dataclass
class LARSOptions:
    """The keys of ``--optimizer lars:...`` with :class:`~lowcomm.optim.lars.LARS`'s defaults."""

    eta: float = 0.001
    eps: float = 1e-8
    trust_clip: float | None = None
    exclude_1d: bool = True
    foreach: bool = True


@dataclass
class LAMBOptions:
    """The keys of ``--optimizer lamb:...`` with :class:`~lowcomm.optim.lamb.LAMB`'s defaults
    (``betas`` split into ``beta1``/``beta2``: a tuple has no ``key=value`` spelling)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    bias_correction: bool = True
    trust_clip: float | None = None
    exclude_1d: bool = True
    foreach: bool = True


OPTIONS: dict[str, type] = {"lars": LARSOptions, "lamb": LAMBOptions}


def option_names(name: str) -> list[str]:
    """The keys ``--optimizer NAME:`` accepts, in order."""
    return [f.name for f in dataclasses.fields(OPTIONS[name])]


def _refuse_flag_keys(name: str, keys: list[str]) -> None:
    for key in keys:
        if key in FROM_FLAGS:
            raise UsageError(f"--optimizer {name}: {key} is set with {FROM_FLAGS[key]}, not as a key; "
                             f"valid keys: {', '.join(option_names(name))}")


def parse_adaptive(name: str, text: str) -> dict[str, Any]:
    """``('lars', 'eta=0.002')`` -> every key of ``name`` with its value, checked."""
    from lowcomm.methods.base import parse_options, split_top_level

    _refuse_flag_keys(name, [item.partition("=")[0].strip() for item in split_top_level(text)])
    try:
        opts = parse_options(name, OPTIONS[name], text)
    except UsageError as e:
        msg = str(e).replace(f"method {name!r}", f"--optimizer {name}").replace("method option", "option")
        raise UsageError(msg) from None
    return check_adaptive(name, dataclasses.asdict(opts))


def check_adaptive(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Refuse unknown keys and bad values; return every key set (defaults filled in). Also
    the check of ``TrainConfig(optimizer_options={...})`` from Python."""
    if not isinstance(options, dict):
        raise UsageError(f"optimizer_options must be a dict of {name} keys, got {type(options).__name__}")
    _refuse_flag_keys(name, list(options))
    valid = option_names(name)
    for key in options:
        if key not in valid:
            raise UsageError(f"unknown option {key!r} for --optimizer {name}; valid: {', '.join(valid)}")
    full = {**dataclasses.asdict(OPTIONS[name]()), **options}

    def number(key: str, low: float, high: float, *, low_open: bool = False) -> None:
        value = full[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > low if low_open else value >= low) and value < high
        if not ok:
            bracket = "(" if low_open else "["
            raise UsageError(f"--optimizer {name}: {key} must be a number in {bracket}{low:g}, {high:g}), "
                             f"got {value!r}")

    number("eps", 0.0, math.inf)
    if name == "lars":
        number("eta", 0.0, math.inf, low_open=True)
    else:
        number("beta1", 0.0, 1.0)
        number("beta2", 0.0, 1.0)
    if full["trust_clip"] is not None:
        number("trust_clip", 0.0, math.inf, low_open=True)
    for key in ("exclude_1d", "foreach") + (("bias_correction",) if name == "lamb" else ()):
        if not isinstance(full[key], bool):
            raise UsageError(f"--optimizer {name}: {key} must be true or false, got {full[key]!r}")
    return full

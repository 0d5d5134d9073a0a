"""``--optimizer kfac[:key=value,...]``: which base optimizer, and K-FAC's options.

Why apart from :mod:`lowcomm.optim.kfac`: the command line is checked before any worker
starts, and a plain ``--optimizer sgd`` must not pay for importing torch; only a ``kfac``
spec imports the parser and K-FAC's own checks (the same messages as the Python API).

``kfac:key=value,...`` is parsed by the ``--method`` parser
(:func:`lowcomm.methods.base.parse_options`: the same ``key=value`` syntax, types from the
fields of :class:`KFACOptions`, unknown keys refused with the valid ones). K-FAC
preconditions ``p.grad`` in front of a base optimizer (``base=sgd``, the default, ``adamw``,
``lars`` or ``lamb``, the last two with their default keys) built from the trainer's settings; the trainer gives it the scheduled LR and
its GradScaler (:mod:`lowcomm.runtime.kfac_hook`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lowcomm.errors import UsageError

if TYPE_CHECKING:
    from lowcomm.runtime.config import TrainConfig

#: base optimizers (``lowcomm.optim.builders.OPTIMIZER_FACTORIES``); ``kfac`` goes in front of one
BASE_OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
#: base optimizers with ``key=value`` options of their own (:mod:`lowcomm.optim.adaptive_spec`)
WITH_OPTIONS = ("lars", "lamb")
#: what ``--optimizer`` accepts, for messages and ``--help``
CHOICES = "sgd, adamw, lars[:key=value,...], lamb[:key=value,...], kfac[:key=value,...]"
PREFIX = "--optimizer kfac"

#: KFAC keywords that ``lowcomm train`` sets itself, with the reason (refused as keys)
NOT_FROM_CLI = {
    "lr": "follows --lr and its schedule (the trainer passes the current LR)",
    "grad_scaler": "is the trainer's own (fp16 --amp)",
    "accumulation_steps": "has no use here: lowcomm train takes one batch per optimizer step "
                          "(no gradient accumulation); the Python API has it",
}


@dataclass
class KFACOptions:
    """The keys of ``--optimizer kfac:...``: ``base`` plus :class:`~lowcomm.optim.kfac.KFAC`'s
    keywords, with its defaults (a test checks they agree). ``skip_layers`` is ``a|b|c``."""

    base: str = "sgd"
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    damping: float = 1e-3
    factor_decay: float = 0.95
    kl_clip: float | None = 1e-3
    compute: str = "eigen"
    placement: str = "balanced"
    grad_worker_fraction: float = 1.0
    pipeline: bool = True
    symmetric_comm: bool = True
    defer_factor_comm: bool = True
    local_inverse_below: int = 1024
    skip_layers: str = ""


def option_names() -> list[str]:
    """The keys ``--optimizer kfac:`` accepts, in order."""
    return [f.name for f in dataclasses.fields(KFACOptions)]


def _reworded(e: UsageError) -> UsageError:
    """The method parser's message, about ``--optimizer kfac`` instead of a method."""
    text = str(e).replace("method 'kfac'", PREFIX).replace("method option", "option")
    return UsageError(text)


def parse_kfac(text: str) -> tuple[str, dict[str, Any]]:
    """``'factor_update_steps=1,base=adamw'`` -> ``('adamw', {KFAC keyword: value})``, checked."""
    from lowcomm.methods.base import parse_options, split_top_level

    for item in split_top_level(text):
        key = item.partition("=")[0].strip()
        if key in NOT_FROM_CLI:
            raise UsageError(f"{PREFIX}: {key} {NOT_FROM_CLI[key]}; valid keys: {', '.join(option_names())}")
    try:
        opts = parse_options("kfac", KFACOptions, text)
    except UsageError as e:
        raise _reworded(e) from None
    values = dataclasses.asdict(opts)
    base = values.pop("base")
    return base, check_kfac(base, values)


def check_kfac(base: str, options: dict[str, Any]) -> dict[str, Any]:
    """Refuse an unknown key, a bad value or base; return the options with every key set.

    Also used for ``TrainConfig(kfac={...})`` from Python. The values are checked by K-FAC's
    own checks, so the messages are those of ``KFAC(...)``, prefixed with the option.
    """
    if base not in BASE_OPTIMIZERS:
        raise UsageError(f"{PREFIX}: base={base!r} is unknown; valid: {', '.join(BASE_OPTIMIZERS)}")
    keys = [k for k in option_names() if k != "base"]
    for key in options:
        if key in NOT_FROM_CLI:
            raise UsageError(f"{PREFIX}: {key} {NOT_FROM_CLI[key]}; valid keys: {', '.join(option_names())}")
        if key not in keys:
            raise UsageError(f"unknown option {key!r} for {PREFIX}; valid: {', '.join(option_names())}")
    defaults = dataclasses.asdict(KFACOptions())
    full = {k: options.get(k, defaults[k]) for k in keys}
    from lowcomm.methods.base import split_top_level
    from lowcomm.optim.kfac.options import Hyper, check_static

    skip = full["skip_layers"]
    if isinstance(skip, str):  # "a|b": bars inside parentheses belong to a regex
        skip = split_top_level(skip, sep="|")
    full["skip_layers"] = list(skip) if isinstance(skip, (list, tuple)) else skip

    try:
        Hyper(full["factor_update_steps"], full["inv_update_steps"], full["damping"], full["factor_decay"],
              full["kl_clip"], 0.1)
        check_static(compute=full["compute"], placement=full["placement"],
                     grad_worker_fraction=full["grad_worker_fraction"], pipeline=full["pipeline"],
                     symmetric_comm=full["symmetric_comm"], defer_factor_comm=full["defer_factor_comm"],
                     local_inverse_below=full["local_inverse_below"],
                     skip_layers=full["skip_layers"], accumulation_steps=1, grad_scaler=None)
    except UsageError as e:
        raise UsageError(f"{PREFIX}: {e}") from None
    return full


def resolve_optimizer(cfg: TrainConfig) -> None:
    """Turn ``cfg.optimizer = 'kfac[:...]'`` into the base optimizer's name plus ``cfg.kfac``
    (the options, every key set); check ``cfg.kfac`` when given directly. Idempotent: called
    by ``TrainConfig.validate`` and again by the trainer (Python callers may skip validate)."""
    name, colon, opts = str(cfg.optimizer).strip().partition(":")
    name = name.strip()
    if name == "kfac":
        cfg.optimizer, cfg.kfac = parse_kfac(opts)
        return
    if name not in BASE_OPTIMIZERS:
        raise UsageError(f"--optimizer {cfg.optimizer!r} is unknown; valid: {CHOICES}")
    if name in WITH_OPTIONS:  # lars/lamb: their keys, or cfg.optimizer_options from Python
        from lowcomm.optim.adaptive_spec import check_adaptive, parse_adaptive

        given = getattr(cfg, "optimizer_options", None) or {}
        cfg.optimizer_options = parse_adaptive(name, opts) if colon else check_adaptive(name, given)
    elif colon:
        raise UsageError(f"--optimizer {name} takes no options (only lars, lamb and kfac do: name:key=value,...)")
    elif getattr(cfg, "optimizer_options", None):
        raise UsageError(f"optimizer_options are for lars and lamb; --optimizer {name} takes none "
                         f"(got {sorted(cfg.optimizer_options)})")
    cfg.optimizer = name
    if cfg.kfac is not None:
        if not isinstance(cfg.kfac, dict):
            raise UsageError(f"kfac must be a dict of KFAC options or None, got {type(cfg.kfac).__name__}")
        cfg.kfac = check_kfac(name, cfg.kfac)

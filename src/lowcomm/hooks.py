"""Public entry point: attach a compression method to a DDP model.

>>> state = lowcomm.hooks.register(ddp_model, "powersgd", rank=4, start_iter=10)
>>> ckpt = state.state_dict(); ...; state.load_state_dict(ckpt)

Methods: ssgd, fp16, bf16, signsgd, signum, topk, gtopk, powersgd, acpsgd (see
docs/compression.md for options, byte formulas and the NaN policy).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from torch import nn

from lowcomm.comm.hooks import HOOKS, HookState, run_hook
from lowcomm.errors import UsageError


def options_for(method: str, **options: Any) -> Any:
    """Validated options dataclass of ``method`` (UsageError lists what is valid)."""
    cls = hook_class(method)
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(options) - fields)
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise UsageError(f"unknown option {unknown[0]!r} for method {method!r}; valid: {valid}")
    try:
        return cls.Options(**options)
    except TypeError as e:
        raise UsageError(f"invalid options for method {method!r}: {e}") from None


def hook_class(method: str) -> type[HookState]:
    try:
        return HOOKS[method]
    except KeyError:
        close = difflib.get_close_matches(method, HOOKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown compression method {method!r}{hint}; valid: {', '.join(sorted(HOOKS))}") from None


def register(ddp_model: nn.Module, method: str, *, process_group: Any = None, **options: Any) -> HookState:
    """Register ``method``'s comm hook on ``ddp_model``; return its state (checkpointable).

    ``method`` is a name or a ``name:key=value,...`` spec; keyword options win over the spec.
    """
    if ":" in method:
        from lowcomm.methods.base import parse_options

        method, _, text = method.partition(":")
        parsed = parse_options(method, hook_class(method).Options, text)
        options = {**dataclasses.asdict(parsed), **options}
    opts = options_for(method, **options)
    state = hook_class(method)(ddp_model, opts, process_group=process_group)
    ddp_model.register_comm_hook(state, run_hook)  # type: ignore[operator]
    return state


def methods() -> list[str]:
    return sorted(HOOKS)


__all__ = ["HookState", "methods", "options_for", "register"]

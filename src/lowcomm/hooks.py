"""Public entry point: attach a compression method to a DDP model.

>>> state = lowcomm.hooks.register(ddp_model, "powersgd", rank=4, start_iter=10)
>>> ckpt = state.state_dict(); ...; state.load_state_dict(ckpt)

Methods: ``ssgd`` and every compressor of :data:`lowcomm.compress.codec.CODECS` (see
:func:`methods`, and docs/compression.md for options, byte formulas and the NaN policy).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch.distributed as dist
from torch import nn

from lowcomm.comm.hooks import HOOKS, CodecHook, HookKind, run_hook
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


def hook_class(method: str) -> HookKind:
    """How to build ``method``'s hook (UsageError with a suggestion for unknown names)."""
    try:
        return HOOKS[method]
    except KeyError:
        close = difflib.get_close_matches(method, list(HOOKS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown compression method {method!r}{hint}; valid: {', '.join(sorted(HOOKS))}") from None


def register(ddp_model: nn.Module, method: str, *, process_group: dist.ProcessGroup | None = None, **options: Any) -> CodecHook:
    """Register ``method``'s comm hook on ``ddp_model``; return its state (checkpointable).

    ``method`` is a name or a ``name:key=value,...`` spec; keyword options win over the spec.
    """
    if ":" in method:
        from lowcomm.methods.base import parse_options

        method, _, text = method.partition(":")
        parsed = parse_options(method, hook_class(method).Options, text)
        options = {**dataclasses.asdict(parsed), **options}
    state = create(ddp_model, method, process_group=process_group, **options)
    ddp_model.register_comm_hook(state, run_hook)  # type: ignore[operator]
    return state


def create(ddp_model: nn.Module, method: str, *, process_group: dist.ProcessGroup | None = None, **options: Any) -> CodecHook:
    """``method``'s hook state with validated options, not registered (for callers that wrap
    :func:`~lowcomm.comm.hooks.run_hook` in a hook of their own)."""
    return hook_class(method)(ddp_model, options_for(method, **options), process_group=process_group)


def methods() -> list[str]:
    """Every method a hook can be registered for: ``ssgd`` and every registered codec."""
    return sorted(HOOKS)


#: the hook state's class (the name earlier releases exported)
HookState = CodecHook

__all__ = ["CodecHook", "HookState", "create", "methods", "options_for", "register"]

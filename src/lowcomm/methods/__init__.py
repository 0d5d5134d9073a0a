"""The ``--method`` namespace: one registry for every method, whatever axis it changes.

Use :func:`create` with a spec such as ``"acpsgd:rank=4"``. Every module of this package is
imported on the first lookup and registers its methods with :func:`register`, so a new
method is a new module here and nothing else lists it.
"""

from __future__ import annotations

from typing import Any, cast

from lowcomm.errors import UsageError
from lowcomm.methods.base import Method, MethodContext, parse_options, split_top_level
from lowcomm.registry import Registry

#: name -> method class; filled by the modules of :mod:`lowcomm.methods` (discovered, not listed)
METHODS: Registry[Method] = Registry("method", package=__name__)


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: register a :class:`Method` subclass under ``cls.name``."""
    METHODS.register(cls.name)(cls)
    return cls


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``: its ``Options`` and flags are read before building it."""
    return cast("type[Method]", METHODS.get(name))


def split_spec(spec: str) -> tuple[str, str]:
    """``'topk:density=0.01'`` -> ``('topk', 'density=0.01')``: the name picks the class, the
    rest is that class's options (parsed by :func:`create`)."""
    name, _, opts = spec.strip().partition(":")
    if not name:
        raise UsageError(f"empty method name in {spec!r}")
    return name.strip(), opts


def _continues_options(part: str) -> bool:
    """True for ``key=value`` (the text before the first ``:`` has a ``=``; a method name never
    does), which belongs to the previous method's options, even when the value is itself a
    spec (``then=acpsgd:rank=4``)."""
    return "=" in part.partition(":")[0]


def split_list(text: str) -> list[str]:
    """``'ssgd,topk:density=0.01,start_iter=2,fp16'`` -> ``['ssgd', 'topk:density=0.01,start_iter=2',
    'fp16']``: a ``key=value`` part continues the previous method's options.

    Why: one ``--methods`` flag lists several methods with their options and no second
    separator. Commas inside parentheses belong to a nested spec and do not split
    (``pufferfish:then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.25`` is one method).
    """
    specs: list[str] = []
    for part in split_top_level(text):
        if specs and _continues_options(part):
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def create(spec: str, **overrides: Any) -> Method:
    """Build a method from ``name[:key=value,...]``; keyword overrides win over the string."""
    name, opts = split_spec(spec)
    cls = method_class(name)
    options = parse_options(name, cls.Options, opts)
    for k, v in overrides.items():
        if not hasattr(options, k):
            raise UsageError(f"unknown option {k!r} for method {name!r}")
        setattr(options, k, v)
    if hasattr(options, "__post_init__"):
        options.__post_init__()
    return cls(options)


def names(include_timing_only: bool = False) -> list[str]:
    """Registered method names, sorted; timing-only references (``torch_fsdp``) are left out
    unless asked for, because they cannot train to a checkpoint."""
    return [n for n in METHODS.names() if include_timing_only or not method_class(n).timing_only]


__all__ = [
    "METHODS",
    "Method",
    "MethodContext",
    "create",
    "method_class",
    "names",
    "register",
    "split_list",
    "split_spec",
]

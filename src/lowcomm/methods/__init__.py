"""The ``--method`` namespace: one registry for every method, whatever axis it changes.

Use :func:`create` with a spec such as ``"acpsgd:rank=4"``. Method modules register
themselves with :data:`METHODS`; the registry imports the built-in modules on first lookup.
"""

from __future__ import annotations

from typing import Any

from lowcomm.errors import UsageError
from lowcomm.methods.base import Method, MethodContext, parse_options
from lowcomm.registry import Registry

METHODS: Registry[Method] = Registry(
    "method",
    modules=[
        "lowcomm.methods.ddp",
        "lowcomm.methods.compression",
        "lowcomm.sched.methods",
        "lowcomm.lowrank.method",
        "lowcomm.bench.fsdp_reference",  # torch_fsdp (FSDP2 shard-grad-op, timing reference)
        "lowcomm.bench.reference",  # torch_powersgd, torch_fp16 (PyTorch's own hooks, for comparison)
    ],
)

# Modules that register methods; each adds itself here.




def register(cls: type[Method]) -> type[Method]:
    """Class decorator: register a :class:`Method` subclass under ``cls.name``."""
    METHODS.register(cls.name)(cls)
    return cls


def split_spec(spec: str) -> tuple[str, str]:
    name, _, opts = spec.strip().partition(":")
    if not name:
        raise UsageError(f"empty method name in {spec!r}")
    return name.strip(), opts


def split_list(text: str) -> list[str]:
    """``'ssgd,topk:density=0.01,start_iter=2,fp16'`` -> ``['ssgd', 'topk:density=0.01,start_iter=2',
    'fp16']``: a part with ``=`` but no ``:`` continues the previous method's options."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def create(spec: str, **overrides: Any) -> Method:
    """Build a method from ``name[:key=value,...]``; keyword overrides win over the string."""
    name, opts = split_spec(spec)
    cls = METHODS.get(name)
    options = parse_options(name, cls.Options, opts)  # type: ignore[attr-defined]
    for k, v in overrides.items():
        if not hasattr(options, k):
            raise UsageError(f"unknown option {k!r} for method {name!r}")
        setattr(options, k, v)
    if hasattr(options, "__post_init__"):
        options.__post_init__()
    return cls(options)  # type: ignore[call-arg]


def names(include_timing_only: bool = False) -> list[str]:
    return [n for n in METHODS.names() if include_timing_only or not METHODS.get(n).timing_only]  # type: ignore[attr-defined]


__all__ = ["METHODS", "Method", "MethodContext", "create", "names", "register", "split_list", "split_spec"]

"""The ``--algorithm`` namespace of ``lowcomm fl``: built-in federated algorithms and user ones.

Every module of this package is imported on the first lookup and registers its algorithm
with :func:`register_algorithm`, so a new built-in is one new module. A user's algorithm
lives anywhere: decorate the class with :func:`register_algorithm` and import its module
(:func:`load_algorithm_module`) before :func:`create_algorithm` is called.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, TypeVar, cast

from lowcomm.errors import UsageError
from lowcomm.fl.api import Algorithm
from lowcomm.methods.base import parse_options
from lowcomm.registry import Registry

__all__ = [
    "ALGORITHMS",
    "algorithm_class",
    "algorithm_names",
    "check_algorithm_spec",
    "create_algorithm",
    "load_algorithm_module",
    "register_algorithm",
]

#: name -> algorithm class; filled by the modules of this package and by users' modules
ALGORITHMS: Registry[Algorithm] = Registry("algorithm", package=__name__)

A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(cls: A) -> A:
    """Class decorator: register an :class:`~lowcomm.fl.api.Algorithm` subclass under ``cls.name``.

    Importing the same module twice in one process (as ``__main__`` and by its name) keeps
    the first registration; a *different* class under a taken name is refused.
    """
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register_algorithm decorates Algorithm subclasses, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or ":" in name or "," in name:
        raise UsageError(f"algorithm class {cls.__qualname__} needs a class attribute `name` "
                         f"(a non-empty string without ':' or ','), got {name!r}")
    # a user's class: load the built-ins first so that a clash is found now, not later
    # (built-in modules skip this: they are the ones being loaded)
    if not cls.__module__.startswith(f"{__name__}.") and name in ALGORITHMS:
        existing = cast("type[Algorithm]", ALGORITHMS.get(name))
        if existing.__qualname__ == cls.__qualname__:
            return cls
        raise UsageError(f"algorithm name {name!r} is taken by {existing.__module__}.{existing.__qualname__}; "
                         f"pick another `name` for {cls.__module__}.{cls.__qualname__}")
    ALGORITHMS.register(name)(cls)
    return cls


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name`` (unknown names: :class:`UsageError` listing the valid ones)."""
    return cast("type[Algorithm]", ALGORITHMS.get(name))


def algorithm_names() -> list[str]:
    """Every registered algorithm name, sorted (aliases such as ``fedadam`` included)."""
    return ALGORITHMS.names()


def _parse(spec: str) -> tuple[type[Algorithm], Any]:
    name, _, opts = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise UsageError(f"empty algorithm name in {spec!r}; valid: {', '.join(algorithm_names())}")
    cls = algorithm_class(name)
    try:
        options = parse_options(name, cls.Options, opts)
    except UsageError as e:
        message = str(e).replace(f"method {name!r}", f"algorithm {name!r}")
        if f"{name!r}" not in message:
            message = f"algorithm {name!r}: {message}"
        raise UsageError(message) from None
    return cls, options


def check_algorithm_spec(spec: str) -> None:
    """Validate ``name[:key=value,...]`` without building anything (the CLI calls it before
    starting workers, so a typo is one line and exit 2, not N worker tracebacks)."""
    _parse(spec)


def create_algorithm(spec: str) -> Algorithm:
    """Build an algorithm from ``"fedprox:mu=0.01"``; unknown names or keys raise
    :class:`UsageError` with the valid ones. Call :meth:`Algorithm.setup` before use."""
    cls, options = _parse(spec)
    return cls(options)


def load_algorithm_module(ref: str) -> None:
    """Import a user's module so its ``@register_algorithm`` classes register.

    ``ref`` is a ``.py`` file path or a dotted module name. Why: worker processes are new
    interpreters; each must import the user's module before :func:`create_algorithm`.
    """
    if ref.endswith(".py") or "/" in ref or "\\" in ref:
        path = Path(ref).expanduser().resolve()
        if not path.is_file():
            raise UsageError(f"algorithm module {ref!r}: no such file (give a .py file or a dotted module name)")
        module_name = f"lowcomm_user_algorithm_{path.stem}"
        if module_name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"algorithm module {ref!r} cannot be imported (not a Python source file)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return
    try:
        importlib.import_module(ref)
    except ModuleNotFoundError as e:
        if e.name is not None and ref.startswith(e.name):
            raise UsageError(f"algorithm module {ref!r} not found (give a .py file or an importable module)") from None
        raise

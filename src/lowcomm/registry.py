"""A small name -> factory registry (timm's ``@register_model`` idea) with helpful errors.

Registries fill themselves lazily: the modules that hold the entries are imported on the
first lookup, so ``import lowcomm`` stays cheap and free of import cycles. A registry built
with ``package=`` imports *every* module of that package, so a new entry is one new module
and no list anywhere else has to be edited.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

from lowcomm.errors import UsageError

T = TypeVar("T")


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each public name in ``exports`` (name -> the
    module that defines it) is imported on first use, so importing the package (the CLI's help,
    its one-line errors) does not load torch-heavy modules."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


def package_modules(package: str) -> list[str]:
    """Dotted names of the public modules of ``package`` (no ``_private`` ones), sorted.

    Why: the registries discover their entries from the package contents instead of a
    hand-kept list that a new module could be forgotten in.
    """
    pkg = importlib.import_module(package)
    return sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


class Registry(Generic[T]):
    """Maps names to factories; unknown names raise :class:`UsageError` listing valid ones.

    ``modules`` are imported on first lookup: they hold the built-in entries and register
    themselves, so importing the package stays cheap and free of import cycles. ``package``
    adds every module of that package (see :func:`package_modules`) at that moment.
    """

    def __init__(self, kind: str, *, modules: Iterable[str] = (), package: str | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self.modules = list(modules)
        self.package = package
        self._loaded = False

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # before importing: the modules call register() on us
        try:
            if self.package is not None:
                self.modules += [m for m in package_modules(self.package) if m not in self.modules]
            for module in self.modules:
                importlib.import_module(module)
        except BaseException:
            # a module that fails to import fails every lookup, instead of leaving a registry
            # that silently lacks its entries ("unknown method ...; valid: <the rest>")
            self._loaded = False
            raise

    def register(self, name: str | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: ``@registry.register("name")`` (defaults to the function's name)."""

        def decorate(factory: Callable[..., T]) -> Callable[..., T]:
            key = name or factory.__name__
            if key in self._factories:
                raise RuntimeError(f"{self.kind} {key!r} registered twice")
            self._factories[key] = factory
            return factory

        return decorate

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name``; a typo gets a "did you mean" and the valid names."""
        self._ensure_loaded()
        try:
            return self._factories[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._factories, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(
                f"unknown {self.kind} {name!r}{hint}; valid: {', '.join(sorted(self._factories))}"
            ) from None

    def create(self, name: str, **kwargs: Any) -> T:
        """Call the factory registered as ``name`` with ``kwargs`` (the one-line build)."""
        return self.get(name)(**kwargs)

    def names(self) -> list[str]:
        """Every registered name, sorted: for ``--help`` texts, errors and completeness tests."""
        self._ensure_loaded()
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

"""A small name -> factory registry (timm's ``@register_model`` idea) with helpful errors."""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

from lowcomm.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories; unknown names raise :class:`UsageError` listing valid ones.

    ``modules`` are imported on first lookup: they hold the built-in entries and register
    themselves, so importing the package stays cheap and free of import cycles.
    """

    def __init__(self, kind: str, *, modules: Iterable[str] = ()) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self.modules = list(modules)
        self._loaded = False

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # before importing: the modules call register() on us
        for module in self.modules:
            importlib.import_module(module)

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
        return self.get(name)(**kwargs)

    def names(self) -> list[str]:
        self._ensure_loaded()
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

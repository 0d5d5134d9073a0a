"""A small name -> factory registry (timm's ``@register_model`` idea) with helpful errors."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Generic, Iterator, TypeVar

from lowcomm.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories; unknown names raise :class:`UsageError` listing valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

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
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

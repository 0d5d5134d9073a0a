"""Errors the user can fix. The CLI prints them as one line and exits 2, without a traceback."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user: an unknown name, an invalid number, a missing file.

    The message must say what was wrong and what is valid.
    """


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Refuse a non-positive number with a message naming the option."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UsageError(f"{name} must be {bound}, got {value}")


def check_fraction(name: str, value: float) -> None:
    """Refuse a value outside (0, 1]."""
    if not 0.0 < value <= 1.0:
        raise UsageError(f"{name} must be in (0, 1], got {value}")

"""Errors the user can fix. The CLI prints them as one line and exits 2, without a traceback.

The ``check_*`` helpers validate a number for what it *means*, not only its sign: ``nan``
compares false with everything, so a plain ``value < 0`` test lets ``nan`` through, and
``inf`` (also what ``float("1e400")`` gives) passes every lower bound. Both are refused
everywhere a real number is expected.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import TypeGuard

#: Upper bound for counts (epochs, steps, batch sizes, ranks, ...): anything larger cannot be
#: a real request and would overflow 32-bit sizes deep inside torch or gloo.
MAX_COUNT = 2**31 - 1


class UsageError(ValueError):
    """Bad input from the user: an unknown name, an invalid number, a missing file.

    The message must say what was wrong and what is valid.
    """


def _is_number(value: object) -> TypeGuard[Real]:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_finite(name: str, value: float) -> None:
    """Refuse ``nan``, ``±inf`` and non-numbers with a message naming the option."""
    if not _is_number(value) or not math.isfinite(float(value)):
        raise UsageError(f"{name} must be a finite number, got {value!r}")


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    """Refuse a non-positive or non-finite number with a message naming the option."""
    bound = ">= 0" if allow_zero else "> 0"
    if not _is_number(value) or not math.isfinite(float(value)):
        raise UsageError(f"{name} must be a finite number {bound}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{name} must be {bound}, got {value}")


def check_fraction(name: str, value: float) -> None:
    """Refuse a value outside (0, 1] (``nan`` included)."""
    if not _is_number(value) or not 0.0 < float(value) <= 1.0:
        raise UsageError(f"{name} must be in (0, 1], got {value!r}")


def check_range(name: str, value: float, low: float, high: float, *,
                low_open: bool = False, high_open: bool = False) -> None:
    """Refuse a value outside ``[low, high]`` (each end open on request), ``nan`` included."""
    ok = _is_number(value) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise UsageError(f"{name} must be in {interval}, got {value!r}")


def check_count(name: str, value: int, *, minimum: int = 1, maximum: int = MAX_COUNT) -> None:
    """Refuse a non-integer or an integer outside ``[minimum, maximum]``."""
    if not isinstance(value, Integral) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise UsageError(f"{name} must be an integer from {minimum} to {maximum}, got {value!r}")

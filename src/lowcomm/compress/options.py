"""Validation shared by the codecs' ``Options`` dataclasses (the ``--method name:key=value`` fields).

Common names: ``rank`` (low-rank codecs, default 4), ``density`` (top-k codecs, default
0.01), ``start_iter`` (plain all-reduce steps before compressing, default 10; a *duration*:
steps, ``"2ep"`` or ``"5%"`` of the run, see :func:`parse_duration`), ``error_feedback``
(default true), ``momentum_correction`` (default true: the optimizer's momentum moves into
the codec, see :meth:`lowcomm.compress.codec.Codec.accumulate`). Each codec module defines its own ``Options`` next to the
codec and calls these checks from ``__post_init__``, so an invalid value raises
:class:`~lowcomm.errors.UsageError` naming the option and the valid range wherever the
options are built (CLI, ``lowcomm.hooks.register``, the engine).
"""

from __future__ import annotations

import math

from lowcomm.errors import MAX_COUNT, UsageError, check_fraction, check_range


def check_start(start_iter: int | str) -> int | str:
    """``start_iter``: a duration (:func:`parse_duration`: steps, ``"Nep"`` or ``"N%"``; bool
    is refused: ``True`` is not a count). Returns the parsed value for the options to keep."""
    return parse_duration("start_iter", start_iter)


def check_rank(rank: int) -> None:
    """``rank``: an integer >= 1. It is clipped to each matrix's smaller side anyway; an
    astronomically large one is a typo, and would overflow tensor sizes before the clipping."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_COUNT:
        raise UsageError(f"rank must be an integer >= 1 (at most {MAX_COUNT}), got {rank!r}")


def check_density(density: float) -> None:
    """``density``: a number in (0, 1]."""
    if not isinstance(density, (int, float)) or isinstance(density, bool):
        raise UsageError(f"density must be a number in (0, 1], got {density!r}")
    check_fraction("density", float(density))


def check_min_rate(rate: float) -> None:
    """``min_compression_rate``: finite and > 0. nan would compare false with every layer's
    rate (silently never compressing), inf would mean the same; neither is what anyone asks for."""
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"min_compression_rate must be a finite number > 0, got {rate!r}")


def check_clip(clip: float) -> None:
    """``clip``: DGC's local clipping norm, a finite number >= 0 (0: off)."""
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or not math.isfinite(clip) or clip < 0:
        raise UsageError(f"clip must be a finite number >= 0 (0: no clipping), got {clip!r}")


def check_momentum(momentum: float) -> None:
    """``momentum``: in [0, 1) (1 would never forget, and never move)."""
    check_range("momentum", momentum, 0.0, 1.0, high_open=True)


# --- durations (``start_iter``, ``sparsity_warmup``) -------------------------------------------
#: A duration as an option holds it: an int (steps), ``"Nep"`` (N epochs, N a float),
#: ``"N%"`` (N percent of the run's total steps) or ``"min(A,B)"`` (the shorter of two).
Duration = int | str

DURATION_FORMS = ("an integer >= 0 (steps), 'Nep' (epochs, e.g. '2ep', '0.5ep'), 'N%' "
                  "(percent of the run's steps, e.g. '5%') or 'min(A,B)' (the shorter of two of "
                  "these, e.g. 'min(1.5ep,10%)')")


def _shorter_of(text: str) -> list[str] | None:
    """``"min(A,B)"`` -> ``["A", "B"]`` (the parts between the commas, stripped, however many);
    None for text that is not a ``min(...)``."""
    t = text.strip()
    if not (t.lower().startswith("min(") and t.endswith(")")):
        return None
    return [part.strip() for part in t[4:-1].split(",")]


def _relative(value: str) -> tuple[float, str]:
    """``"2ep"`` -> ``(2.0, "ep")``, ``"5%"`` -> ``(5.0, "%")``; ValueError otherwise."""
    text = value.strip().lower()
    for unit in ("ep", "%"):
        if text.endswith(unit):
            number = float(text[: -len(unit)])
            if not math.isfinite(number) or number < 0 or (unit == "%" and number > 100):
                raise ValueError(text)
            return number, unit
    raise ValueError(text)


def parse_duration(name: str, value: object) -> int | str:
    """Validate a duration option; returns the steps (int) or the canonical relative form.

    Accepted: an int >= 0 or a string of digits (steps), ``"Nep"`` (N >= 0 epochs, N a float),
    ``"N%"`` (0 <= N <= 100 percent of the run's total steps), ``"min(A,B)"`` (A and B two of
    the forms before: the shorter, so that a warm-up scales down with a short run without
    growing with a long one). Relative forms are returned as ``"<N>ep"`` / ``"<N>%"`` /
    ``"min(<A>,<B>)"`` (``"2.0EP"`` -> ``"2ep"``) and turned into steps by
    :func:`resolve_duration` once the run's length is known. Anything else (bool, negative,
    nan, ``"2 epochs"``, a nested ``min``) is a :class:`UsageError` naming ``name`` and the
    valid forms.
    """
    pair = _shorter_of(value) if isinstance(value, str) else None
    if pair is not None:
        if len(pair) == 2 and all(p and _shorter_of(p) is None for p in pair):
            try:
                a, b = (parse_duration(name, p) for p in pair)
            except UsageError:
                pass
            else:
                return f"min({a},{b})"
        raise UsageError(f"{name} must be {DURATION_FORMS}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value <= MAX_COUNT:
            return value
    elif isinstance(value, str):
        text = value.strip()
        if text.isdigit() and int(text) <= MAX_COUNT:
            return int(text)
        try:
            number, unit = _relative(text)
        except ValueError:
            pass
        else:
            return f"{number:g}{unit}"
    raise UsageError(f"{name} must be {DURATION_FORMS}, got {value!r}")


def is_relative(value: object) -> bool:
    """Whether a (parsed) duration needs the run's length: ``"Nep"``, ``"N%"`` or ``"min(...)"``."""
    return isinstance(value, str)


def resolve_duration(value: int | str, *, steps_per_epoch: int | None, total_steps: int | None,
                     default_steps: int | None, name: str = "duration") -> int:
    """Steps of a duration given the run's length (round half up).

    ``"Nep"`` needs ``steps_per_epoch``, ``"N%"`` needs ``total_steps`` (if only one is known
    the other is derived when possible: epochs from ``total_steps`` alone are not). When the
    needed information is missing: ``default_steps`` when given (an option left at a relative
    *default* falls back to a fixed count, silently), else a :class:`UsageError` telling to
    pass ``steps_per_epoch=`` / ``total_steps=`` to ``lowcomm.hooks.register`` or give steps.
    """
    parsed = parse_duration(name, value)
    if isinstance(parsed, int):
        return parsed
    pair = _shorter_of(parsed)
    if pair is not None:
        return min(resolve_duration(p, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                                    default_steps=default_steps, name=name) for p in pair)
    number, unit = _relative(parsed)
    base = steps_per_epoch if unit == "ep" else total_steps
    if base is None:
        if default_steps is not None:
            return int(default_steps)
        what = "steps_per_epoch=" if unit == "ep" else "total_steps="
        raise UsageError(
            f"{name}={parsed!r} is relative to the run's length, which is not known here: pass "
            f"{what} to lowcomm.hooks.register (or to the codec's set_run), or give {name} in steps")
    scale = number if unit == "ep" else number / 100.0
    return min(MAX_COUNT, int(math.floor(scale * int(base) + 0.5)))

"""Validation shared by the codecs' ``Options`` dataclasses (the ``--method name:key=value`` fields).

Common names: ``rank`` (low-rank codecs, default 4), ``density`` (top-k codecs, default
0.01), ``start_iter`` (plain all-reduce steps before compressing, default 10),
``error_feedback`` (default true). Each codec module defines its own ``Options`` next to the
codec and calls these checks from ``__post_init__``, so an invalid value raises
:class:`~lowcomm.errors.UsageError` naming the option and the valid range wherever the
options are built (CLI, ``lowcomm.hooks.register``, the engine).
"""

from __future__ import annotations

import math

from lowcomm.errors import MAX_COUNT, UsageError, check_fraction, check_range


def check_start(start_iter: int) -> None:
    """``start_iter``: a non-negative integer (bool is refused: ``True`` is not a count)."""
    if not isinstance(start_iter, int) or isinstance(start_iter, bool) or not 0 <= start_iter <= MAX_COUNT:
        raise UsageError(f"start_iter must be an integer >= 0 (at most {MAX_COUNT}), got {start_iter!r}")


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


def check_momentum(momentum: float) -> None:
    """``momentum``: in [0, 1) (1 would never forget, and never move)."""
    check_range("momentum", momentum, 0.0, 1.0, high_open=True)

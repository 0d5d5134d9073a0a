"""Option dataclasses of the compression hooks (also the ``--method name:key=value`` fields).

Common names: ``rank`` (low-rank methods, default 4), ``density`` (top-k methods, default
0.01), ``start_iter`` (plain all-reduce steps before compressing, default 10),
``error_feedback`` (default true). Invalid values raise :class:`UsageError` naming the option
and the valid range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowcomm.errors import MAX_COUNT, UsageError, check_fraction, check_range


def _check_start(start_iter: int) -> None:
    if not isinstance(start_iter, int) or isinstance(start_iter, bool) or not 0 <= start_iter <= MAX_COUNT:
        raise UsageError(f"start_iter must be an integer >= 0 (at most {MAX_COUNT}), got {start_iter!r}")


def _check_rank(rank: int) -> None:
    # The rank is clipped to each matrix's smaller side anyway; an astronomically large one
    # is a typo, and would overflow tensor sizes before the clipping happens.
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_COUNT:
        raise UsageError(f"rank must be an integer >= 1 (at most {MAX_COUNT}), got {rank!r}")


def _check_density(density: float) -> None:
    if not isinstance(density, (int, float)) or isinstance(density, bool):
        raise UsageError(f"density must be a number in (0, 1], got {density!r}")
    check_fraction("density", float(density))


def _check_min_rate(rate: float) -> None:
    # nan would compare false with every layer's rate (silently never compressing), inf
    # would mean the same; neither is what anyone asks for.
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"min_compression_rate must be a finite number > 0, got {rate!r}")


@dataclass
class CastOptions:
    """fp16 / bf16 take no options."""


@dataclass
class SignOptions:
    start_iter: int = 10
    error_feedback: bool = True

    def __post_init__(self) -> None:
        _check_start(self.start_iter)


@dataclass
class SignumOptions:
    start_iter: int = 10
    momentum: float = 0.9

    def __post_init__(self) -> None:
        _check_start(self.start_iter)
        check_range("momentum", self.momentum, 0.0, 1.0, high_open=True)


@dataclass
class TopKOptions:
    density: float = 0.01
    start_iter: int = 10
    error_feedback: bool = True
    fast_select: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _check_density(self.density)
        _check_start(self.start_iter)


@dataclass
class LowRankOptions:
    rank: int = 4
    start_iter: int = 10
    error_feedback: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_rank(self.rank)
        _check_start(self.start_iter)
        _check_min_rate(self.min_compression_rate)


@dataclass
class PowerSGDOptions(LowRankOptions):
    warm_start: bool = True

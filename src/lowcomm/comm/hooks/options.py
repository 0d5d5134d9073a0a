"""Option dataclasses of the compression hooks (also the ``--method name:key=value`` fields).

Common names: ``rank`` (low-rank methods, default 4), ``density`` (top-k methods, default
0.01), ``start_iter`` (plain all-reduce steps before compressing, default 10),
``error_feedback`` (default true). Invalid values raise :class:`UsageError` naming the option
and the valid range.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.errors import UsageError, check_fraction


def _check_start(start_iter: int) -> None:
    if not isinstance(start_iter, int) or start_iter < 0:
        raise UsageError(f"start_iter must be an integer >= 0, got {start_iter!r}")


def _check_rank(rank: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UsageError(f"rank must be an integer >= 1, got {rank!r}")


def _check_density(density: float) -> None:
    if not isinstance(density, (int, float)) or isinstance(density, bool):
        raise UsageError(f"density must be a number in (0, 1], got {density!r}")
    check_fraction("density", float(density))


def _check_min_rate(rate: float) -> None:
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise UsageError(f"min_compression_rate must be a number > 0, got {rate!r}")


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
        if not isinstance(self.momentum, (int, float)) or not 0.0 <= self.momentum < 1.0:
            raise UsageError(f"momentum must be in [0, 1), got {self.momentum!r}")


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

"""Float tolerances that follow from the dtype and the computation, never tuned to pass once.

Why this exists: two correct implementations of the same float computation (a batched vs a
per-matrix QR, a ring all-reduce vs a reduce-scatter + all-gather, DDP buckets of different
sizes, a fused vs a plain kernel) round differently, and the difference depends on the
machine (BLAS/LAPACK code path, thread count). A bound like ``<= 1e-5`` that passed on one
machine failed on another (1.21e-5, issue 10). Instead every comparison here states an error
model:

    |actual - expected|_max  <=  ops * cond * eps(dtype) * |expected|_max

* ``eps(dtype)`` is ``torch.finfo(dtype).eps`` (= 2u, u the unit round-off). Each rounding
  adds at most u relative error to *each* of the two implementations, so one eps per
  rounding step covers both sides of the comparison.
* ``ops`` is the number of rounding steps along the longest dependency chain that the two
  implementations may order differently (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., §3.1: a sum of n terms has relative error <= (n-1)u in the worst
  case; §3.6: in practice errors grow like sqrt(n)). Every call site says how it counted.
* ``cond`` is the condition number of the most sensitive step (1 for sums and products;
  kappa of the factor for a QR, whose Q factor's forward error is kappa times its backward
  error).

The norm is the max-norm of the whole tensor (normwise, not elementwise): an element that is
tiny because of cancellation is compared at the scale of the tensor it belongs to, which is
the scale its round-off has.
"""

from __future__ import annotations

from typing import Iterable

import torch


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype`` (float32: 1.19e-7, float64: 2.2e-16)."""
    return float(torch.finfo(dtype).eps)


def tolerance(dtype: torch.dtype, *, ops: float, cond: float = 1.0) -> float:
    """Relative (normwise) bound ``ops * cond * eps(dtype)``; see the module docstring."""
    if ops < 1 or cond < 1:
        raise ValueError(f"ops and cond must be >= 1, got ops={ops}, cond={cond}")
    return float(ops) * float(cond) * eps(dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|``, computed in float64 (0 when both are 0)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    diff = float((a - e).abs().max()) if a.numel() else 0.0
    scale = float(e.abs().max()) if e.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def max_rel_err(actual: Iterable[torch.Tensor], expected: Iterable[torch.Tensor]) -> float:
    """Worst :func:`rel_err` over paired tensors (e.g. every parameter of two models)."""
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        worst = max(worst, rel_err(a, e))
    return worst


def assert_close_eps(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    ops: float,
    cond: float = 1.0,
    msg: object = "",
) -> None:
    """Assert ``rel_err(actual, expected) <= tolerance(dtype, ops=ops, cond=cond)``.

    ``dtype`` is the precision the computation ran in (default: ``actual.dtype``); compare a
    float32 result against a float64 reference with ``dtype=torch.float32``. The failure
    message gives the error in units of eps, which is what to reason about.
    """
    dtype = dtype or actual.dtype
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    err = rel_err(actual, expected)
    tol = tolerance(dtype, ops=ops, cond=cond)
    if not err <= tol:
        raise AssertionError(
            f"{msg}: relative error {err:.3g} = {err / eps(dtype):.1f} eps({dtype}) exceeds "
            f"ops*cond = {ops:g}*{cond:.3g} = {ops * cond:.1f} eps ({tol:.3g})"
        )

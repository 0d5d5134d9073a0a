"""Low-rank products with a tall output, compiled by numba: ``out = a bᵀ`` and its residual.

Why compiled: writing a rank-``r`` product ``P Qᵀ`` (``r`` = 1-32) is an outer-product sum
whose cost is writing the ``n x m`` result; MKL's GEMM treats it as a general product with an
inner dimension of ``r`` and writes it at about 7 GB/s on the 2-vCPU machine where the copy
bandwidth is 40+ GB/s (issue 18: ACP-SGD's decode at 5-7x its memory bound). Here a chunk of output
rows is formed in L1 (one pass per four terms, the partial sums in registers) and written once; Power-SGD's rebuild writes
the residual ``M - P Qᵀ`` and the product from the same row. Results differ from MKL's only by
float summation order (the ``r`` terms are added in order, without fused multiply-adds);
numba is optional (:mod:`lowcomm.compress.native`).
"""

from __future__ import annotations

import numba
import numpy as np


CHUNK_FLOATS = 8192  # rows formed at a time: up to 32 KiB of output, so the temporary stays in L1


@numba.njit(inline="always", cache=True)
def _terms(dst: np.ndarray, a: np.ndarray, bt: np.ndarray, q: int, add: bool) -> None:  # pragma: no cover
    """``dst (+)= a[:, q:q+k] @ bt[q:q+k]`` for the next ``k <= 4`` terms in one pass: each
    partial sum stays in a register and each element of ``dst`` is written once per four terms
    (a pass per term wrote it ``r`` times: half the write speed). Terms added in order. The
    branches sit outside the row loop and ``bt`` is indexed in two dimensions: a row slice per
    term and row cost more than the pass itself on 512-wide rows."""
    k = min(4, a.shape[1] - q)
    n, m = dst.shape
    if k == 1:
        for i in range(n):
            a0, row = a[i, q], dst[i]
            if add:
                for j in range(m):
                    row[j] = row[j] + a0 * bt[q, j]
            else:
                for j in range(m):
                    row[j] = a0 * bt[q, j]
    elif k == 2:
        for i in range(n):
            a0, a1, row = a[i, q], a[i, q + 1], dst[i]
            if add:
                for j in range(m):
                    row[j] = (row[j] + a0 * bt[q, j]) + a1 * bt[q + 1, j]
            else:
                for j in range(m):
                    row[j] = a0 * bt[q, j] + a1 * bt[q + 1, j]
    elif k == 3:
        for i in range(n):
            a0, a1, a2, row = a[i, q], a[i, q + 1], a[i, q + 2], dst[i]
            if add:
                for j in range(m):
                    row[j] = ((row[j] + a0 * bt[q, j]) + a1 * bt[q + 1, j]) + a2 * bt[q + 2, j]
            else:
                for j in range(m):
                    row[j] = (a0 * bt[q, j] + a1 * bt[q + 1, j]) + a2 * bt[q + 2, j]
    elif add:
        for i in range(n):
            a0, a1, a2, a3, row = a[i, q], a[i, q + 1], a[i, q + 2], a[i, q + 3], dst[i]
            for j in range(m):
                row[j] = (((row[j] + a0 * bt[q, j]) + a1 * bt[q + 1, j]) + a2 * bt[q + 2, j]) + a3 * bt[q + 3, j]
    else:
        for i in range(n):
            a0, a1, a2, a3, row = a[i, q], a[i, q + 1], a[i, q + 2], a[i, q + 3], dst[i]
            for j in range(m):
                row[j] = ((a0 * bt[q, j] + a1 * bt[q + 1, j]) + a2 * bt[q + 2, j]) + a3 * bt[q + 3, j]


@numba.njit(inline="always", cache=True)
def _product(dst: np.ndarray, a: np.ndarray, bt: np.ndarray) -> None:  # pragma: no cover - compiled
    """``dst <- a @ bt`` for a chunk of rows small enough to stay in cache between passes."""
    for q in range(0, a.shape[1], 4):
        _terms(dst, a, bt, q, q > 0)


@numba.njit(inline="always", cache=True)
def _chunk_rows(m: int) -> int:  # pragma: no cover - compiled
    """Rows of width ``m`` formed at a time: :data:`CHUNK_FLOATS` elements, at least one row."""
    return max(1, CHUNK_FLOATS // max(1, m))


@numba.njit(nogil=True, cache=True)
def outer_into(out: np.ndarray, a: np.ndarray, bt: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out (n x m) <- a (n x r) @ bt (r x m)``, a chunk of rows at a time."""
    h = _chunk_rows(out.shape[1])
    for i0 in range(0, out.shape[0], h):
        i1 = min(out.shape[0], i0 + h)
        _product(out[i0:i1], a[i0:i1], bt)


@numba.njit(nogil=True, cache=True)
def rebuild(target: np.ndarray, mat: np.ndarray, a: np.ndarray, bt: np.ndarray,
            residual: np.ndarray) -> None:  # pragma: no cover - compiled
    """``residual <- mat - a @ bt`` and ``target <- a @ bt``, a chunk of rows at a time
    (``target`` may be ``mat``: each chunk of ``mat`` is read before it is overwritten)."""
    n, m = target.shape
    h = _chunk_rows(m)
    t = np.empty((h, m), dtype=target.dtype)
    for i0 in range(0, n, h):
        i1 = min(n, i0 + h)
        tc = t[: i1 - i0]
        _product(tc, a[i0:i1], bt)
        for i in range(i1 - i0):
            mi, ri, oi, ti = mat[i0 + i], residual[i0 + i], target[i0 + i], tc[i]
            for j in range(m):
                ri[j] = mi[j] - ti[j]
                oi[j] = ti[j]


@numba.njit(nogil=True, cache=True)
def sub_outer(x: np.ndarray, a: np.ndarray, bt: np.ndarray) -> None:  # pragma: no cover - compiled
    """``x -= a @ bt``, a chunk of rows at a time."""
    n, m = x.shape
    h = _chunk_rows(m)
    t = np.empty((h, m), dtype=x.dtype)
    for i0 in range(0, n, h):
        i1 = min(n, i0 + h)
        tc = t[: i1 - i0]
        _product(tc, a[i0:i1], bt)
        for i in range(i1 - i0):
            xi, ti = x[i0 + i], tc[i]
            for j in range(m):
                xi[j] -= ti[j]


@numba.njit(inline="always", cache=True)
def _axpy(a: np.float32, x: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover - compiled
    """``y += a x`` over 1-d slices."""
    for j in range(x.shape[0]):
        y[j] += a * x[j]


@numba.njit(inline="always", cache=True)
def _dot(x: np.ndarray, y: np.ndarray) -> np.float32:  # pragma: no cover - compiled
    """``x · y`` over 1-d slices (vectorized where the caller allows reassociation)."""
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        s += x[j] * y[j]
    return s


@numba.njit(inline="always", cache=True)
def _accumulate(e: np.ndarray, g: np.ndarray, u: np.ndarray, momentum: float,
                stage: bool, scale: float) -> None:  # pragma: no cover - compiled
    """ACP-SGD's velocity stage on one row (slice) of the gradient ``g`` clipped by ``scale``
    (1.0: no clipping, exact): ``u <- scale g + momentum u``, ``e += u`` with ``stage``, else
    ``e += scale g`` (``u`` unread)."""
    if stage:
        for j in range(e.shape[0]):
            u[j] = scale * g[j] + momentum * u[j]
            e[j] += u[j]
    else:
        for j in range(e.shape[0]):
            e[j] += scale * g[j]


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def p_step_rows(g: np.ndarray, e: np.ndarray, u: np.ndarray, ft: np.ndarray, out: np.ndarray,
                momentum: float, stage: bool, mask: bool, scale: float) -> None:  # pragma: no cover - compiled
    """ACP-SGD's P-step encode of one ``n x m`` matrix, one row at a time while it is in L1:
    with ``stage``, ``u_i <- g_i + momentum u_i`` and ``e_i += u_i`` (else ``e_i += g_i``);
    ``out_i = e_i F`` (``ft`` is ``Fᵀ``, ``r x m``); ``e_i -= out_i Fᵀ``; with ``mask``,
    ``u_i -= (u_i F) Fᵀ``. ``g``, ``e`` and ``u`` are read and written once. Reassociation is
    allowed here (the row sums vectorize; the results differ from BLAS's by summation order,
    as BLAS's differ between machines). ``g`` enters scaled by ``scale`` (the clipping)."""
    r = ft.shape[0]
    w = np.empty(r, dtype=e.dtype)
    for i in range(e.shape[0]):
        ei = e[i]
        _accumulate(ei, g[i], u[i] if stage else ei, momentum, stage, scale)
        for q in range(r):
            out[i, q] = _dot(ei, ft[q])
        for q in range(r):
            _axpy(-out[i, q], ft[q], ei)
        if mask:
            ui = u[i]
            for q in range(r):
                w[q] = _dot(ui, ft[q])
            for q in range(r):
                _axpy(-w[q], ft[q], ui)


@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def q_step_cols(g: np.ndarray, e: np.ndarray, u: np.ndarray, f: np.ndarray, out: np.ndarray,
                momentum: float, stage: bool, mask: bool, block: int, scale: float) -> None:  # pragma: no cover
    """ACP-SGD's Q-step encode of one ``n x m`` matrix by column blocks of ``block`` columns
    (all rows of a block stay in L2): the velocity stage and ``e += u`` (or ``g``) while
    ``Qᵀ += F[i] ⊗ e_i`` (and, with ``mask``, ``Wᵀ += F[i] ⊗ u_i``) accumulate row by row; then
    ``e_i -= F[i] Qᵀ`` and ``u_i -= F[i] Wᵀ``; ``out = Q`` (``m x r``). The block's rows are
    read from memory once; reassociation allowed as in :func:`p_step_rows`."""
    n, m = e.shape
    r = f.shape[1]
    qt = np.empty((r, block), dtype=e.dtype)
    wt = np.empty((r, block), dtype=e.dtype)
    for c0 in range(0, m, block):
        c1 = min(m, c0 + block)
        w = c1 - c0
        qt[:, :w] = 0.0
        wt[:, :w] = 0.0
        for i in range(n):
            ei = e[i, c0:c1]
            _accumulate(ei, g[i, c0:c1], u[i, c0:c1] if stage else ei, momentum, stage, scale)
            for q in range(r):
                _axpy(f[i, q], ei, qt[q, :w])
            if mask:
                ui = u[i, c0:c1]
                for q in range(r):
                    _axpy(f[i, q], ui, wt[q, :w])
        for i in range(n):
            ei = e[i, c0:c1]
            for q in range(r):
                _axpy(-f[i, q], qt[q, :w], ei)
            if mask:
                ui = u[i, c0:c1]
                for q in range(r):
                    _axpy(-f[i, q], wt[q, :w], ui)
        for j in range(w):
            for q in range(r):
                out[c0 + j, q] = qt[q, j]

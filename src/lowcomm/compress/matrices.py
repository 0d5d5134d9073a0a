"""Low-rank tensor math shared by the ``powersgd`` and ``acpsgd`` codecs (:mod:`lowcomm.compress.lowrank`).

Why apart from the codecs: these are pure functions of shapes and tensors (matrix views,
which tensors are worth compressing, seeded initial factors, batched products, the per-buffer
plan), used by the codecs and by tests that recompute the papers' formulas centrally.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch

from lowcomm.compress import native
from lowcomm.compress.base import cpu_fast


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """View an n-d gradient as ``shape[0] x prod(shape[1:])`` (as PowerSGD does)."""
    return int(shape[0]), int(math.prod(shape[1:]))


def should_compress(shape: Sequence[int], rank: int, min_compression_rate: float) -> bool:
    """Compress iff the tensor is >= 2-D and ``(n + m) * r * min_rate < n * m``."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = min(rank, n, m)
    return (n + m) * r * min_compression_rate < n * m


def effective_rank(shape: Sequence[int], rank: int) -> int:
    """The rank clipped to the matrix's smaller side."""
    n, m = matrix_shape(shape)
    return min(rank, n, m)


def orthogonalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` (batched ``(..., n, r)``), via reduced QR in fp32.

    QR (not Gram-Schmidt) so zero or dependent columns give no NaN. Deterministic for equal
    inputs, so every rank derives the same factor from the same all-reduced tensor. Each
    column is oriented so that ``R``'s diagonal is positive (LAPACK and cuSOLVER leave the
    sign to the Householder reflection): the orientation Gram-Schmidt gives, so this and the
    device paths' :func:`orthogonalize_all` send the same factors up to round-off.
    """
    q, r = torch.linalg.qr(x.to(torch.float32), mode="reduced")
    sign = torch.diagonal(r, dim1=-2, dim2=-1).sign()
    q = q * torch.where(sign == 0, torch.ones_like(sign), sign).unsqueeze(-2)
    return q.to(x.dtype)


#: a column whose norm left after the projections is below this fraction of its norm before
#: them is dependent on the earlier columns and set to zero (float32's unit round-off times 64)
DEPENDENT_RTOL = 64 * torch.finfo(torch.float32).eps


def orthogonalize_all(xs: Sequence[torch.Tensor], finite: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Orthonormal columns spanning each batch ``(b_i, n_i, r_i)`` of ``xs``: :func:`orthogonalize`
    per batch on CPU; on other devices all batches in one padded batch by Gram-Schmidt.

    Why two forms: a buffer holds one batch per matrix shape (21 on ResNet-50), and on a GPU
    ``torch.linalg.qr`` loops over the batch in cuSOLVER, two calls per matrix with host-side
    work each (about 0.4 ms per batch measured on an H100, docs/kernels.md): more than the
    rest of the codec. Here the factors are zero-padded to the largest ``n x r`` (zero rows
    and columns change no inner product) and orthonormalized by classical Gram-Schmidt run
    twice ("twice is enough": orthogonal to working precision for any factor whose columns
    are not dependent), a fixed ~10 launches per column whatever the number of matrices.
    Same span, so the low-rank products ``M F F^T`` and everything the codecs send or write
    from them agree with QR's up to round-off; a column's sign may differ from QR's (the
    products do not see it). A dependent or zero column becomes zero instead of QR's
    arbitrary completion (the factor loses a rank, as the matrix has). Deterministic, so
    every rank derives the same basis from the same summed factor.

    ``finite`` (0-dim flag, optional): where it is False each batch comes back as it came
    (the poison travels on), without a host read, as
    :func:`~lowcomm.compress.feedback.orthogonalize_if` does."""
    if not xs:
        return []
    if cpu_fast(*xs):
        if finite is None:
            return [orthogonalize(x) for x in xs]
        from lowcomm.compress.feedback import orthogonalize_if  # (feedback imports this module)

        return [orthogonalize_if(x, finite) for x in xs]
    rows = max(x.shape[1] for x in xs)
    cols = max(x.shape[2] for x in xs)
    total = sum(x.shape[0] for x in xs)
    pad = xs[0].new_zeros(total, rows, cols, dtype=torch.float32)
    at = 0
    for x in xs:  # (one small copy per batch: cheap launches, no solver calls)
        pad[at : at + x.shape[0], : x.shape[1], : x.shape[2]].copy_(x)
        at += x.shape[0]
    if finite is None:
        q = _gram_schmidt_twice_(pad)
    else:  # Gram-Schmidt on zeros where the input is not finite, then the input itself back
        q = _gram_schmidt_twice_(torch.where(finite, pad, torch.zeros((), dtype=pad.dtype, device=pad.device)))
        q = torch.where(finite, q, pad)
    out, at = [], 0
    for x in xs:
        out.append(q[at : at + x.shape[0], : x.shape[1], : x.shape[2]].to(x.dtype))
        at += x.shape[0]
    return out


def _gram_schmidt_twice_(q: torch.Tensor) -> torch.Tensor:
    """``q`` (``(b, n, r)``, float32) made orthonormal in place, each ``(n, r)`` matrix column
    by column, each projected off the earlier ones twice (classical Gram-Schmidt with
    re-orthogonalization), then normalized; dependent columns set to zero (see
    :data:`DEPENDENT_RTOL`). Branch-free: no host reads. Returns ``q``."""
    tiny = torch.finfo(q.dtype).tiny
    for k in range(q.shape[2]):
        col = q[:, :, k : k + 1]
        before = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        if k:
            done = q[:, :, :k]
            for _ in range(2):
                col.sub_(torch.bmm(done, torch.bmm(done.transpose(1, 2), col)))
        after = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        keep = (after > DEPENDENT_RTOL * before) & (after > tiny)
        col.mul_(torch.where(keep, after.clamp_min(tiny).reciprocal(), torch.zeros_like(after)))
    return q


def factor_seed(seed: int, param_index: int, salt: int) -> int:
    """Seed of a parameter's initial factor: same on every rank, distinct per parameter.

    ``salt`` is 0 for Q (m x r), 1 for P (n x r)."""
    return (seed * 1_000_003 + param_index * 2 + salt) % (2**63)


def seeded_normal(shape: Sequence[int], seed: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Identical random init on every rank (CPU generator, then moved): no broadcast needed."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=device)


#: same-shape groups up to this many elements per matrix are stacked (one ``bmm``)
STACK_MAX_NUMEL = 1 << 16

#: a batch of same-shape matrices: one stacked ``(b, n, m)`` tensor or a list of views
Batched = Union[torch.Tensor, list[torch.Tensor]]


def batched_mm(ms: Batched, f: torch.Tensor, *, transpose: bool = False) -> torch.Tensor:
    """``M @ f`` (or ``M^T @ f``) for a batch -> ``(b, n or m, r)``.

    On CPU the product is formed as ``(f^T @ M^T)^T`` (or ``(f^T @ M)^T``): the same sums in
    another order (float rounding may differ in the last bits), 3-5x faster on one thread,
    because a BLAS product with a skinny ``r``-column output runs at a fraction of memory
    speed while one with a short ``r``-row left operand streams ``M`` once. Other devices
    keep the plain form (their BLAS handles both shapes well)."""
    if f.device.type == "cpu":
        if isinstance(ms, torch.Tensor):
            mt = ms if transpose else ms.transpose(1, 2)
            return torch.bmm(f.transpose(1, 2), mt).transpose(1, 2)
        return torch.stack([mm_factor(m, f[k], transpose=transpose) for k, m in enumerate(ms)])
    if isinstance(ms, torch.Tensor):
        return torch.bmm(ms.transpose(1, 2) if transpose else ms, f)
    return torch.stack([(m.T if transpose else m) @ f[k] for k, m in enumerate(ms)])


def mm_factor(m: torch.Tensor, f: torch.Tensor, *, transpose: bool = False) -> torch.Tensor:
    """``m @ f`` (or ``m^T @ f``) for one matrix and a skinny factor, in the fast form on CPU
    (see :func:`batched_mm`); a transposed view on CPU."""
    if f.device.type == "cpu":
        return torch.mm(f.T, m if transpose else m.T).T
    return (m.T if transpose else m) @ f


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``, in order."""
    sizes = [t.numel() for t in like]
    return [p.view_as(t) for p, t in zip(flat[: sum(sizes)].split(sizes), like)]



@dataclass
class Batch:
    """Same-shape matrices of one buffer (processed with one ``bmm``)."""

    n: int
    m: int
    r: int
    members: list[int] = field(default_factory=list)  # positions among the compressed tensors


@dataclass
class Plan:
    """Which tensors of a buffer are compressed, batched by shape."""

    uncompressed: list[int]  # tensor positions in the buffer
    compressed: list[int]
    batches: list[Batch]

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], rank: int, min_rate: float) -> Plan:
        """The plan for a buffer fusing ``shapes``."""
        ok = [should_compress(s, rank, min_rate) for s in shapes]
        comp = [i for i, c in enumerate(ok) if c]
        batches: dict[tuple[int, int, int], Batch] = {}
        for j, i in enumerate(comp):
            key = (*matrix_shape(shapes[i]), effective_rank(shapes[i], rank))
            batches.setdefault(key, Batch(*key)).members.append(j)
        return cls([i for i, c in enumerate(ok) if not c], comp, list(batches.values()))

    def unc_numel(self, shapes: Sequence[Sequence[int]]) -> int:
        """Elements travelling uncompressed."""
        return sum(math.prod(shapes[i]) for i in self.uncompressed)

    def factor_numel(self, p: bool) -> int:
        """Elements of all P (``p``) or all Q factors."""
        return sum(len(b.members) * (b.n if p else b.m) * b.r for b in self.batches)

    def flops(self) -> float:
        """``2 n m r`` summed over the compressed matrices (one product with a factor)."""
        return float(sum(2 * len(b.members) * b.n * b.m * b.r for b in self.batches))


#: elements of one block of :func:`fused_step` (float32: 1 MiB of ``e``, about one L2)
BLOCK = 1 << 18


def fused_step(g: torch.Tensor, e: torch.Tensor, f: torch.Tensor, out: torch.Tensor, *, rows: bool,
               velocity: torch.Tensor | None = None, momentum: float | None = None,
               mask: bool = True, scale: float = 1.0) -> None:
    """ACP-SGD's encode of one ``n x m`` matrix, block by block, in place (CPU).

    ``e += g``; ``out = e @ f`` (``rows``: a P-step, ``f`` is ``m x r``) or ``e^T @ f`` (a
    Q-step, ``f`` is ``n x r``); ``e -= out @ f^T`` (or ``f @ out^T``); with ``velocity``
    ``u``, momentum masking ``u -= u f f^T`` (or ``f f^T u``; not with ``mask=False``). With
    ``momentum`` ``m`` too,
    ``g`` is the raw gradient and the velocity stage comes first in each block:
    ``u <- g + m u`` (the operation of :meth:`~lowcomm.compress.feedback.Velocity.accumulate`),
    then ``e += u``. Row blocks for a P-step, column blocks for a Q-step: each block of the
    factor, the residual and the masked velocity depends on that block of ``e`` (and ``u``)
    alone, so each block is read from memory once. The products take the fast CPU form
    ``f^T @ block`` (see :func:`batched_mm`). ``scale``: the gradient's clipping factor
    (:meth:`~lowcomm.compress.feedback.Velocity.clip_scales`), applied as ``g`` is read,
    which saves the clipping's own pass over ``g`` (1.0: none).
    """
    n, m = e.shape
    ft = f.T
    if _step_compiled(g, e, f, out, velocity, momentum, mask, rows=rows, scale=scale):
        return
    if scale != 1.0:
        g = g * scale  # (the BLAS-block fallback: a scaled copy, as the clipping pass made)
    if rows:
        step = max(1, BLOCK // m)
        for a in range(0, n, step):  # over blocks, not elements: 3-6 BLAS/vector calls each
            eb, gb = e[a : a + step], g[a : a + step]
            ub = velocity[a : a + step] if velocity is not None else None
            if momentum is not None and ub is not None:
                gb = torch.add(gb, ub, alpha=momentum, out=ub)
            eb.add_(gb)
            pt = torch.mm(ft, eb.T)  # (r, rows): the block's rows of P, transposed
            out[a : a + step].copy_(pt.T)
            sub_outer_(eb, pt.T, ft)
            if ub is not None and mask:
                sub_outer_(ub, torch.mm(ft, ub.T).T, ft)
    else:
        step = max(1, BLOCK // n)
        for a in range(0, m, step):
            eb, gb = e[:, a : a + step], g[:, a : a + step]
            ub = velocity[:, a : a + step] if velocity is not None else None
            if momentum is not None and ub is not None:
                gb = torch.add(gb, ub, alpha=momentum, out=ub)
            eb.add_(gb)
            qt = torch.mm(ft, eb)  # (r, cols): the block's rows of Q, transposed
            out[a : a + step].copy_(qt.T)
            eb.addmm_(f, qt, alpha=-1.0)
            if ub is not None and mask:
                ub.addmm_(f, torch.mm(ft, ub), alpha=-1.0)


def _step_compiled(g: torch.Tensor, e: torch.Tensor, f: torch.Tensor, out: torch.Tensor,
                   velocity: torch.Tensor | None, momentum: float | None, mask: bool, *, rows: bool,
                   scale: float = 1.0) -> bool:
    """:func:`fused_step` by :func:`lowcomm.compress.lowrankjit.p_step_rows` (``rows``) or
    :func:`~lowcomm.compress.lowrankjit.q_step_cols` where the tensors allow it (float32 CPU,
    contiguous matrices); ``False`` (nothing done) otherwise."""
    parts = [g, e, f, out] + ([velocity] if velocity is not None else [])
    if not (_float32(*parts) and all(t.is_contiguous() for t in (g, e, out)) and
            (velocity is None or velocity.is_contiguous())):
        return False
    jit = native.load("lowrankjit")
    if jit is None:
        return False
    stage = momentum is not None and velocity is not None
    u = velocity.numpy() if velocity is not None else np.zeros((0, 0), dtype=np.float32)
    masked = bool(mask and velocity is not None)
    if rows:
        jit.p_step_rows(g.numpy(), e.numpy(), u, f.T.contiguous().numpy(), out.numpy(), float(momentum or 0.0),
                        stage, masked, float(scale))
    else:
        jit.q_step_cols(g.numpy(), e.numpy(), u, f.contiguous().numpy(), out.numpy(), float(momentum or 0.0),
                        stage, masked, max(1, (BLOCK // 2) // e.shape[0]), float(scale))
    return True


def mask_(u: torch.Tensor, f: torch.Tensor, *, right: bool) -> None:
    """``u -= u f f^T`` (``right``) or ``u -= f f^T u`` in place, by cache-sized blocks (CPU).

    Why blocks: ``f^T u`` over all of ``u`` and then the update would read ``u`` twice from
    memory; a column block of ``u`` (left) or a row block (right) determines its own part of
    the product, so each block is read once and written once while in cache. The same sums
    as the unblocked form, up to float summation order inside the BLAS."""
    n, m = u.shape
    ft = f.T
    if right:
        step = max(1, BLOCK // m)
        for a in range(0, n, step):
            ub = u[a : a + step]
            sub_outer_(ub, torch.mm(ft, ub.T).T, ft)
    else:
        step = max(1, BLOCK // n)
        for a in range(0, m, step):
            ub = u[:, a : a + step]
            ub.addmm_(f, torch.mm(ft, ub), alpha=-1.0)


def _float32(*ts: torch.Tensor) -> bool:
    """Whether the compiled kernels may take these tensors: float32 CPU tensors without grad,
    the CPU fast paths not switched off (``LOWCOMM_CPU_FAST=0`` sends them the device way)."""
    return cpu_fast(*ts) and all(t.dtype == torch.float32 and not t.requires_grad for t in ts)


def outer_(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``out <- left @ right^T`` (``n x r`` times ``(m x r)^T``): compiled where it can be (a
    rank-``r`` product is written at memory speed, MKL's GEMM writes it at a fraction of it),
    else ``torch.mm``. The same sums up to float summation order."""
    jit = native.load("lowrankjit") if _float32(out, left, right) and out.is_contiguous() else None
    if jit is not None:
        jit.outer_into(out.numpy(), left.contiguous().numpy(), right.T.contiguous().numpy())
    else:
        torch.mm(left, right.T, out=out)


def sub_outer_(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
    """``x -= a @ bt`` for a row block ``x`` (``n x m``), ``a`` ``n x r``, ``bt`` ``r x m``:
    compiled where it can be (1.5-2x faster than MKL's ``addmm_`` with a rank-``r`` inner
    dimension, measured), else ``addmm_``. The same sums up to float summation order."""
    jit = native.load("lowrankjit") if _float32(x, a, bt) and x.is_contiguous() else None
    if jit is not None:
        jit.sub_outer(x.numpy(), a.contiguous().numpy(), bt.contiguous().numpy())
    else:
        x.addmm_(a, bt, alpha=-1.0)


def rebuild_(target: torch.Tensor, mat: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
             residual: torch.Tensor) -> None:
    """``residual <- mat - left right^T`` and ``target <- left right^T`` by row blocks (CPU);
    ``target`` may alias ``mat``. Why: the product is formed once per block, in cache, and
    used for both, where a residual ``addmm`` and a separate product compute it twice."""
    n, m = target.shape
    rt = right.T
    jit = native.load("lowrankjit") if _float32(target, mat, left, right, residual) else None
    if jit is not None:  # each row formed in L1, residual and product written from it
        jit.rebuild(target.numpy(), mat.numpy(), left.contiguous().numpy(), rt.contiguous().numpy(), residual.numpy())
        return
    step = max(1, BLOCK // m)
    for a in range(0, n, step):
        t = torch.mm(left[a : a + step], rt)
        torch.sub(mat[a : a + step], t, out=residual[a : a + step])
        target[a : a + step].copy_(t)

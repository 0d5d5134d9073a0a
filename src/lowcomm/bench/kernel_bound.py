"""The least time a compressor's kernels can take on this machine: bytes and FLOPs they must touch.

Why: a benchmark that compares a method against a "lower bound" built from the method's own
measured compression time flatters slow kernels (a kernel 30x slower than it needs to be
raises its own bound). The bound here is computed from what the kernels must at least read
and write (divided by a *measured* copy bandwidth) and, for the low-rank codecs, the matmul
FLOPs they must do (divided by a measured matmul rate), so a slow kernel shows up as a ratio
far above 1 and never as a "fast" method.

Kernels (all bytes for an fp32 gradient of ``n`` elements fused from ``T`` tensors, ``P``
workers; ``V = 16 n`` when the codec keeps the optimizer's velocity, momentum correction:
read ``g`` and ``u``, write both; else ``V = 0``):

``encode``
    Everything the sending side does to one buffer, state included (as a hook runs it).
``feedback``
    The state passes alone (a part of ``encode``): velocity, error-feedback compensation
    ``c = g + e`` (read 2, write 1: ``12 n``) and residual ``e = c - D(C(c))`` (read 1, write 1:
    ``8 n``), or Signum's momentum ``m <- beta m + (1 - beta) g`` (read 2, write 1: ``12 n``).
``decode``
    Everything the receiving side does to turn the collective's result into the mean gradient
    (for gathered codecs: the aggregate of ``P`` payloads).

Per compressor (``S`` = one worker's payload bytes):

* ``fp16``/``bf16``: encode ``4n + 2n`` (read fp32, write the half-precision buffer); decode
  ``2n + 4n``; feedback 0.
* ``signsgd`` (EF-SignSGD, ``S = ceil(n/8) + 4T``): feedback ``V + 20n``; encode
  ``feedback + 4n + S`` (one read of ``c`` for the scales and the bits, write the payload);
  decode ``P*S + 4n``.
* ``signum`` (``S`` as signsgd): feedback ``12n`` (momentum); encode ``12n + 4n + S``; decode
  ``P*S + 4n`` (the majority vote reads every payload once, writes the result once).
* ``qsgd`` (``S = n + 4 * buckets``): encode ``4n + S`` (a bucket of 512 fits in cache, so the
  norm and the levels need one read from memory); decode ``P*S + 4n``; feedback 0.
* ``topk``/``hitopk`` (``S = 8 sum_i k_i``, ``k_i = ceil(density n_i)``): feedback ``V + 20n``;
  encode ``feedback + 4n + S`` (selection reads ``c`` once); decode ``4n + P*S`` (zero the
  output, scatter every payload).
* ``gtopk``: as topk, decode ``4n + 3 S ceil(log2 P)`` (each of the tree's rounds reads two
  sparse vectors and writes one).
* ``powersgd`` (``n_c`` compressed elements in matrices ``a x b`` of rank ``r``, ``n_u`` the
  rest): feedback ``V + 12 n_c + 8 n_c``; encode ``V + 12 n_c + 8 n_u + 4 n_c + 4 sum a r``
  (compensate in place, copy the uncompressed part, ``P = M Q``); decode ``16 n_c + 8 n_u``
  (``Q = M^T P`` reads ``M``; residual ``M - P Q^T`` reads ``M``, writes ``e``; the mean is
  written), plus ``8 n_c`` with momentum masking (on by default with the velocity: the sent
  subspace ``F F^T u`` leaves the velocity, read and written once; its basis ``F = orth(P)``
  exists only after the first all-reduce, so this pass cannot join the encode's).
  FLOPs: encode ``2 sum a b r``, decode ``4 sum a b r`` (+ ``4 sum a b r`` for the masking).
* ``acpsgd``: encode ``V + 12 n_c + 8 n_u + 4 n_c + 8 n_c`` (compensate, copy, one product,
  local residual), decode ``4 n_c + 8 n_u``; FLOPs encode ``4 sum a b r``, decode ``2 sum a b r``;
  feedback as powersgd.

Orthogonalization, the factors' own bytes and the finite checks are small next to these and
left out (the bound stays a bound). The byte counts only depend on ``numel`` except for the
low-rank codecs, which need the tensors' shapes: pass ``shapes=`` (else ``tensors`` square
matrices of ``numel / tensors`` elements are assumed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowcomm.compress.matrices import effective_rank, matrix_shape, should_compress
from lowcomm.errors import UsageError

#: compressors whose kernels this module knows
KNOWN = ("acpsgd", "bf16", "fp16", "gtopk", "hitopk", "powersgd", "qsgd", "signsgd", "signum", "topk")
#: those that keep the optimizer's velocity (momentum correction) by default, as trained
_VELOCITY_DEFAULT = {"signsgd", "topk", "gtopk", "hitopk", "powersgd", "acpsgd"}
_LOWRANK = ("powersgd", "acpsgd")


def copy_bandwidth_bytes_per_s(n: int = 1 << 24, *, device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Read+write bytes per second of the best of ``repeats`` copies of ``n`` fp32 elements."""
    if n < 1 or repeats < 1:
        raise UsageError(f"copy bandwidth needs n >= 1 and repeats >= 1, got n={n}, repeats={repeats}")
    dev = torch.device(device)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats + 1):  # the first copy faults the pages in: not counted
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        if _ > 0:
            best = min(best, dt)
    return 8.0 * n / best


def matmul_flops_per_s(size: int = 1024, *, device: str | torch.device = "cpu", repeats: int = 3) -> float:
    """FLOP/s of the best of ``repeats`` square fp32 matmuls (``2 size^3`` FLOPs each)."""
    dev = torch.device(device)
    a = torch.ones(size, size, device=dev)
    b = torch.ones(size, size, device=dev)
    best = math.inf
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i > 0:
            best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def sustained_rates(window_s: float = 0.5, *, start: Callable[[], Any] | None = None,
                    n: int = 1 << 24, size: int = 1024) -> dict[str, float]:
    """Copy bandwidth (read+write bytes/s of ``n`` fp32 elements) and matmul rate (FLOP/s of
    ``size``-square fp32 products) on the CPU, each sustained over a window of ``window_s``:
    all the work done in the window over its length.

    Why a window and not a best-of: several processes that run this at once (``start``, e.g. a
    barrier's ``wait``, is called before each window so that they begin together) share the
    cores and the memory bus for the whole window, so each measures its share; a best-of
    would catch the moments the scheduler gave one process a core to itself."""
    if window_s <= 0:
        raise UsageError(f"the measuring window must be > 0 s, got {window_s}")
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    a = torch.ones(size, size)
    b = torch.ones(size, size)
    dst.copy_(src)  # fault the pages in before the window
    torch.mm(a, b)
    rates: dict[str, float] = {}
    for key, work, amount in (("copy_bytes_per_s", lambda: dst.copy_(src), 8.0 * n),
                              ("matmul_flops_per_s", lambda: torch.mm(a, b), 2.0 * size**3)):
        if start is not None:
            start()
        t0 = time.perf_counter()
        done = 0
        while (elapsed := time.perf_counter() - t0) < window_s:
            work()
            done += 1
        rates[key] = amount * done / elapsed
    return rates


def _check_name(codec_name: str) -> None:
    if codec_name not in KNOWN:
        raise UsageError(f"no kernel bound for compressor {codec_name!r}; valid: {', '.join(KNOWN)}")


def _default_shapes(numel: int, tensors: int) -> list[tuple[int, ...]]:
    """``tensors`` square-ish matrices adding up to ``numel`` (when no shapes are given)."""
    if tensors < 1 or numel < tensors:
        raise UsageError(f"need numel >= tensors >= 1, got numel={numel}, tensors={tensors}")
    each, rest = divmod(numel, tensors)
    out: list[tuple[int, ...]] = []
    for i in range(tensors):
        m = each + (1 if i < rest else 0)
        side = max(1, math.isqrt(m))
        while m % side:
            side -= 1
        out.append((side, m // side))
    return out


def _lowrank_parts(shapes: Sequence[Sequence[int]], rank: int, min_rate: float) -> tuple[int, int, int, float]:
    """(compressed elements, uncompressed elements, elements of all P factors, sum a*b*r)."""
    n_c = n_u = p_elems = 0
    abr = 0.0
    for s in shapes:
        numel = math.prod(s)
        if should_compress(s, rank, min_rate):
            a, b = matrix_shape(s)
            r = effective_rank(s, rank)
            n_c += numel
            p_elems += a * r
            abr += a * b * r
        else:
            n_u += numel
    return n_c, n_u, p_elems, abr


def _velocity(codec_name: str, args: dict[str, Any]) -> bool:
    return bool(args.get("momentum_correction", codec_name in _VELOCITY_DEFAULT))


def _masking(codec_name: str, args: dict[str, Any]) -> bool:
    return _velocity(codec_name, args) and bool(args.get("momentum_masking", True))


def kernel_bytes(codec_name: str, numel: int, *, world: int, tensors: int = 1, **codec_args: Any) -> dict[str, int]:
    """Bytes the ``encode``, ``decode`` (of ``world`` payloads) and ``feedback`` kernels must at
    least read and write for an fp32 buffer of ``numel`` elements (formulas: module docstring).

    ``codec_args``: the codec's options that change the count (``density``, ``bucket_size``,
    ``rank``, ``min_compression_rate``, ``momentum_correction``) and ``shapes`` (the tensors'
    shapes: needed by the low-rank codecs, and they give the per-tensor counts of the others)."""
    _check_name(codec_name)
    if world < 1:
        raise UsageError(f"world must be >= 1, got {world}")
    raw_shapes = codec_args.get("shapes")
    shapes = [tuple(s) for s in raw_shapes] if raw_shapes else _default_shapes(numel, tensors)
    n = sum(math.prod(s) for s in shapes)
    t = len(shapes)
    v = 16 * n if _velocity(codec_name, codec_args) else 0
    if codec_name in ("fp16", "bf16"):
        return {"encode": 6 * n, "decode": 6 * n, "feedback": 0}
    if codec_name in ("signsgd", "signum"):
        s = (n + 7) // 8 + 4 * t
        fb = 12 * n if codec_name == "signum" else v + 20 * n
        return {"encode": fb + 4 * n + s, "decode": world * s + 4 * n, "feedback": fb}
    if codec_name == "qsgd":
        bs = int(codec_args.get("bucket_size", 512))
        s = n + 4 * sum(-(-math.prod(x) // bs) for x in shapes)
        return {"encode": 4 * n + s, "decode": world * s + 4 * n, "feedback": 0}
    if codec_name in ("topk", "hitopk", "gtopk"):
        density = float(codec_args.get("density", 0.01))
        s = 8 * sum(max(1, min(math.prod(x), math.ceil(density * math.prod(x)))) for x in shapes)
        fb = v + 20 * n
        if codec_name == "gtopk":
            dec = 4 * n + 3 * s * max(1, math.ceil(math.log2(world))) if world > 1 else 4 * n + s
        else:
            dec = 4 * n + world * s
        return {"encode": fb + 4 * n + s, "decode": dec, "feedback": fb}
    rank = int(codec_args.get("rank", 4))
    n_c, n_u, p_elems, _ = _lowrank_parts(shapes, rank, float(codec_args.get("min_compression_rate", 2.0)))
    fb = v + 20 * n_c
    if codec_name == "powersgd":
        mask = 8 * n_c if _masking(codec_name, codec_args) else 0
        return {"encode": v + 12 * n_c + 8 * n_u + 4 * n_c + 4 * p_elems, "decode": 16 * n_c + 8 * n_u + mask,
                "feedback": fb}
    return {"encode": v + 24 * n_c + 8 * n_u, "decode": 4 * n_c + 8 * n_u, "feedback": fb}


def kernel_flops(codec_name: str, shapes: list[tuple[int, ...]], *, rank: int, world: int,
                 min_compression_rate: float = 2.0, masking: bool = True) -> dict[str, float]:
    """Matmul FLOPs of Power-SGD's / ACP-SGD's ``encode`` and ``decode``; ``{}`` for the others
    (their kernels do no matmul). ``world`` does not change them (the factors are summed by the
    collective, not by a kernel); it is in the signature so every bound takes the same keys.
    ``masking``: Power-SGD's decode removes the sent subspace from the velocity (default on)."""
    _check_name(codec_name)
    if codec_name not in _LOWRANK:
        return {}
    _, _, _, abr = _lowrank_parts(shapes, rank, min_compression_rate)
    if codec_name == "powersgd":
        return {"encode": 2 * abr, "decode": (8 if masking else 4) * abr}
    return {"encode": 4 * abr, "decode": 2 * abr}


def compression_bound_s(codec_name: str, shapes: list[tuple[int, ...]], *, world: int, bandwidth: float,
                        flops_per_s: float | None = None, **codec_args: Any) -> float:
    """The least seconds compression can cost per step for a buffer fusing ``shapes``: over the
    ``encode`` and ``decode`` kernels, ``max(bytes / bandwidth, flops / flops_per_s)`` summed
    (``feedback`` is part of ``encode``, so it is not added again). ``flops_per_s=None``: the
    FLOP term is left out (bytes only)."""
    if bandwidth <= 0:
        raise UsageError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    if flops_per_s is not None and flops_per_s <= 0:
        raise UsageError(f"flops_per_s must be > 0 or None, got {flops_per_s}")
    numel = sum(math.prod(s) for s in shapes)
    nbytes = kernel_bytes(codec_name, numel, world=world, tensors=len(shapes), shapes=shapes, **codec_args)
    flops: dict[str, float] = {}
    if flops_per_s is not None and codec_name in _LOWRANK:
        flops = kernel_flops(codec_name, shapes, rank=int(codec_args.get("rank", 4)), world=world,
                             min_compression_rate=float(codec_args.get("min_compression_rate", 2.0)),
                             masking=_masking(codec_name, codec_args))
    total = 0.0
    for kernel in ("encode", "decode"):
        t = nbytes[kernel] / bandwidth
        if flops_per_s is not None and kernel in flops:
            t = max(t, flops[kernel] / flops_per_s)
        total += t
    return total

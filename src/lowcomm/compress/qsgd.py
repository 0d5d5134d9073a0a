"""QSGD (Alistarh et al., NeurIPS 2017): stochastic s-level quantization with norm scaling.

Each tensor of a fused buffer is cut into buckets of ``bucket_size`` consecutive elements
(the last one shorter); a bucket ``v`` is sent as its fp32 norm ``||v||_2`` and, per element,
the signed level ``sign(v_i) * xi_i`` (one int8), decoded as ``||v|| * sign(v_i) * xi_i / s``.
With ``r_i = s |v_i| / ||v||`` and ``l = floor(r_i)``, ``xi_i`` is ``l + 1`` with probability
``r_i - l`` and ``l`` otherwise, so ``E[Q(v)] = v``: the quantizer is **unbiased** and needs
no error feedback (the paper's point: SGD with an unbiased gradient of bounded variance
keeps its convergence guarantee). Its variance is at most
``min(d / s^2, sqrt(d) / s) * ||v||^2`` for a bucket of ``d`` elements (Lemma 3.1): buckets
keep ``d`` small, which is why the norm is per bucket and not per tensor.

Why levels = 127 by default: one int8 carries ``sign * xi`` for any ``s <= 127``, so the
payload is one byte per element whatever ``s`` is; the largest ``s`` that fits gives the
smallest variance for those bytes (8-bit QSGD; with the default ``bucket_size = 512`` of
the paper's experiments the bound is ``512 / 127^2 = 3.2 %`` of ``||v||^2`` per bucket).
Fewer levels (e.g. ``levels=7``) change nothing on the wire here: they only show the
accuracy of a coarser quantizer (a bit-packing encoder, the paper's Elias coding, is not
implemented).

Why gathered: each worker's levels are relative to its own norms, so payloads do not add
up; every worker all-gathers ``n + 4 * buckets`` bytes per worker and averages the decoded
payloads (:class:`~lowcomm.compress.gathered.PayloadCodec`).

Randomness is independent across workers and reproducible: each tensor draws its uniforms
from its own generator seeded with :func:`draw_seed` ``(seed, codec step, layout.index of
the tensor, rank)`` (no host sync, no dependence on DDP's bucket layout or the engine's
grouping: the same levels after a resume and for any fusion). Each rank draws its own
rounding, as in the paper: with independent errors the variance of the P-worker mean is the
mean variance divided by P (shared uniforms would round every worker's copy of a value the
same way, and averaging would not shrink the error at all). The arithmetic is fixed so that
a central reference reproduces every level bit for bit: in fp32,
``norm = torch.linalg.vector_norm(bucket)`` (the bucket zero-padded), ``scale = s / norm``
(0 in a bucket of norm 0), ``u = lowcomm.compress.qsgdkern.uniforms(seed, numel)`` (16-bit
words of a counter-based integer hash of ``(seed, element index)``, the same on every device,
as ``(w + 1/2) / 2**16``), ``level = clamp(floor(v * scale + u), -s, s)`` (dithered rounding:
the same law as ``sign(v_i) * xi_i``; clamped because rounding may put ``r`` a hair above
``s``). Unbiased to a resolution of ``2**-16`` of a level (``u`` takes 2**16 values; see
:mod:`lowcomm.compress.qsgdkern`, which also says why these choices are fast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lowcomm.compress.base import Compressor, cpu_fast
from lowcomm.compress.codec import Layout, Work, register_codec
from lowcomm.compress.gathered import PayloadCodec
from lowcomm.compress.options import Duration, check_start
from lowcomm.compress.qsgdkern import SEED_STRIDE, bucket_norms, mean_cpu, plan_of, quantize_cpu, quantize_torch
from lowcomm.errors import MAX_COUNT, UsageError

#: most levels an int8 ``sign * xi`` can carry
MAX_LEVELS = 127


def draw_seed(seed: int, step: int, param_index: int, rank: int) -> int:
    """Seed of one rank's uniforms for one tensor at one codec step: the same after a resume
    and for any fusion, distinct for every (tensor, rank) of a step and every step of one
    (tensor, rank) (``param_index < 1_000_033``, ``rank < 1_000_037``; the multipliers are
    odd, so no step count wraps modulo ``2**63`` onto another step)."""
    return (seed_base(seed, step, rank) + param_index * SEED_STRIDE) % (2**63)


def seed_base(seed: int, step: int, rank: int) -> int:
    """The part of :func:`draw_seed` that does not depend on the tensor: ``draw_seed(seed,
    step, i, rank) == (seed_base(seed, step, rank) + i * 1_000_037) % 2**63``."""
    return ((seed * 1_000_003 + step) * 1_000_033 * 1_000_037 + rank) % (2**63)


def num_buckets(numel: int, bucket_size: int) -> int:
    """Buckets of one tensor: ``ceil(numel / bucket_size)``."""
    return -(-numel // bucket_size)


class Quantizer(Compressor):
    """The QSGD payload math: int8 signed levels + fp32 bucket norms of a fused buffer.

    :attr:`affine` (or :attr:`seeds`, one per segment) is set before each encode; without it the
    segments are seeded as tensors ``0, 1, ...`` at step 0 (the profiler's case). The
    kernels are in :mod:`lowcomm.compress.qsgdkern` (CPU: one compiled pass where numba is
    installed; device tensors and CPU without numba: whole-buffer torch ops, no host reads;
    the same bits on either path).
    """

    def __init__(self, levels: int = MAX_LEVELS, bucket_size: int = 512) -> None:
        self.levels = levels
        self.bucket_size = bucket_size
        self.seeds: list[int] | None = None
        #: ``(seed_base, parameter indices)``, set by the codec instead of :attr:`seeds`: tensor
        #: ``t``'s seed is ``(base + indices[t] * SEED_STRIDE) mod 2**63`` (:func:`draw_seed`),
        #: which lets the device path draw every tensor's words in one set of whole-buffer
        #: operations (:func:`~lowcomm.compress.qsgdkern.buffer_words`)
        self.affine: tuple[int, list[int]] | None = None

    def _seeds(self, count: int) -> tuple[list[int], tuple[int, list[int]] | None]:
        """The segments' seeds, and the affine form where the codec gave it."""
        if self.affine is not None and len(self.affine[1]) == count:
            base, indices = self.affine
            return [(base + i * SEED_STRIDE) % 2**63 for i in indices], self.affine
        if self.seeds is not None and len(self.seeds) == count:
            return self.seeds, None
        return list(range(count)), None

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Levels and norms of every segment (tensor), in segment order."""
        flat = tensor.reshape(-1)
        seg = list(segments) if segments else [flat.numel()]
        seeds, affine = self._seeds(len(seg))
        x = flat.to(torch.float32).contiguous()
        plan = plan_of(seg, self.bucket_size)
        s = float(self.levels)
        norms = bucket_norms(x, plan)
        levels = torch.empty(x.numel(), dtype=torch.int8) if cpu_fast(x) else None
        if levels is None or not quantize_cpu(x, plan, seeds, s, levels, norms):
            scale = torch.where(norms > 0, s / norms, torch.zeros((), device=x.device))
            # the whole-buffer draw for device tensors (and the switch that stands in for them);
            # a CPU without numba draws tensor by tensor (fewer int64 temporaries: 4x faster there)
            levels = quantize_torch(x, plan, scale, seeds, s, None if cpu_fast(x) else affine)
        return [levels, norms], (flat.numel(), flat.dtype, seg)

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """``level * (norm / s)`` for every element (each bucket's step repeated over it)."""
        numel, dtype, seg = ctx
        levels, norms = payload
        plan = plan_of(seg, self.bucket_size)
        step = torch.repeat_interleave(norms / float(self.levels), plan.on(levels.device)["counts"],
                                       output_size=numel)
        return levels.to(torch.float32).mul_(step).to(dtype)

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """Mean of the workers' decodes; CPU fp32: :func:`~lowcomm.compress.qsgdkern.mean_cpu`."""
        if self._fast(payloads, ctx):
            out = torch.empty(ctx[0], dtype=torch.float32)
            mean_cpu(payloads, plan_of(ctx[2], self.bucket_size), float(self.levels), out)
            return out
        return super().aggregate(payloads, ctx)

    def aggregate_out(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor) -> None:
        """:meth:`aggregate` written straight into ``out`` where it can be (CPU, fp32)."""
        if self._fast(payloads, ctx) and out.dtype == torch.float32 and out.is_contiguous() \
                and out.numel() == ctx[0] and cpu_fast(out):
            mean_cpu(payloads, plan_of(ctx[2], self.bucket_size), float(self.levels), out)
        else:
            super().aggregate_out(payloads, ctx, out)

    @staticmethod
    def _fast(payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> bool:
        return ctx[1] == torch.float32 and ctx[0] > 0 and cpu_fast(payloads[0][0])

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        """For one tensor: one byte per element plus 4 per bucket."""
        return numel + 4 * num_buckets(numel, self.bucket_size)


def _check_int(name: str, value: int, low: int, high: int) -> None:
    """An integer option in ``[low, high]`` (bool refused: ``True`` is not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise UsageError(f"qsgd {name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass
class QSGDOptions:
    """qsgd: ``levels`` s (1..127, one int8 per element), ``bucket_size`` elements per norm,
    warm-up steps and the ``seed`` of the stochastic rounding."""

    levels: int = MAX_LEVELS
    bucket_size: int = 512
    start_iter: Duration = "10%"
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("levels", self.levels, 1, MAX_LEVELS)
        _check_int("bucket_size", self.bucket_size, 1, MAX_COUNT)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        self.start_iter = check_start(self.start_iter)


@register_codec
class QSGDCodec(PayloadCodec):
    """QSGD: unbiased stochastic quantization, all-gathered, decoded payloads averaged."""

    compiled_kernels = ("qsgdjit",)

    name = "qsgd"
    summary = "QSGD: stochastic s-level quantization, int8 levels + one fp32 norm per bucket, all-gathered"
    caveat = ("unbiased but noisy: adds variance up to min(d/s^2, sqrt(d)/s)*||v||^2 per bucket of d; "
              "8-bit (s=127) is usually accuracy-neutral, few levels may need more steps; "
              "traffic grows with P (all-gather).")
    Options = QSGDOptions
    #: unbiased without memory: nothing to keep in unscaled units under AMP (the quantizer
    #: is scale-equivariant: a power-of-two loss scale gives the same levels)
    stateful = False

    def build(self) -> Compressor:
        """The quantizer with this codec's ``levels`` and ``bucket_size``."""
        self.quantizer = Quantizer(self.options.levels, self.options.bucket_size)
        return self.quantizer

    def prepare(self, layout: Layout) -> None:
        """Seed each tensor's uniforms by (seed, step, its parameter index, this rank)."""
        self.quantizer.affine = (seed_base(self.options.seed, self.step, self.rank), list(layout.index))

    def payload_bytes(self, shapes: Sequence[Sequence[int]], dtype_bytes: int) -> int:
        """``n + 4 * sum_i ceil(n_i / bucket_size)``: int8 levels, fp32 norms."""
        return sum(self.quantizer.payload_bytes(math.prod(s), torch.float32) for s in shapes)

    def work(self, shapes: Sequence[Sequence[int]]) -> tuple[Work, Work]:
        """Encode: norm, uniforms, product, sum, floor and clamp, cast (6 passes); decode:
        convert, scale and accumulate each payload (3 passes)."""
        n = sum(math.prod(s) for s in shapes)
        return Work(elementwise=6 * n), Work(elementwise=3 * n)

    def decode_once(self, shapes: Sequence[Sequence[int]]) -> Work:
        """The division of the accumulated payloads by the world size (1 pass)."""
        return Work(elementwise=sum(math.prod(s) for s in shapes))

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

Randomness is independent across workers and reproducible: the uniforms of a tensor come
from a ``torch.Generator`` on the tensor's device seeded with :func:`draw_seed` ``(seed,
codec step, layout.index of the tensor, rank)`` (no host sync, no dependence on DDP's bucket
layout or the engine's grouping). Each rank draws its own rounding, as in the paper: with
independent errors the variance of the P-worker mean is the mean variance divided by P
(shared uniforms would round every worker's copy of a value the same way, and averaging
would not shrink the error at all). The arithmetic is fixed so
that a central reference reproduces every level bit for bit: in fp32,
``norm = torch.linalg.vector_norm(bucket)``, ``r = |v_i| * (s / norm)`` (0 in a bucket of
norm 0), ``u = torch.rand(numel)`` of the tensor in element order, round up iff
``u < r - floor(r)``, ``xi`` clipped to ``s`` (rounding may put ``r`` a hair above ``s``).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lowcomm.compress.base import Compressor, cpu_fast, scratch
from lowcomm.compress.codec import Layout, Work, register_codec
from lowcomm.compress.gathered import PayloadCodec
from lowcomm.compress.options import Duration, check_start
from lowcomm.errors import MAX_COUNT, UsageError

#: most levels an int8 ``sign * xi`` can carry
MAX_LEVELS = 127


def draw_seed(seed: int, step: int, param_index: int, rank: int) -> int:
    """Seed of one rank's uniforms for one tensor at one codec step: the same after a resume
    and for any fusion, distinct for every (tensor, rank) of a step and every step of one
    (tensor, rank) (``param_index < 1_000_033``, ``rank < 1_000_037``; the multipliers are
    odd, so no step count wraps modulo ``2**63`` onto another step)."""
    return (((seed * 1_000_003 + step) * 1_000_033 + param_index) * 1_000_037 + rank) % (2**63)


def num_buckets(numel: int, bucket_size: int) -> int:
    """Buckets of one tensor: ``ceil(numel / bucket_size)``."""
    return -(-numel // bucket_size)


def _buckets(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """``x`` (flat) zero-padded to whole buckets, as a ``(buckets, bucket_size)`` view (of
    ``x`` itself, no copy, when it already fills whole buckets)."""
    nb = num_buckets(x.numel(), bucket_size)
    if nb * bucket_size == x.numel() and x.is_contiguous():
        return x.view(nb, bucket_size)
    padded = x.new_zeros(nb * bucket_size)
    padded[: x.numel()] = x
    return padded.view(nb, bucket_size)


_INDEX: OrderedDict[tuple[tuple[int, ...], int], torch.Tensor] = OrderedDict()
_INDEX_LOCK = threading.Lock()


def _bucket_index(seg: Sequence[int], bucket_size: int) -> torch.Tensor:
    """int32 per element of a fused buffer: the number of its bucket among all the buffer's
    buckets (each tensor's buckets start afresh). Cached for the last few layouts."""
    key = (tuple(seg), bucket_size)
    with _INDEX_LOCK:  # decodes may run on several communication threads
        hit = _INDEX.get(key)
        if hit is not None:
            _INDEX.move_to_end(key)
            return hit
    parts, first = [], 0
    for n in seg:  # once per layout, not per step
        parts.append(np.arange(n, dtype=np.int32) // bucket_size + first)
        first += num_buckets(n, bucket_size)
    index = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))
    with _INDEX_LOCK:
        _INDEX[key] = index
        while len(_INDEX) > 8:
            _INDEX.popitem(last=False)
    return index


class Quantizer(Compressor):
    """The QSGD payload math: int8 signed levels + fp32 bucket norms per tensor.

    :attr:`seeds` (one per segment) is set by the codec before each encode; without it the
    segments are seeded as tensors ``0, 1, ...`` at step 0 (the profiler's case).
    """

    def __init__(self, levels: int = MAX_LEVELS, bucket_size: int = 512) -> None:
        self.levels = levels
        self.bucket_size = bucket_size
        self.seeds: list[int] | None = None

    def quantize(self, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 levels of ``x``'s elements, fp32 norm of each bucket) of one tensor."""
        s, n = float(self.levels), x.numel()
        v = _buckets(x.reshape(-1).to(torch.float32), self.bucket_size)
        norms = torch.linalg.vector_norm(v, dim=1)
        scale = torch.where(norms > 0, s / norms, torch.zeros((), device=x.device))
        if cpu_fast(x):
            return self._quantize_cpu(v, n, norms, scale, seed), norms
        r = v.abs().mul_(scale[:, None]).reshape(-1)[:n]
        low = r.floor()
        g = torch.Generator(device=x.device)
        g.manual_seed(seed)
        u = torch.rand(n, generator=g, device=x.device, dtype=torch.float32)
        xi = low.add_((u < r - low).to(torch.float32)).clamp_(max=s)
        levels = xi.mul_(torch.sign(v.reshape(-1)[:n])).to(torch.int8)
        return levels, norms

    def _quantize_cpu(self, v: torch.Tensor, n: int, norms: torch.Tensor, scale: torch.Tensor,
                      seed: int) -> torch.Tensor:
        """:meth:`quantize`'s levels with the same operations in reused buffers (no fresh
        pages per tensor and step); only the int8 levels are a new tensor."""
        s = float(self.levels)
        size = v.numel()
        r = torch.abs(v, out=scratch("qsgd.r", size, torch.float32).view(v.shape)).mul_(scale[:, None]).reshape(-1)[:n]
        low = torch.floor(r, out=scratch("qsgd.low", n, torch.float32))
        g = torch.Generator()
        g.manual_seed(seed)
        u = torch.rand(n, generator=g, dtype=torch.float32, out=scratch("qsgd.u", n, torch.float32))
        up = torch.lt(u, r.sub_(low), out=scratch("qsgd.up", n, torch.bool))
        xi = low.add_(u.copy_(up)).clamp_(max=s)
        return xi.mul_(torch.sign(v.reshape(-1)[:n], out=r)).to(torch.int8)

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Levels and norms of every segment (tensor), concatenated in segment order."""
        flat = tensor.reshape(-1)
        seg = list(segments) if segments else [flat.numel()]
        seeds = self.seeds if self.seeds is not None and len(self.seeds) == len(seg) else list(range(len(seg)))
        parts = [self.quantize(x, sd) for x, sd in zip(flat.split(seg), seeds)]
        levels = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        norms = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return [levels, norms], (flat.numel(), flat.dtype, seg)

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """``norm * level / s`` for every element (each segment's buckets in turn)."""
        numel, dtype, seg = ctx
        levels, norms = payload
        out, nb_off = [], 0
        for x in levels.split(seg):
            nb = num_buckets(x.numel(), self.bucket_size)
            step = norms[nb_off : nb_off + nb] / float(self.levels)
            out.append((_buckets(x.to(torch.float32), self.bucket_size) * step[:, None]).reshape(-1)[: x.numel()])
            nb_off += nb
        return torch.cat(out).to(dtype) if out else torch.zeros(numel, dtype=dtype, device=levels.device)

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """Mean of the workers' decodes; CPU fp32: see :meth:`_mean_cpu`."""
        if self._fast(payloads, ctx):
            return self._mean_cpu(payloads, ctx, torch.empty(ctx[0], dtype=torch.float32))
        return super().aggregate(payloads, ctx)

    def aggregate_out(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor) -> None:
        """:meth:`aggregate` written straight into ``out`` where it can be (CPU, fp32)."""
        if self._fast(payloads, ctx) and out.dtype == torch.float32 and out.is_contiguous() \
                and out.numel() == ctx[0] and cpu_fast(out):
            self._mean_cpu(payloads, ctx, out)
        else:
            super().aggregate_out(payloads, ctx, out)

    @staticmethod
    def _fast(payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> bool:
        return ctx[1] == torch.float32 and ctx[0] > 0 and cpu_fast(payloads[0][0])

    def _mean_cpu(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """Per worker: its levels times its bucket's step ``norm / s``, added in worker order,
        then divided by P: the generic decode-and-add's operations bit for bit, without the
        per-tensor padding, concatenation and fresh tensors (the step reaches every element
        through a cached per-layout bucket index, one gather)."""
        numel, _, seg = ctx
        index = _bucket_index(seg, self.bucket_size)
        step = scratch("qsgd.step", numel, torch.float32)
        vals = scratch("qsgd.vals", numel, torch.float32)
        for p, (levels, norms) in enumerate(payloads):
            torch.index_select(norms / float(self.levels), 0, index, out=step)
            if p == 0:
                torch.mul(vals.copy_(levels), step, out=out)
            else:
                out.add_(vals.copy_(levels).mul_(step))
        return out.div_(len(payloads))

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
        self.quantizer.seeds = [draw_seed(self.options.seed, self.step, i, self.rank) for i in layout.index]

    def payload_bytes(self, shapes: Sequence[Sequence[int]], dtype_bytes: int) -> int:
        """``n + 4 * sum_i ceil(n_i / bucket_size)``: int8 levels, fp32 norms."""
        return sum(self.quantizer.payload_bytes(math.prod(s), torch.float32) for s in shapes)

    def work(self, shapes: Sequence[Sequence[int]]) -> tuple[Work, Work]:
        """Encode: norm, scale, uniforms, compare, sign and cast (6 passes); decode: convert,
        scale and accumulate each payload (3 passes)."""
        n = sum(math.prod(s) for s in shapes)
        return Work(elementwise=6 * n), Work(elementwise=3 * n)

    def decode_once(self, shapes: Sequence[Sequence[int]]) -> Work:
        """The division of the accumulated payloads by the world size (1 pass)."""
        return Work(elementwise=sum(math.prod(s) for s in shapes))

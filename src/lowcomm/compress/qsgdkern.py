"""QSGD's kernels: the uniforms, the bucket plan of a fused buffer, and the CPU encode/decode.

Why a module of its own: :mod:`lowcomm.compress.qsgd` states the quantizer and its contract;
this is how it is computed fast. On the CPU (issue 18) the old encode spent most of its time
in ``torch.rand`` (a Mersenne twister, ~6 ns per float) and in full-size passes over the
buffer, one per operation. Here:

* **Uniforms at 16-bit resolution from PCG64.** ``u_i = (k_i + 1/2) / 2**16`` where the
  ``k_i`` are the 16-bit words, little-endian, of numpy's PCG64 ``random_raw`` (4 per 64-bit
  output; ~1 ns per element, 6x cheaper than ``torch.rand``). Each tensor has its own
  generator, seeded by :func:`pcg_state` of its :func:`~lowcomm.compress.qsgd.draw_seed`,
  so the draw does not depend on how tensors are fused. Device tensors (CUDA) draw the
  ``k_i`` with ``torch.randint`` from a generator on their device (no host round-trip); CPU
  tensors always use PCG64, on the fast path and on the device path alike (numpy writes
  fresh numbers, it reads no tensor), so the two CPU paths agree bit for bit.
* **Dithered rounding.** ``level = clamp(floor(v * scale + u), -s, s)`` with
  ``scale = s / norm``: for ``y = v * scale``, ``floor(y + u)`` is ``floor(y) + 1`` with
  probability ``y - floor(y)``, which for either sign is QSGD's ``sign(v) * xi`` (``xi``
  is ``floor(|y|) + 1`` with probability ``|y| - floor(|y|)``), without the abs, sign and
  compare passes. ``u`` takes 2**16 values, so ``E[level] = y`` up to ``2**-17`` of a level
  (and the fp32 sum ``y + u`` rounds at most at ``2**-17`` for ``|y| < 128``): unbiased to
  a resolution of ``2**-16`` of a level, ``norm / (s * 2**16)`` of a gradient entry.
* **Buckets by plan, passes in cache.** Per layout a cached :class:`Plan` lists the runs of
  whole buckets (consecutive tensors that fill whole buckets form one run: one norm call)
  and the partial buckets (gathered together: one norm call for all). The levels are formed
  chunk by chunk (:data:`CHUNK` elements: uniforms, product, sum, floor, clamp and the int8
  cast while the chunk is in cache); the decode adds the P payloads chunk by chunk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lowcomm.compress.base import scratch

#: elements per in-cache chunk of the CPU kernels (a multiple of 4: whole PCG64 outputs)
CHUNK = 1 << 18
#: ``u = k * 2**-16 + U_OFFSET`` for the signed 16-bit word ``k``: ``(k + 32768 + 1/2) / 2**16``
U_SCALE = 2.0**-16
U_OFFSET = 0.5 + 2.0**-17
_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """One output of splitmix64 (Steele et al.): a 64-bit mix of ``z``."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def pcg_state(seed: int) -> dict[str, object]:
    """The PCG64 state of one tensor's draw: 128-bit state and (odd) increment from four
    splitmix64 outputs of ``seed``. Why not ``PCG64(seed)``: its SeedSequence costs ~25 us,
    per tensor and step; this costs ~2 us and still gives distinct seeds distinct streams."""
    a, b, c, d = (_splitmix64(seed + i * 0x632BE59BD9B4E019) for i in range(4))
    return {"bit_generator": "PCG64", "state": {"state": (a << 64) | b, "inc": ((c << 64) | d) | 1},
            "has_uint32": 0, "uinteger": 0}


class Draw:
    """One tensor's 16-bit words, drawn in order in pieces of whole PCG64 outputs."""

    _local = threading.local()

    def __init__(self, seed: int) -> None:
        bg = getattr(Draw._local, "bg", None)
        if bg is None:
            bg = Draw._local.bg = np.random.PCG64(0)
        bg.state = pcg_state(seed)
        self.bg = bg

    def words(self, count: int) -> torch.Tensor:
        """The next ``count`` words as int16 (``count`` a multiple of 4 except the last piece)."""
        raw = self.bg.random_raw(-(-count // 4))
        return torch.from_numpy(raw.view(np.int16)[:count])


def uniforms(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``n`` fp32 uniforms of one tensor drawn with ``seed`` (the reference's form)."""
    k = _words(seed, n, torch.device(device))
    return torch.mul(k.to(torch.float32), U_SCALE).add_(U_OFFSET)


def _words(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """``n`` signed 16-bit words: PCG64 on the CPU, the device's generator elsewhere."""
    if device.type == "cpu":
        return Draw(seed).words(n)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(-32768, 32768, (n,), generator=g, device=device, dtype=torch.int16)


@dataclass
class Plan:
    """Where the buckets of a fused buffer are (cached per ``(segments, bucket_size)``).

    ``runs``: ``(first element, first bucket, buckets)`` of each maximal run of whole buckets;
    ``tensors``: ``(offset, numel, first bucket)`` of each tensor; ``tail_src``: the elements
    of the partial buckets, in order; ``tail_dst``: their places in a ``(tails, bucket)``
    zero-padded matrix; ``tail_bucket``: the bucket of each partial bucket and ``tail_of``:
    of each of its elements; ``counts``: the elements of every bucket."""

    bucket_size: int
    numel: int
    buckets: int
    runs: list[tuple[int, int, int]]
    tensors: list[tuple[int, int, int]]
    tail_src: torch.Tensor
    tail_dst: torch.Tensor
    tail_bucket: torch.Tensor
    tail_of: torch.Tensor
    counts: torch.Tensor
    _on: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)
    _pinned: dict[str, torch.Tensor] = field(default_factory=dict)

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The index tensors on ``device`` (copied once per layout and device, not per step).

        To a CUDA device from pinned memory with ``non_blocking``: a pageable host-to-device
        copy would synchronize the stream inside the hook; the pinned sources stay referenced
        here until the plan goes, so the asynchronous copy cannot read freed memory."""
        hit = self._on.get(device)
        if hit is None:
            names = ("tail_src", "tail_dst", "tail_bucket", "tail_of", "counts")
            if device.type == "cuda":
                if not self._pinned:
                    self._pinned = {k: getattr(self, k).pin_memory() for k in names}
                hit = {k: t.to(device, non_blocking=True) for k, t in self._pinned.items()}
            else:
                hit = {k: getattr(self, k).to(device) for k in names}
            self._on[device] = hit
        return hit

    @classmethod
    def of(cls, seg: Sequence[int], bucket_size: int) -> Plan:
        """The plan of a buffer fusing tensors of ``seg`` elements (once per layout)."""
        bs = bucket_size
        runs: list[tuple[int, int, int]] = []
        tensors: list[tuple[int, int, int]] = []
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        tb: list[int] = []
        of: list[np.ndarray] = []
        off = first = 0
        for n in seg:
            tensors.append((off, n, first))
            whole, rest = divmod(n, bs)
            if whole:
                last = runs[-1] if runs else None
                if last is not None and last[0] + last[2] * bs == off and last[1] + last[2] == first:
                    runs[-1] = (last[0], last[1], last[2] + whole)
                else:
                    runs.append((off, first, whole))
            if rest:
                src.append(np.arange(off + whole * bs, off + n, dtype=np.int64))
                dst.append(np.arange(rest, dtype=np.int64) + len(tb) * bs)
                of.append(np.full(rest, len(tb), dtype=np.int64))
                tb.append(first + whole)
            off += n
            first += whole + (1 if rest else 0)
        cat = lambda parts: torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))  # noqa: E731
        counts = np.full(first, bs, dtype=np.int64)
        counts[tb] = [n % bs for n in seg if n % bs]
        return cls(bs, off, first, runs, tensors, cat(src), cat(dst), torch.tensor(tb, dtype=torch.int64), cat(of),
                   torch.from_numpy(counts))


_PLANS: OrderedDict[tuple[tuple[int, ...], int], Plan] = OrderedDict()
_PLANS_LOCK = threading.Lock()
PLANS_KEPT = 256  # layouts (one per bucket: see plan_of)


def plan_of(seg: Sequence[int], bucket_size: int) -> Plan:
    """The cached :class:`Plan` (the last :data:`PLANS_KEPT` layouts; decodes may run on
    several threads). Many, because a model has one layout per bucket and a cache smaller
    than that would rebuild (and, on a GPU, re-copy) every bucket's plan every step; a plan
    holds index tensors for the partial buckets only."""
    key = (tuple(seg), bucket_size)
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            return hit
    plan = Plan.of(seg, bucket_size)
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


def bucket_norms(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """fp32 norm of every bucket of the flat fp32 ``x`` (partial buckets zero-padded): one
    ``vector_norm`` per run of whole buckets and one for all partial buckets."""
    bs = plan.bucket_size
    norms = torch.empty(plan.buckets, dtype=torch.float32, device=x.device)
    for e0, b0, nb in plan.runs:
        torch.linalg.vector_norm(x[e0 : e0 + nb * bs].view(nb, bs), dim=1, out=norms[b0 : b0 + nb])
    _tail_norms(x, plan, norms)
    return norms


def _tail_norms(x: torch.Tensor, plan: Plan, norms: torch.Tensor) -> None:
    """The partial buckets' norms into ``norms``: gathered into one zero-padded matrix."""
    if plan.tail_bucket.numel():
        bs = plan.bucket_size
        ix = plan.on(x.device)
        pad = torch.zeros(plan.tail_bucket.numel() * bs, dtype=torch.float32, device=x.device)
        pad.index_copy_(0, ix["tail_dst"], x.index_select(0, ix["tail_src"]))
        norms.index_copy_(0, ix["tail_bucket"], torch.linalg.vector_norm(pad.view(-1, bs), dim=1))


def _scale(norms: torch.Tensor, s: float) -> torch.Tensor:
    """``s / norm``, 0 where the norm is 0 (the documented expression, on any slice)."""
    return torch.where(norms > 0, s / norms, torch.zeros((), device=norms.device))


def _levels_into(y: torch.Tensor, u: torch.Tensor, s: float, out: torch.Tensor) -> None:
    """``out <- int8(clamp(floor(y + u), -s, s))`` (``y`` overwritten)."""
    out.copy_(y.add_(u).floor_().clamp_(-s, s))


def _u_into(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``u <- k * 2**-16 + (1/2 + 2**-17)`` (exact in fp32)."""
    return u.copy_(k).mul_(U_SCALE).add_(U_OFFSET)


def quantize_cpu(x: torch.Tensor, plan: Plan, seeds: Sequence[int], s: float, out: torch.Tensor,
                 norms: torch.Tensor) -> None:
    """Levels of the flat fp32 CPU ``x`` into int8 ``out`` and bucket norms into ``norms``,
    chunk by chunk in cache (``x`` is read from memory once: each chunk's norms, scales and
    levels while it is there); each tensor draws its words in order from its seed, its
    partial bucket's go to a side buffer and all partial buckets are finished together."""
    bs = plan.bucket_size
    ntail = plan.tail_src.numel()
    _tail_norms(x, plan, norms)
    tail_k = scratch("qsgd.tail_k", ntail, torch.int16)
    tpos = 0
    step = max(1, CHUNK // bs) * bs
    step += (-step) % (4 * bs) if step % 4 else 0  # whole PCG64 outputs per chunk
    longest = max(((n // bs) * bs for _, n, _ in plan.tensors), default=0)
    if longest <= step:  # every tensor is one chunk, its last (no alignment needed): no larger scratch
        step = max(1, longest)
    u = scratch("qsgd.u", step, torch.float32)
    y = scratch("qsgd.y", step, torch.float32)
    for (off, n, b0), seed in zip(plan.tensors, seeds):
        draw = Draw(seed)
        whole = (n // bs) * bs
        for a in range(0, whole, step):
            m = min(step, whole - a)
            last = a + m == whole
            k = draw.words(m + (n - whole if last else 0))
            if last and n > whole:
                tail_k[tpos : tpos + n - whole].copy_(k[m:])
                tpos += n - whole
            nb, bb = m // bs, b0 + a // bs
            xv = x[off + a : off + a + m].view(nb, bs)
            nv = torch.linalg.vector_norm(xv, dim=1, out=norms[bb : bb + nb])
            yy = torch.mul(xv, _scale(nv, s)[:, None], out=y[:m].view(nb, bs))
            _levels_into(yy.view(-1), _u_into(k[:m], u[:m]), s, out[off + a : off + a + m])
        if whole == 0 and n:
            tail_k[tpos : tpos + n].copy_(draw.words(n))
            tpos += n
    if ntail:
        scale = _scale(norms.index_select(0, plan.tail_bucket), s)
        yt = torch.mul(x.index_select(0, plan.tail_src), scale[plan.tail_of])
        ut = _u_into(tail_k, torch.empty(ntail, dtype=torch.float32))
        lv = torch.empty(ntail, dtype=torch.int8)
        _levels_into(yt, ut, s, lv)
        out.index_copy_(0, plan.tail_src, lv)


def quantize_torch(x: torch.Tensor, plan: Plan, scale: torch.Tensor, seeds: Sequence[int], s: float) -> torch.Tensor:
    """The same levels with whole-buffer torch ops (device tensors; no host reads): the same
    elementwise arithmetic, so on a CPU tensor the same bits as :func:`quantize_cpu`."""
    dev = x.device
    k = torch.cat([_words(sd, n, dev) for (_, n, _), sd in zip(plan.tensors, seeds)]) if plan.tensors \
        else torch.zeros(0, dtype=torch.int16, device=dev)
    u = _u_into(k, torch.empty(plan.numel, dtype=torch.float32, device=dev))
    per = torch.repeat_interleave(scale, plan.on(dev)["counts"], output_size=plan.numel)  # no sync
    y = torch.mul(x, per)
    out = torch.empty(plan.numel, dtype=torch.int8, device=dev)
    _levels_into(y, u, s, out)
    return out


def mean_cpu(payloads: Sequence[Sequence[torch.Tensor]], plan: Plan, s: float, out: torch.Tensor) -> None:
    """``out <-`` the mean over workers of ``level * (norm / s)``: per element the generic
    decode's operations in the same order (worker 0's product, then each next worker's
    product added, then the division by P), chunk by chunk so ``out`` stays in cache."""
    bs, world = plan.bucket_size, len(payloads)
    steps = [norms / s for _, norms in payloads]
    per = min(max(1, CHUNK // bs), max((nb for _, _, nb in plan.runs), default=0))  # no larger than the longest run
    tmp = scratch("qsgd.dec", per * bs, torch.float32)
    for e0, b0, nb_run in plan.runs:
        for c in range(0, nb_run, per):
            nb = min(per, nb_run - c)
            a, z = e0 + c * bs, e0 + (c + nb) * bs
            o = out[a:z].view(nb, bs)
            t = tmp[: nb * bs].view(nb, bs)
            for p, (levels, _) in enumerate(payloads):
                st = steps[p][b0 + c : b0 + c + nb, None]
                if p == 0:
                    torch.mul(t.copy_(levels[a:z].view(nb, bs)), st, out=o)
                else:
                    o.add_(t.copy_(levels[a:z].view(nb, bs)).mul_(st))
            o.div_(world)
    if plan.tail_src.numel():
        acc = torch.empty(plan.tail_src.numel(), dtype=torch.float32)
        for p, (levels, _) in enumerate(payloads):
            st = steps[p].index_select(0, plan.tail_bucket)[plan.tail_of]
            v = levels.index_select(0, plan.tail_src).to(torch.float32).mul_(st)
            acc = v if p == 0 else acc.add_(v)
        out.index_copy_(0, plan.tail_src, acc.div_(world))

"""QSGD's kernels: the uniforms, the bucket plan of a fused buffer, and the CPU encode/decode.

Why a module of its own: :mod:`lowcomm.compress.qsgd` states the quantizer and its contract;
this is how it is computed fast. On the CPU (issue 18) the first encode spent most of its
time in ``torch.rand`` (a Mersenne twister, ~6 ns per float) and the second in PCG64's words
(~1 ns each) and one pass per operation. Here:

* **Counter-based uniforms, the same on every device.** Elements ``2j`` and ``2j + 1`` of
  a tensor (counted from the tensor's start) get the low and the high 16 bits of
  ``h_j = H(H((j + k1) mod 2**32) xor k2)``, with ``H`` Wellons' ``lowbias32`` integer hash
  (a bijection of 32-bit words with strong avalanche) and ``(k1, k2)`` the two halves of
  splitmix64 of the tensor's :func:`~lowcomm.compress.qsgd.draw_seed`; then
  ``u_i = (w_i + 1/2) / 2**16``. No generator state: a word is a function of ``(seed, i)``,
  so it does not depend on fusion or chunking, any piece can be drawn alone, and CPU and
  CUDA draw the same words (torch integer operations on a device; a compiled loop on the
  CPU). For one key pair ``H`` is a bijection, so over all ``j`` every 32-bit value occurs
  once and each half is exactly uniform. One hash per two elements because the hash is
  most of the encode's arithmetic. Not a cryptographic generator: dithering needs uniform,
  decorrelated words, not secrecy.
* **Dithered rounding.** ``level = clamp(floor(v * scale + u), -s, s)`` with
  ``scale = s / norm``: for ``y = v * scale``, ``floor(y + u)`` is ``floor(y) + 1`` with
  probability ``y - floor(y)``, which for either sign is QSGD's ``sign(v) * xi`` (``xi``
  is ``floor(|y|) + 1`` with probability ``|y| - floor(|y|)``), without the abs, sign and
  compare passes. ``u`` takes 2**16 values, so ``E[level] = y`` up to ``2**-17`` of a level
  (and the fp32 sum ``y + u`` rounds at most at ``2**-17`` for ``|y| < 128``): unbiased to
  a resolution of ``2**-16`` of a level, ``norm / (s * 2**16)`` of a gradient entry.
* **One fused pass on the CPU** (:mod:`lowcomm.compress.qsgdjit`, numba): the bucket norms
  come from ``torch.linalg.vector_norm`` on every path (one summation order, so one set of
  bits), then each element is drawn, scaled, rounded and cast in one compiled loop; the
  decode adds the P payloads bucket by bucket. Without numba, and for device tensors,
  whole-buffer torch operations compute the same bits (:func:`quantize_torch`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from lowcomm.compress import native
from lowcomm.compress.base import scratch

#: ``u = w * U_SCALE + U_OFFSET`` for the unsigned 16-bit word ``w``: ``(w + 1/2) / 2**16``
U_SCALE = 2.0**-16
U_OFFSET = 2.0**-17
#: elements per in-cache chunk of the decode without numba
CHUNK = 1 << 18
_M32 = (1 << 32) - 1
#: the multipliers of ``lowbias32`` (also in :mod:`lowcomm.compress.qsgdjit`)
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B


#: :func:`~lowcomm.compress.qsgd.draw_seed` is ``(base + param_index * SEED_STRIDE) mod 2**63``
SEED_STRIDE = 1_000_037
_M63 = (1 << 63) - 1


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def key_tensors(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys of each seed (int64 tensor, on any device): the halves of
    splitmix64 (Steele et al.) of it, with wrapping int64 adds and products (the same bits as
    the unsigned 64-bit arithmetic)."""
    z = seeds + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _srl(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _i64(0x94D049BB133111EB)
    z = z ^ _srl(z, 31)
    return z & _M32, _srl(z, 32)


def keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of one tensor's words (:func:`key_tensors` of one seed)."""
    k1, k2 = key_tensors(torch.tensor([seed], dtype=torch.int64))
    return int(k1), int(k2)


def _lowbias32_(h: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` in place on int64 words below ``2**32`` (products masked to 32 bits: the
    int64 product may wrap, its low 32 bits are still exact)."""
    h.bitwise_xor_(h >> 16).mul_(_MUL1).bitwise_and_(_M32)
    h.bitwise_xor_(h >> 15).mul_(_MUL2).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def _hash_(j: torch.Tensor, k1: torch.Tensor | int, k2: torch.Tensor | int) -> torch.Tensor:
    """The hash of pair indices ``j`` (in place): ``H(H((j + k1) mod 2**32) xor k2)``."""
    return _lowbias32_(_lowbias32_(j.add_(k1).bitwise_and_(_M32)).bitwise_xor_(k2))


def words(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16-bit words ``w_0 .. w_{n-1}`` of one tensor drawn with ``seed`` (int64), with
    torch operations on ``device`` and scalar keys (no host-to-device copy, no sync): hash
    ``j`` gives the words of elements ``2j`` (its low half) and ``2j + 1`` (its high half)."""
    k1, k2 = keys(seed)
    h = _hash_(torch.arange((n + 1) // 2, dtype=torch.int64, device=device), k1, k2)
    return torch.stack((h & 0xFFFF, h >> 16), dim=1).reshape(-1)[:n]


_INDEX: OrderedDict[tuple[tuple[int, ...], torch.device], torch.Tensor] = OrderedDict()


def _index_on(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    """The tensors' parameter indices on ``device`` (int64), copied once per layout and device
    (to CUDA from pinned memory, ``non_blocking``: no stream sync inside a hook)."""
    key = (tuple(int(i) for i in indices), device)
    with _PLANS_LOCK:
        hit = _INDEX.get(key)
        if hit is not None:
            _INDEX.move_to_end(key)
            return hit
    host = torch.tensor(key[0], dtype=torch.int64)
    out = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    with _PLANS_LOCK:
        _INDEX[key] = out
        while len(_INDEX) > PLANS_KEPT:
            _INDEX.popitem(last=False)
    return out


def buffer_words(plan: Plan, base: int, indices: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """The words of every tensor of a fused buffer (int64, ``plan.numel``) in one set of
    whole-buffer operations: tensor ``t``'s seed is ``(base + indices[t] * SEED_STRIDE) mod
    2**63`` (:func:`~lowcomm.compress.qsgd.draw_seed`), its keys splitmix64 of it, computed
    on ``device`` from the cached indices and the scalar ``base`` (nothing copied per step);
    then each element's pair index and half. The same words as :func:`words` per tensor."""
    dev = torch.device(device)
    ix = plan.on(dev)
    n = plan.numel
    k1, k2 = (torch.repeat_interleave(k, ix["tensor_numel"], output_size=n)
              for k in key_tensors((_index_on(indices, dev) * SEED_STRIDE + (base & _M63)) & _M63))
    i = torch.arange(n, dtype=torch.int64, device=dev)
    i.sub_(torch.repeat_interleave(ix["tensor_start"], ix["tensor_numel"], output_size=n))
    return _hash_(i >> 1, k1, k2).bitwise_right_shift_((i & 1) * 16).bitwise_and_(0xFFFF)


def uniforms(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``n`` fp32 uniforms of one tensor drawn with ``seed`` (the reference's form)."""
    return words(seed, n, device).to(torch.float32).mul_(U_SCALE).add_(U_OFFSET)


def compiled() -> ModuleType | None:
    """The numba kernels (:mod:`lowcomm.compress.qsgdjit`), or ``None`` without numba (then
    CPU tensors take the torch path; :func:`lowcomm.compress.native.load` warns once)."""
    return native.load("qsgdjit")




@dataclass
class Plan:
    """Where the buckets of a fused buffer are (cached per ``(segments, bucket_size)``).

    ``runs``: ``(first element, first bucket, buckets)`` of each maximal run of whole buckets;
    ``tensors``: ``(offset, numel, first bucket)`` of each tensor; ``tail_src``: the elements
    of the partial buckets, in order; ``tail_dst``: their places in a ``(tails, bucket)``
    zero-padded matrix; ``tail_bucket``: the bucket of each partial bucket and ``tail_of``:
    of each of its elements; ``counts``: the elements of every bucket; ``tensor_numel`` and
    ``tensor_start``: each tensor's elements and offset (int64 tensors); ``starts``: the
    tensors' offsets and the buffer's end, ``firsts``: each tensor's first bucket (int64
    numpy arrays, for the compiled kernels)."""

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
    tensor_numel: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    tensor_start: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    firsts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    _on: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)
    _pinned: dict[str, torch.Tensor] = field(default_factory=dict)

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The index tensors on ``device`` (copied once per layout and device, not per step).

        To a CUDA device from pinned memory with ``non_blocking``: a pageable host-to-device
        copy would synchronize the stream inside the hook; the pinned sources stay referenced
        here until the plan goes, so the asynchronous copy cannot read freed memory."""
        hit = self._on.get(device)
        if hit is None:
            names = ("tail_src", "tail_dst", "tail_bucket", "tail_of", "counts", "tensor_numel", "tensor_start")
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
        starts = np.array([t[0] for t in tensors] + [off], dtype=np.int64)
        firsts = np.array([t[2] for t in tensors], dtype=np.int64)
        return cls(bs, off, first, runs, tensors, cat(src), cat(dst), torch.tensor(tb, dtype=torch.int64), cat(of),
                   torch.from_numpy(counts), torch.tensor([t[1] for t in tensors], dtype=torch.int64),
                   torch.from_numpy(starts[:-1].copy()), starts, firsts)


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


def _levels_into(y: torch.Tensor, u: torch.Tensor, s: float, out: torch.Tensor) -> None:
    """``out <- int8(clamp(floor(y + u), -s, s))`` (``y`` overwritten)."""
    out.copy_(y.add_(u).floor_().clamp_(-s, s))


def quantize_cpu(x: torch.Tensor, plan: Plan, seeds: Sequence[int], s: float, out: torch.Tensor,
                 norms: torch.Tensor) -> bool:
    """Levels of the flat fp32 CPU ``x`` into int8 ``out`` by the compiled kernel, given the
    bucket ``norms`` (:func:`bucket_norms`); ``False`` (nothing written) without numba."""
    jit = compiled()
    if jit is None:
        return False
    k1, k2 = key_tensors(torch.tensor(list(seeds), dtype=torch.int64))
    jit.levels(x.numpy(), norms.numpy(), plan.starts, plan.firsts, k1.numpy(), k2.numpy(), plan.bucket_size, s,
               out.numpy())
    return True


def quantize_torch(x: torch.Tensor, plan: Plan, scale: torch.Tensor, seeds: Sequence[int], s: float,
                   affine: tuple[int, Sequence[int]] | None = None) -> torch.Tensor:
    """The same levels with whole-buffer torch ops (device tensors; no host reads): the same
    elementwise arithmetic, so on a CPU tensor the same bits as :func:`quantize_cpu`. With
    ``affine`` (see :func:`buffer_words`) the words of all tensors come from one set of
    whole-buffer operations (a few dozen kernel launches per buffer, not per tensor)."""
    dev = x.device
    if affine is not None and len(affine[1]) == len(plan.tensors):
        u = buffer_words(plan, affine[0], affine[1], dev).to(torch.float32).mul_(U_SCALE).add_(U_OFFSET)
    else:
        u = torch.empty(plan.numel, dtype=torch.float32, device=dev)
        for (off, n, _), sd in zip(plan.tensors, seeds):  # int64 words one tensor at a time
            u[off : off + n].copy_(words(sd, n, dev)).mul_(U_SCALE).add_(U_OFFSET)
    per = torch.repeat_interleave(scale, plan.on(dev)["counts"], output_size=plan.numel)  # no sync
    y = torch.mul(x, per)
    out = torch.empty(plan.numel, dtype=torch.int8, device=dev)
    _levels_into(y, u, s, out)
    return out


def mean_cpu(payloads: Sequence[Sequence[torch.Tensor]], plan: Plan, s: float, out: torch.Tensor) -> bool:
    """``out <-`` the mean over workers of ``level * (norm / s)``: per element the generic
    decode's operations in the same order (worker 0's product, then each next worker's product
    added, then the division by P), by the compiled kernel or, without numba, in chunks."""
    jit = compiled()
    if jit is None:
        _mean_chunked(payloads, plan, s, out)
        return True
    levels = tuple(lv.contiguous().numpy() for lv, _ in payloads)
    steps = tuple((norms / s).numpy() for _, norms in payloads)
    jit.mean(levels, steps, plan.starts, plan.firsts, plan.bucket_size, out.numpy())
    return True


def _mean_chunked(payloads: Sequence[Sequence[torch.Tensor]], plan: Plan, s: float, out: torch.Tensor) -> None:
    """:func:`mean_cpu` without numba: the same operations in the same order, by runs of whole
    buckets in cache-sized chunks (one product per worker and chunk), partial buckets gathered."""
    bs, world = plan.bucket_size, len(payloads)
    steps = [norms / s for _, norms in payloads]
    per = min(max(1, CHUNK // bs), max((nb for _, _, nb in plan.runs), default=0))
    tmp = scratch("qsgd.dec", per * bs, torch.float32)
    for e0, b0, nb_run in plan.runs:
        for c in range(0, nb_run, per):
            nb = min(per, nb_run - c)
            a, z = e0 + c * bs, e0 + (c + nb) * bs
            o, t = out[a:z].view(nb, bs), tmp[: nb * bs].view(nb, bs)
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
            v = levels.index_select(0, plan.tail_src).to(torch.float32).mul_(steps[p].index_select(0, plan.tail_bucket)[plan.tail_of])
            acc = v if p == 0 else acc.add_(v)
        out.index_copy_(0, plan.tail_src, acc.div_(world))

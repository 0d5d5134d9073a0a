"""Sign compression: 1 bit per element, packed 8 per byte, plus one fp32 scale per tensor.

* :class:`ScaledSign` — EF-SignSGD (Karimireddy et al. 2019): ``(||x||_1 / d) * sign(x)`` per
  fused tensor; workers' decoded payloads are averaged. Use it inside
  :class:`~lowcomm.compress.feedback.ErrorFeedback`.
* :class:`MajoritySign` — Signum (Bernstein et al. 2018): same payload, but the aggregate is
  the majority vote ``sign(sum_i sign(x_i))``, scaled per tensor by the workers' mean
  ``||x||_1 / d`` so the result has gradient-like magnitude and the usual SGD learning rate
  works (the vote itself is unchanged; a scale of 1 gives textbook Signum).

``sign(0)`` is taken as +1 (bit set for ``x >= 0``): one bit cannot say "zero".
Signs are not sum-compatible, so both codecs are gathered (one all-gather per buffer of
``ceil(n/8) + 4 * tensors`` bytes per worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.compress import native, signbits
from lowcomm.compress.base import Compressor, cpu_fast, scratch
from lowcomm.compress.codec import Layout, Work, register_codec
from lowcomm.compress.feedback import Direct, Momentum, ParamStore
from lowcomm.compress.gathered import PayloadCodec
from lowcomm.compress.options import Duration, check_momentum, check_start

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS_CACHE.get(device)
    if s is None:
        s = torch.arange(8, dtype=torch.uint8, device=device)
        _SHIFTS_CACHE[device] = s
    return s


def _cpu(*ts: torch.Tensor) -> bool:
    """The fast paths (:mod:`lowcomm.compress.signbits`) serve CPU tensors only: a device
    tensor keeps the torch forms (no host round-trip inside a hook); see :func:`cpu_fast`."""
    return cpu_fast(*ts)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bits ``x >= 0`` of a flat tensor, packed little-endian 8 per uint8 (ceil(n/8) bytes).
    NaN packs as 0 (``NaN >= 0`` is False), ``-0.0`` as 1, on both paths."""
    flat = x.reshape(-1)
    n = flat.numel()
    if _cpu(flat) and n:
        return signbits.pack(flat)
    bits = (flat >= 0).to(torch.uint8)
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    bits = bits.view(-1, 8) << _shifts(x.device)
    return bits.sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a flat tensor of +1/-1 of length ``numel``."""
    if _cpu(packed) and numel:
        return signbits.signs_i8(packed)[:numel].to(dtype)
    bits = (packed.reshape(-1, 1) >> _shifts(packed.device)) & 1
    bits = bits.reshape(-1)[:numel]
    return bits.to(dtype).mul_(2).sub_(1)


def _segments(n: int, segments: Sequence[int] | None) -> list[int]:
    seg = list(segments) if segments else [n]
    if sum(seg) != n:
        raise ValueError(f"segments sum to {sum(seg)}, tensor has {n} elements")
    return seg


def _l1_scales(x: torch.Tensor, seg: list[int]) -> torch.Tensor:
    """Mean ``|x|`` of each segment, in fp32. CPU: one ``abs`` pass into a reused buffer, then
    one mean per segment *view*: the same sums as ``p.abs().mean()`` bit for bit (a fused
    segment reduction adds in another order and would change the scales' last bits)."""
    if _cpu(x) and x.numel():
        return _means(torch.abs(x.reshape(-1), out=scratch("sign.abs", x.numel(), x.dtype)), seg)
    return _means(x.reshape(-1).abs(), seg)  # (one abs for all: the same sums, half the launches)


def _means(a: torch.Tensor, seg: list[int]) -> torch.Tensor:
    """fp32 mean of each segment *view* of ``|x|`` (``p.abs().mean()``'s sums, bit for bit)."""
    return torch.stack([p.mean() for p in a.split(seg)]).to(torch.float32)


def _expand(scales: torch.Tensor, seg: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One scale per segment, repeated over the segment's elements.

    Built from views and one ``cat``, not ``repeat_interleave(torch.tensor(seg))``: the
    latter copies the counts host-to-device and reads the output size back, two host
    syncs per decode on CUDA, inside a comm hook's callback.
    """
    s = scales.to(dtype)
    return torch.cat([s[i].expand(n) for i, n in enumerate(seg)])


class ScaledSign(Compressor):
    """``(||x||_1/d)·sign(x)`` per segment; payload = packed signs + fp32 scales."""

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Packed signs and the fp32 mean ``|x|`` of each segment."""
        seg = _segments(tensor.numel(), segments)
        jit = native.load("signjit") if _cpu(tensor) and tensor.dtype == torch.float32 and tensor.numel() else None
        if jit is not None:  # |x| and the bits in one read of x; the same means, the same bits
            flat = tensor.reshape(-1)
            a = scratch("sign.abs", flat.numel(), flat.dtype)[: flat.numel()]
            packed = torch.empty(signbits.padded(flat.numel()) // 8, dtype=torch.uint8)
            jit.abs_pack(flat.numpy(), a.numpy(), packed.numpy())
            return [packed, _means(a, seg)], (tensor.numel(), tensor.dtype, seg)
        return [pack_signs(tensor), _l1_scales(tensor, seg)], (tensor.numel(), tensor.dtype, seg)

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Signs times each segment's scale."""
        numel, dtype, seg = ctx
        if _cpu(payload[0]) and numel:
            return self._mean_cpu([payload], ctx, None)
        return unpack_signs(payload[0], numel, dtype).mul_(_expand(payload[1], seg, dtype))

    def residual(self, comp: torch.Tensor, payload: Sequence[torch.Tensor], ctx: Any,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``comp - decompress(payload)``; CPU: the decode goes to a reused buffer, the
        subtraction into ``out`` (two passes, bit-identical to the generic form)."""
        numel, dtype = ctx[0], ctx[1]
        if _cpu(comp, payload[0]) and numel:
            jit = native.load("signjit") if dtype == torch.float32 == comp.dtype else None
            if jit is not None and (out is None or signbits.usable(out, dtype, numel)):
                table = torch.stack((-payload[1], payload[1]), dim=1)  # the decode of a 0 bit, of a 1 bit
                res = torch.empty(numel, dtype=dtype) if out is None else out
                jit.table_residual(comp.reshape(-1).numpy(), payload[0].reshape(-1).numpy(), table.numpy(),
                                   signbits.starts(ctx[2]), res.reshape(-1).numpy())
                return res
            dec = self._mean_cpu([payload], ctx, scratch("sign.decoded", numel, dtype))
            return torch.sub(comp.reshape(-1), dec, out=out)
        return super().residual(comp, payload, ctx, out)

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """Mean of the workers' decodes. CPU: see :meth:`_mean_cpu`."""
        if _cpu(payloads[0][0]) and ctx[0]:
            return self._mean_cpu(payloads, ctx, None)
        return super().aggregate(payloads, ctx)

    def aggregate_out(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor) -> None:
        """:meth:`aggregate` written straight into ``out`` where it can be (CPU)."""
        if _cpu(payloads[0][0]) and ctx[0] and signbits.usable(out, ctx[1], ctx[0]):
            self._mean_cpu(payloads, ctx, out)
        else:
            super().aggregate_out(payloads, ctx, out)

    def _mean_cpu(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor | None) -> torch.Tensor:
        """The mean of P decodes without unpacking any: per element, the signs of up to 8
        workers form an 8-bit pattern (:func:`~lowcomm.compress.signbits.decode`) that
        indexes a per-segment table of the 256 sums ``sum_p (+-scale_p)``, added in worker
        order as the generic decode-and-add does: bit-identical for P <= 8 (P = 1 is the
        decode). Beyond 8, the groups' sums are added together (another float summation
        order: within P roundings of the generic result)."""
        numel, dtype, seg = ctx
        world = len(payloads)
        result: torch.Tensor | None = None
        for g in range(0, world, signbits.GROUP):
            group = payloads[g : g + signbits.GROUP]
            table = signbits.sum_table([p[1] for p in group], dtype)
            if world <= signbits.GROUP:  # one group: the division of each sum, done on the table
                table.div_(world)
            packed = [p[0] for p in group]
            if result is None:
                result = signbits.decode(table, packed, seg, numel, out)
            else:
                result.add_(signbits.decode(table, packed, seg, numel, scratch("sign.part", numel, dtype)))
        assert result is not None
        return result.div_(world) if world > signbits.GROUP else result

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        """``ceil(numel / 8)`` sign bytes plus one fp32 scale per tensor."""
        return (numel + 7) // 8 + 4 * num_tensors


class MajoritySign(ScaledSign):
    """Majority vote of the workers' signs, scaled by their mean ``||x||_1/d`` per segment."""

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        """``sign(sum of signs)`` times the workers' mean scale, per segment."""
        return self._vote(payloads, ctx, None)

    def aggregate_out(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor) -> None:
        """:meth:`aggregate` written straight into ``out`` where it can be (CPU)."""
        if signbits.usable(out, ctx[1], ctx[0]):
            self._vote(payloads, ctx, out)
        else:
            out.copy_(self._vote(payloads, ctx, None))

    def _vote(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any, out: torch.Tensor | None) -> torch.Tensor:
        """CPU: the ``+`` votes are counted without unpacking
        (:func:`~lowcomm.compress.signbits.decode` with ``count``), then one lookup per element maps
        (segment, count) to ``sign(2 count - P) * scale``: the generic path's product, bit
        for bit (the +-1 sums it takes the sign of are exact integers)."""
        numel, dtype, seg = ctx
        world = len(payloads)
        scales = payloads[0][1].clone()
        for p in payloads[1:]:
            scales.add_(p[1])
        scales.div_(world)
        if _cpu(payloads[0][0]) and numel and dtype == torch.float32 and world <= signbits.VOTE_MAX:
            result = torch.empty(numel, dtype=dtype) if out is None else out
            return signbits.vote([p[0] for p in payloads], scales, seg, numel, result)
        if _cpu(payloads[0][0]) and numel and world < 256:
            table = signbits.vote_table(scales, world, dtype)
            return signbits.decode(table, [p[0] for p in payloads], seg, numel, out, count=True)
        votes = unpack_signs(payloads[0][0], numel, dtype)
        for p in payloads[1:]:
            votes.add_(unpack_signs(p[0], numel, dtype))
        res = votes.sign_().mul_(_expand(scales, seg, dtype))
        return res if out is None else out.copy_(res)


@dataclass
class SignOptions:
    """signsgd: warm-up (a duration: steps, ``"2ep"``, ``"5%"``), whether to keep the residual
    (EF-SignSGD) and ``momentum_correction`` (the optimizer's momentum kept in the codec,
    :class:`~lowcomm.compress.feedback.Velocity`)."""

    start_iter: Duration = "10%"
    error_feedback: bool = True
    momentum_correction: bool = True

    def __post_init__(self) -> None:
        self.start_iter = check_start(self.start_iter)


@dataclass
class SignumOptions:
    """signum: warm-up (a duration) and the momentum ``beta`` of ``m <- beta m + (1 - beta) g``.

    The warm-up is the other codecs' ``"10%"``, although Signum has no error memory to protect:
    without it Signum gained 0.4 points on MNIST-1D cnn1d channels=256 at 15 epochs and lost
    2.3 on channels=64 (3 seeds each, docs/compression.md, "Signum's rule").

    ``beta`` is 0.7, not Bernstein et al.'s 0.9: the majority vote already averages the
    workers' noise, and a shorter memory follows the gradient sooner. Measured (3 seeds,
    15 epochs, same doc section): channels=256 91.97 -> 92.53 %, channels=64 87.67 -> 89.50 %;
    0.95 lost 1.5 points, 0.8 and 0.5 landed between."""

    start_iter: Duration = "10%"
    momentum: float = 0.7

    def __post_init__(self) -> None:
        self.start_iter = check_start(self.start_iter)
        check_momentum(self.momentum)


class _SignCodec(PayloadCodec):
    """Shared payload, byte and work formulas of the two sign codecs."""

    compiled_kernels = ("signjit",)

    #: the payload math (scaled signs, decoded by averaging or by majority vote)
    payload: ClassVar[type[ScaledSign]] = ScaledSign

    def build(self) -> Compressor:
        """The codec's :attr:`payload` math."""
        return self.payload()

    def payload_bytes(self, shapes: Sequence[Sequence[int]], dtype_bytes: int) -> int:
        """``ceil(n / 8) + 4 * len(shapes)`` (1 bit per element, one fp32 scale per tensor)."""
        return (Layout.of([""] * len(shapes), shapes, {}).numel + 7) // 8 + 4 * len(shapes)

    #: passes over the buffer to encode: L1 scale and sign/pack (2), plus the state's
    encode_passes: ClassVar[int] = 2

    def work(self, shapes: Sequence[Sequence[int]]) -> tuple[Work, Work]:
        """Encode: :attr:`encode_passes` over the buffer; decode: unpack and accumulate each payload."""
        n = Layout.of([""] * len(shapes), shapes, {}).numel
        return Work(elementwise=self.encode_passes * n), Work(elementwise=2 * n)


@register_codec
class SignSGDCodec(_SignCodec):
    """EF-SignSGD: scaled sign per tensor with residual memory; workers' decodes averaged."""

    name = "signsgd"
    summary = "EF-SignSGD: 1 bit per element + one fp32 scale per tensor, all-gathered"
    caveat = "1-bit: needs error feedback to converge like SGD; traffic grows with P (all-gather)."
    Options = SignOptions
    encode_passes = 4  # + the residual's add and subtraction


@register_codec
class SignumCodec(_SignCodec):
    """Signum: momentum on each worker, then the majority vote of the signs."""

    name = "signum"
    summary = "Signum: sign of the local momentum, majority vote (1 bit per element), all-gathered"
    caveat = ("majority vote without error feedback: may lose accuracy, tune the momentum; traffic grows "
              "with P (all-gather). Carries its own momentum: SGD's is turned off.")
    Options = SignumOptions
    payload = MajoritySign
    encode_passes = 5  # + the momentum's three passes

    def wrap(self, inner: Compressor, store: ParamStore) -> Direct:
        """Momentum ``m <- beta m + (1 - beta) g``; the sign of ``m`` is sent."""
        return Momentum(inner, beta=self.options.momentum, store=store)

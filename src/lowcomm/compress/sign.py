"""Sign compression: 1 bit per element, packed 8 per byte, plus one fp32 scale per tensor.

* :class:`ScaledSign` — EF-SignSGD (Karimireddy et al. 2019): ``(||x||_1 / d) * sign(x)`` per
  fused tensor; workers' decoded payloads are averaged. Use it inside
  :class:`~lowcomm.compress.feedback.ErrorFeedback`.
* :class:`MajoritySign` — Signum (Bernstein et al. 2018): same payload, but the aggregate is
  the majority vote ``sign(sum_i sign(x_i))``, scaled per tensor by the workers' mean
  ``||x||_1 / d`` so the result has gradient-like magnitude and the usual SGD learning rate
  works (the vote itself is unchanged; a scale of 1 gives textbook Signum).

``sign(0)`` is taken as +1 (bit set for ``x >= 0``): one bit cannot say "zero".
Signs are not sum-compatible, so both are all-gather-kind compressors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lowcomm.compress.base import Compressor

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS_CACHE.get(device)
    if s is None:
        s = torch.arange(8, dtype=torch.uint8, device=device)
        _SHIFTS_CACHE[device] = s
    return s


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bits ``x >= 0`` of a flat tensor, packed little-endian 8 per uint8 (ceil(n/8) bytes)."""
    flat = x.reshape(-1)
    n = flat.numel()
    bits = (flat >= 0).to(torch.uint8)
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    bits = bits.view(-1, 8) << _shifts(x.device)
    return bits.sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: a flat tensor of +1/-1 of length ``numel``."""
    bits = (packed.reshape(-1, 1) >> _shifts(packed.device)) & 1
    bits = bits.reshape(-1)[:numel]
    return bits.to(dtype).mul_(2).sub_(1)


def _segments(n: int, segments: Sequence[int] | None) -> list[int]:
    seg = list(segments) if segments else [n]
    if sum(seg) != n:
        raise ValueError(f"segments sum to {sum(seg)}, tensor has {n} elements")
    return seg


def _l1_scales(x: torch.Tensor, seg: list[int]) -> torch.Tensor:
    return torch.stack([p.abs().mean() for p in x.split(seg)]).to(torch.float32)


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

    aggregation = "all_gather"

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        seg = _segments(tensor.numel(), segments)
        return [pack_signs(tensor), _l1_scales(tensor, seg)], (tensor.numel(), tensor.dtype, seg)

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        numel, dtype, seg = ctx
        return unpack_signs(payload[0], numel, dtype).mul_(_expand(payload[1], seg, dtype))

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        return (numel + 7) // 8 + 4 * num_tensors


class MajoritySign(ScaledSign):
    """Majority vote of the workers' signs, scaled by their mean ``||x||_1/d`` per segment."""

    def aggregate(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Any) -> torch.Tensor:
        numel, dtype, seg = ctx
        votes = unpack_signs(payloads[0][0], numel, dtype)
        scales = payloads[0][1].clone()
        for p in payloads[1:]:
            votes.add_(unpack_signs(p[0], numel, dtype))
            scales.add_(p[1])
        scales.div_(len(payloads))
        return votes.sign_().mul_(_expand(scales, seg, dtype))

"""fp16 / bf16: halve the bytes with a sum-compatible cast (all-reduce kind).

The tensor is divided by the world size *before* the cast (as PyTorch's fp16 hook does) so
that the sum of P half-precision values does not overflow where the mean would not.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lowcomm.compress.base import Compressor


class CastCompressor(Compressor):
    aggregation = "all_reduce"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def compress(
        self, tensor: torch.Tensor, segments: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        return [tensor.to(self.dtype)], tensor.dtype

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        return payload[0].to(ctx)

    def payload_bytes(self, numel: int, dtype: torch.dtype, num_tensors: int = 1) -> int:
        return numel * torch.empty((), dtype=self.dtype).element_size()

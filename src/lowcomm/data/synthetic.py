"""Random data for timing runs: any input shape, classes or token vocabulary.

Labels carry no signal, so accuracy on it means nothing; bundles are marked
``synthetic=True`` and every report shows "synthetic (timing only)". Generation is seeded
(``seed``), so every rank builds the same tensors without communicating.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import TensorDataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.errors import UsageError


def parse_shape(shape: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """Accept ``"3,32,32"``, ``"3x32x32"`` or a sequence of ints."""
    if shape is None:
        return None
    if isinstance(shape, str):
        parts = [p for p in shape.replace("x", ",").split(",") if p.strip()]
        try:
            out = tuple(int(p) for p in parts)
        except ValueError:
            raise UsageError(f"synthetic: input_shape must be integers like 3,32,32, got {shape!r}") from None
    else:
        out = tuple(int(s) for s in shape)
    if not out or any(s <= 0 for s in out):
        raise UsageError(f"synthetic: input_shape must be positive integers, got {shape!r}")
    return out


@register_dataset("synthetic")
def synthetic(
    *,
    data_dir: Path | None,
    seed: int,
    input_shape: str | Sequence[int] | None = None,
    num_classes: int = 10,
    vocab_size: int | None = None,
    num_samples: int = 1024,
) -> DataBundle:
    """Images/features ``N(0, 1)`` with uniform labels, or uniform tokens if ``vocab_size``.

    ``input_shape`` defaults to ``(3, 32, 32)`` (classification) or ``(35,)`` (tokens: the
    sequence length). The test split has ``num_samples // 4`` samples (at least 1).
    """
    shape = parse_shape(input_shape)
    if num_samples < 1:
        raise UsageError(f"synthetic: num_samples must be >= 1, got {num_samples}")
    n_test = max(1, num_samples // 4)
    g = torch.Generator().manual_seed(seed)
    if vocab_size is not None:
        if vocab_size < 2:
            raise UsageError(f"synthetic: vocab_size must be >= 2, got {vocab_size}")
        shape = shape or (35,)
        if len(shape) != 1:
            raise UsageError(f"synthetic: token data needs input_shape (T,), got {shape}")
        t = shape[0]

        def tokens(n: int) -> TensorDataset:
            seq = torch.randint(0, vocab_size, (n, t + 1), generator=g, dtype=torch.int64)
            return TensorDataset(seq[:, :-1].clone(), seq[:, 1:].clone())

        return DataBundle(name="synthetic", train=tokens(num_samples), test=tokens(n_test),
                          task="language_model", input_shape=shape, vocab_size=vocab_size,
                          synthetic=True)
    if num_classes < 2:
        raise UsageError(f"synthetic: num_classes must be >= 2, got {num_classes}")
    shape = shape or (3, 32, 32)

    def samples(n: int) -> TensorDataset:
        x = torch.randn((n, *shape), generator=g)
        y = torch.randint(0, num_classes, (n,), generator=g, dtype=torch.int64)
        return TensorDataset(x, y)

    return DataBundle(name="synthetic", train=samples(num_samples), test=samples(n_test),
                      task="classification", input_shape=shape, num_classes=num_classes,
                      synthetic=True)

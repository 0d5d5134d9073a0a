"""Mixed precision for the training loop: which autocast dtype, and whether a GradScaler.

Why apart: the choice (``--amp`` auto/fp16/bf16 by device) is made once and read by the
step, the evaluation and every method (through :meth:`Method.attach_scaler`); keeping it in
one place keeps the three in agreement.
"""

from __future__ import annotations

import torch

from lowcomm.runtime.config import TrainConfig


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``--amp``: plain ``--amp`` (``auto``) is bf16 on CPU and fp16 on
    CUDA (as it always was); ``fp16`` / ``bf16`` choose explicitly. None: no AMP."""
    mode = cfg.amp_mode()
    if mode is None:
        return None
    if mode == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.float16 if mode == "fp16" else torch.bfloat16


def grad_scaler(dtype: torch.dtype | None, device: torch.device) -> torch.amp.GradScaler | None:
    """A ``torch.amp.GradScaler`` for fp16 autocast (fp16 gradients underflow); None for bf16
    or no AMP. Every method takes it through ``Method.attach_scaler`` (after each wrap):
    comm hooks keep their state in unscaled units, the scheduling engine runs the scaler's
    unscale/skip on its gradient shards."""
    return torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


def autocast(dtype: torch.dtype | None, device: torch.device) -> torch.autocast:
    """Autocast to ``dtype`` on ``device``'s type, or a disabled autocast for None."""
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)

"""Loss scaling (fp16 AMP) seen from the gradient synchronization: hooks and the engine.

Under ``torch.amp.GradScaler`` backward produces gradients multiplied by the loss scale
``S``, and ``S`` changes during training (halved after an overflow, doubled after
``growth_interval`` clean steps). State that outlives a step -- error-feedback memory,
Signum's momentum -- must not be kept in those units: after ``S`` doubles, last step's
residual would count half as much as it should. So a stateful method divides the bucket by
``S`` before compressing (state and payload in *unscaled* units) and multiplies its decoded
result by ``S`` again, so that ``scaler.unscale_`` and its inf check downstream see exactly
what they would see without compression.

``S`` is read as a device tensor (``GradScaler._get_scale_async()``), never with
``.item()``: reading it on the host would synchronize with the GPU once per bucket.
"""

from __future__ import annotations


import torch


def current_scale(scaler: torch.amp.GradScaler | None, device: torch.device | None = None) -> torch.Tensor | None:
    """The loss scale the gradients of this backward carry, as a 0-dim tensor, or None.

    None when no scaler is attached, when it is disabled, or before its first ``scale()``
    (the gradients are then not scaled). A *copy*: ``GradScaler.update()`` rewrites its
    scale tensor in place, and a decode that runs after the update (DeAR decodes before the
    next forward) must multiply by the scale that was divided out, not by the new one.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = scaler._get_scale_async()
    if scale is None:
        return None
    scale = scale.detach()
    if device is not None and scale.device != device:
        return scale.to(device, non_blocking=True)
    return scale.clone()

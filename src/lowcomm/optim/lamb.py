"""LAMB: layer-wise adaptive moments (You et al. 2019, arXiv 1904.00962, Algorithm 2).

Adam's per-element step, rescaled per tensor so that no layer moves by more than its weights
allow -- what made batch 32k-64k BERT pre-training work where Adam(W) diverges:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w     (m_hat, v_hat: bias-corrected)
    w -= lr * (||w|| / ||u||) * u                          (ratio 1 where a norm is 0)

Biases and norm parameters (``ndim <= 1``, or a group with ``exclude_from_adaptation``) take
Adam's step with neither the ratio nor decay. The step count is a per-parameter device
tensor and the bias corrections are computed from it on the device (``torch._foreach_pow``),
so, as in :class:`~lowcomm.optim.lars.LARS`, the multi-tensor path has no host sync;
``foreach=False`` is the per-parameter loop with the same arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch

from lowcomm.errors import UsageError
from lowcomm.optim.adaptive import LayerwiseOptimizer, buckets, dense_grads, check_hyper, is_adapted, norm, norms, trust_ratios
from lowcomm.optim.lars import ParamsT


class LAMB(LayerwiseOptimizer):
    """Adam moments with a layer-wise trust ratio.

    Args:
        params: parameters or param groups (a group may set ``exclude_from_adaptation=True``).
        lr: learning rate (paper: 1e-3 to 1e-2 for very large batches, with warm-up).
        betas: the moments' decay rates.
        eps: added to ``sqrt(v_hat)`` (1e-6, the paper's value).
        weight_decay: decoupled decay added to the Adam step, inside the ratio (adapted tensors only).
        bias_correction: divide the moments by ``1 - beta^t`` (the paper does).
        exclude_1d: no ratio and no decay for tensors with ``ndim <= 1`` (biases, norms).
        trust_clip: cap on the trust ratio (None: none; the paper's clamp function phi).
        foreach: multi-tensor kernels (True) or a per-parameter loop (False).
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True, *,
                 exclude_1d: bool = True, trust_clip: float | None = None, foreach: bool = True) -> None:
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise UsageError(f"LAMB: betas must be two numbers (beta1, beta2), got {betas!r}")
        check_hyper("LAMB", lr=lr, weight_decay=weight_decay, eps=eps, beta1=(betas[0], 0.0, 1.0),
                    beta2=(betas[1], 0.0, 1.0))
        if trust_clip is not None and not trust_clip > 0:
            raise UsageError(f"LAMB: trust_clip must be > 0 or None, got {trust_clip!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, exclude_1d=exclude_1d, trust_clip=trust_clip,
                        foreach=foreach)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, then each step count moved onto its parameter's device (torch keeps
        a ``step`` where the checkpoint was mapped; the multi-tensor kernels need it beside the
        parameter)."""
        super().load_state_dict(state_dict)
        for p, s in self.state.items():
            step = s.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                s["step"] = step.to(p.device)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        s = self.state[p]
        if "step" not in s:
            s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return s

    def _step_foreach(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for b in buckets(group, group["exclude_1d"], "LAMB"):
            states = [self._state(p) for p in b.params]
            steps = [s["step"] for s in states]
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
            torch._foreach_add_(steps, 1.0)
            torch._foreach_lerp_(m, b.grads, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, b.grads, b.grads, value=1 - beta2)
            # u = (m / bc1) / (sqrt(v / bc2) + eps), built in one temporary: every extra full-size
            # temporary is another pass over all the parameters' memory
            u = torch._foreach_sqrt(v)
            if group["bias_correction"]:
                bc1 = torch._foreach_pow(beta1, steps)  # beta^t as device tensors: no host sync
                torch._foreach_neg_(bc1)
                torch._foreach_add_(bc1, 1.0)
                bc2 = torch._foreach_pow(beta2, steps)
                torch._foreach_neg_(bc2)
                torch._foreach_add_(bc2, 1.0)
                torch._foreach_sqrt_(bc2)
                torch._foreach_div_(u, bc2)
                torch._foreach_add_(u, eps)
                torch._foreach_mul_(u, bc1)
            else:
                torch._foreach_add_(u, eps)
            torch._foreach_div_(u, m)  # denominator / m ...
            torch._foreach_reciprocal_(u)  # ... inverted: m / denominator
            adapted_u, _ = b.split(u)
            adapted_p, _ = b.split(b.params)
            if adapted_p:
                if wd:
                    torch._foreach_add_(adapted_u, adapted_p, alpha=wd)
                trust = trust_ratios(norms(adapted_p), norms(adapted_u), 1.0,
                                     clip=group["trust_clip"])
                torch._foreach_mul_(adapted_u, trust)
            torch._foreach_add_(b.params, u, alpha=-lr)

    def _step_loop(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p, g in dense_grads(group, "LAMB"):
            s = self._state(p)
            s["step"].add_(1.0)
            s["exp_avg"].lerp_(g, 1 - beta1)
            s["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            u = s["exp_avg_sq"].sqrt()
            if group["bias_correction"]:
                bc1 = 1 - torch.pow(beta1, s["step"])
                bc2 = 1 - torch.pow(beta2, s["step"])
                u.div_(bc2.sqrt()).add_(eps).mul_(bc1)
            else:
                u.add_(eps)
            u.div_(s["exp_avg"]).reciprocal_()
            if is_adapted(group, p, group["exclude_1d"]):
                if wd:
                    u.add_(p, alpha=wd)
                (trust,) = trust_ratios([norm(p)], [norm(u)], 1.0,
                                        clip=group["trust_clip"])
                u.mul_(trust)
            p.add_(u, alpha=-lr)

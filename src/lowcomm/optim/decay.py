"""Frobenius decay for factorized layers (Pufferfish/Cuttlefish regularizer): an update-axis
regularizer, applied to the synchronized gradients right before the optimizer step.

Plain weight decay on the two factors ``A`` (out x r) and ``B`` (r x in) penalizes
``‖A‖² + ‖B‖²``, which depends on how the product is split between them. Frobenius decay
penalizes the product instead, ``λ/2·‖A·B‖²``, whose gradients are ``λ·A(BBᵀ)`` for ``A``
and ``λ·(AᵀA)B`` for ``B`` — computed through the small r x r Gram matrices, so the cost is
``O(r²(in+out))`` rather than forming the dense weight.
"""

from __future__ import annotations

import torch
from torch import nn

from lowcomm.lowrank.layers import LowRankConv, LowRankLinear, LowRankLSTM


def _pair_(a: torch.Tensor, b: torch.Tensor, a_grad: torch.Tensor, b_grad: torch.Tensor, lam: float) -> None:
    """Batched over leading dims: ``a (..., m, r)``, ``b (..., r, n)``."""
    a_grad.add_(torch.matmul(a, torch.matmul(b, b.transpose(-1, -2))), alpha=lam)
    b_grad.add_(torch.matmul(torch.matmul(a.transpose(-1, -2), a), b), alpha=lam)


@torch.no_grad()
def frobenius_decay_(model: nn.Module, lam: float) -> None:
    """Add ``λ·∂(½‖A·B‖²)`` to the gradients of every factor pair in ``model`` (in place).

    Why on the gradients and not in the loss: the penalty's gradient has this closed form
    through r x r Gram matrices, cheaper than differentiating ``‖A·B‖²`` through autograd,
    and it leaves the loss (and its logged value) the task's own."""
    for mod in model.modules():
        if isinstance(mod, LowRankLinear):
            v = mod.v.weight
            u = mod.u.weight if mod.blocks == 1 else mod.u_blocks
            if u.grad is None or v.grad is None:
                continue
            g, r = mod.blocks, mod.rank
            a = u.reshape(g, -1, r)
            _pair_(a, v.reshape(g, r, -1), u.grad.view(g, -1, r), v.grad.view(g, r, -1), lam)
        elif isinstance(mod, LowRankConv):
            u, v = mod.u.weight, mod.v.weight
            if u.grad is None or v.grad is None:
                continue
            r = mod.rank
            _pair_(u.reshape(-1, r), v.reshape(r, -1), u.grad.view(-1, r), v.grad.view(r, -1), lam)
        elif isinstance(mod, LowRankLSTM):
            for layer in range(mod.num_layers):
                for kind in ("ih", "hh"):
                    u = getattr(mod, f"weight_{kind}_u_l{layer}")  # (4, h, r)
                    v = getattr(mod, f"weight_{kind}_v_l{layer}")  # (4r, in)
                    if u.grad is None or v.grad is None:
                        continue
                    r = u.shape[2]
                    _pair_(u, v.reshape(4, r, -1), u.grad, v.grad.view(4, r, -1), lam)

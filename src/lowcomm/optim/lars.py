"""LARS: layer-wise adaptive rate scaling (You, Gitman and Ginsburg 2017, arXiv 1708.03888).

Large global batches need large learning rates, and one large LR diverges on the layers whose
update is large compared to their weights (often the first and the last). LARS gives every
parameter tensor its own *trust ratio*

    trust = eta * ||w|| / (||g|| + weight_decay * ||w|| + eps)

and takes SGD's step on the rescaled, decayed gradient ``trust * (g + weight_decay * w)``:
momentum buffer ``b = momentum * b + d``, ``w -= lr * b`` (or Nesterov's ``d + momentum * b``).
This is the form of the common implementations (the rescaled gradient goes *into* the
momentum, as in torch's SGD), so ``lr`` has its usual meaning and warm-up + polynomial decay
(``lowcomm.optim.schedules``) apply unchanged. Biases and norm parameters (every tensor with
``ndim <= 1``, and every group marked ``exclude_from_adaptation``) take the plain SGD step
with neither trust ratio nor weight decay (Jia et al. 2018).

Two code paths with the same arithmetic: ``foreach=True`` (default) runs each operation
once per parameter group on torch's multi-tensor kernels (``torch._foreach_*``, norms with
``torch._foreach_norm``, ratios as device tensors: no host sync, so the step is correct and
fast on CUDA), ``foreach=False`` loops over parameters (the reference the benchmark and the
equivalence test compare with).

Any torch optimizer underneath: :class:`LARSWrapper` applies the same trust ratio to the
gradients and then calls a wrapped optimizer's ``step`` (e.g. ``torch.optim.SGD`` with its
own fused kernel, or Adam); :class:`LARS` is the one the trainer builds, because its
checkpoint is an ordinary optimizer state dict and its decay is where LARS puts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lowcomm.errors import UsageError
from lowcomm.optim.adaptive import LayerwiseOptimizer, buckets, dense_grads, check_hyper, is_adapted, norm, norms, trust_ratios

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


class LARS(LayerwiseOptimizer):
    """SGD with momentum and a layer-wise trust ratio.

    Args:
        params: parameters or param groups (a group may set ``exclude_from_adaptation=True``).
        lr: the global learning rate (scaled with the batch: the linear scaling rule,
            ``lr = base_lr * global_batch / 256``, then warm-up; docs/largebatch.md).
        momentum: heavy-ball momentum (0 = none).
        weight_decay: L2 decay added to the gradient before the trust ratio (adapted tensors only).
        eta: the trust coefficient (You et al.: 0.001); ``trust_coefficient`` is its alias.
        eps: added to the ratio's denominator (a zero norm gives ratio 1 anyway).
        nesterov: Nesterov momentum.
        exclude_1d: no trust ratio and no decay for tensors with ``ndim <= 1`` (biases, norms).
        trust_clip: cap on the trust ratio (None: none). LARC's clipping in effect.
        foreach: multi-tensor kernels (True) or a per-parameter loop (False).
    """

    def __init__(self, params: ParamsT, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, eps: float = 1e-8, nesterov: bool = False, *, exclude_1d: bool = True,
                 trust_clip: float | None = None, foreach: bool = True,
                 trust_coefficient: float | None = None) -> None:
        if trust_coefficient is not None:
            eta = trust_coefficient
        check_hyper("LARS", lr=lr, weight_decay=weight_decay, eps=eps, momentum=(momentum, 0.0, 1.0),
                    eta=(eta, 0.0, float("inf")))
        if eta <= 0:
            raise UsageError(f"LARS: eta (trust coefficient) must be > 0, got {eta!r}")
        if nesterov and momentum == 0:
            raise UsageError("LARS: nesterov needs momentum > 0")
        if trust_clip is not None and not trust_clip > 0:
            raise UsageError(f"LARS: trust_clip must be > 0 or None, got {trust_clip!r}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                        nesterov=nesterov, exclude_1d=exclude_1d, trust_clip=trust_clip, foreach=foreach)
        super().__init__(params, defaults)

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum buffer of ``p``, zeros at first (``m * 0 + d = d``: torch SGD's start)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _step_foreach(self, group: dict[str, Any]) -> None:
        lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
        for b in buckets(group, group["exclude_1d"], "LARS"):
            adapted_p, _ = b.split(b.params)
            adapted_g, plain_g = b.split(b.grads)
            updates: list[torch.Tensor] = []
            if adapted_p:
                trust = trust_ratios(norms(adapted_p), norms(adapted_g), group["eta"], wd, group["eps"],
                                     group["trust_clip"])
                if wd:
                    d = torch._foreach_add(adapted_g, adapted_p, alpha=wd)
                    torch._foreach_mul_(d, trust)
                else:
                    d = torch._foreach_mul(adapted_g, trust)
                updates.extend(d)
            plain = list(plain_g)
            # back in bucket order, so that each update meets its parameter and buffer
            it_a, it_p = iter(updates), iter(plain)
            d_all = [next(it_a) if a else next(it_p) for a in b.adapted]
            if mom:
                bufs = [self._buffer(p) for p in b.params]
                torch._foreach_mul_(bufs, mom)
                torch._foreach_add_(bufs, d_all)
                if group["nesterov"]:
                    d_all = list(torch._foreach_add(d_all, bufs, alpha=mom))
                else:
                    d_all = bufs
            torch._foreach_add_(b.params, d_all, alpha=-lr)

    def _step_loop(self, group: dict[str, Any]) -> None:
        lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p, g in dense_grads(group, "LARS"):
            if is_adapted(group, p, group["exclude_1d"]):
                (trust,) = trust_ratios([norm(p)], [norm(g)], group["eta"], wd, group["eps"], group["trust_clip"])
                d = g.add(p, alpha=wd).mul_(trust) if wd else g.mul(trust)
            else:
                d = g
            if mom:
                buf = self._buffer(p)
                buf.mul_(mom).add_(d)
                d = d.add(buf, alpha=mom) if group["nesterov"] else buf
            p.add_(d, alpha=-lr)


class LARSWrapper:
    """LARS's trust ratio in front of any torch optimizer.

    ``step()`` replaces each adapted gradient by ``trust * (g + weight_decay * w)`` (the same
    ratio as :class:`LARS`, computed with ``torch._foreach_norm``, no host sync) and then calls
    ``optimizer.step()``. The wrapped optimizer must not decay itself (its groups'
    ``weight_decay`` must be 0: LARS's decay belongs inside the ratio); refused otherwise.
    ``LARSWrapper(torch.optim.SGD(params, lr, momentum))`` is :class:`LARS` (up to rounding).
    State dicts are the wrapped optimizer's, so checkpoints stay ordinary.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, eta: float = 0.001, weight_decay: float = 0.0,
                 eps: float = 1e-8, *, exclude_1d: bool = True, trust_clip: float | None = None) -> None:
        check_hyper("LARSWrapper", lr=0.0, weight_decay=weight_decay, eps=eps, eta=(eta, 0.0, float("inf")))
        if eta <= 0:
            raise UsageError(f"LARSWrapper: eta (trust coefficient) must be > 0, got {eta!r}")
        for g in optimizer.param_groups:
            if g.get("weight_decay", 0):
                raise UsageError("LARSWrapper: give the weight decay to the wrapper (weight_decay=...), not to the "
                                 f"wrapped {type(optimizer).__name__} (its groups have weight_decay="
                                 f"{g['weight_decay']!r}); LARS decays inside the trust ratio")
        self.optimizer = optimizer
        self.eta, self.weight_decay, self.eps = eta, weight_decay, eps
        self.exclude_1d, self.trust_clip = exclude_1d, trust_clip

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (an LR scheduler goes on ``wrapper.optimizer``)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state: the wrapper keeps none."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (an ordinary checkpoint)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def rescale_grads(self) -> None:
        """Replace every adapted ``p.grad`` by its LARS-scaled, decayed version (in place)."""
        wd = self.weight_decay
        for group in self.optimizer.param_groups:
            for b in buckets(group, self.exclude_1d, "LARSWrapper"):
                ps, _ = b.split(b.params)
                gs, _ = b.split(b.grads)
                if not ps:
                    continue
                trust = trust_ratios(norms(ps), norms(gs), self.eta, wd, self.eps,
                                     self.trust_clip)
                if wd:
                    torch._foreach_add_(gs, ps, alpha=wd)
                torch._foreach_mul_(gs, trust)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Rescale the gradients, then the wrapped optimizer's step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.rescale_grads()
        self.optimizer.step()
        return loss

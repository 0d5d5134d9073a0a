"""Local training of one client, and flat-vector access to the worker's one model.

Why this is its own module: a worker trains thousands of tiny clients per round (40 samples,
batch 16: three steps each), so the per-client and per-step overhead *is* the round time.
Three choices keep it small:

* The model's parameters are re-pointed, once, to views of ONE flat buffer, and their
  gradients to views of one flat gradient buffer (autograd accumulates into an existing
  ``.grad`` in place). Loading the global weights is then one ``copy_``, reading the local
  weights needs no ``torch.cat``, and an SGD step is a handful of whole-vector kernels
  instead of one small kernel per parameter tensor.
* The batch order is one ``randperm`` and one ``index_select`` per epoch; batches are then
  contiguous slices (views), so a step allocates nothing but autograd's own temporaries.
* No ``.item()`` or other host sync inside the loop.

A model with dropout gets torch's global RNG seeded from the client's generator before its
local training, so a client's result depends on (seed, round, client) only, not on which
worker trained it or after which other clients.

The step is torch's SGD (``torch.optim.SGD`` with dampening 0, no Nesterov): weight decay
and the algorithm's correction are added to the gradient, then momentum, then
``w -= lr * d``. With momentum 0 and no correction it is bit-for-bit ``torch.optim.SGD``,
which is what the Flower side of ``benchmarks/fl_vs_flower.py`` runs for FedAvg.

Buffers (BatchNorm running statistics) are not part of the flat vector: the global model is
the parameters. Use GroupNorm or no normalization in federated models.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lowcomm.errors import UsageError
from lowcomm.fl.api import ClientContext

__all__ = [
    "GradientCorrection", "flat_params", "flat_view", "load_flat_", "local_sgd", "momentum_steps_norm", "num_params",
]


@dataclass
class GradientCorrection:
    """A term added to every local gradient: ``g + offset + mu * (w - anchor)``.

    It covers the published corrections: FedProx (``mu``, ``anchor`` = global weights),
    SCAFFOLD (``offset = c - c_i``) and FedDyn (``offset = -grad_i``, ``mu = alpha``).
    ``offset`` and ``anchor`` are flat tensors with one element per model parameter.
    """

    offset: Tensor | None = None
    mu: float = 0.0
    anchor: Tensor | None = None

    def __post_init__(self) -> None:
        if self.mu != 0.0 and self.anchor is None:
            raise UsageError("GradientCorrection: mu != 0 needs an anchor (the flat global weights)")


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class _FlatLayout:
    """One model's parameters as views of a flat buffer (and gradients of a flat gradient)."""

    def __init__(self, model: nn.Module) -> None:
        params = list(model.parameters())
        if not params:
            raise UsageError("federated training needs a model with parameters; this one has none")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise UsageError(
                f"federated training needs all parameters in one dtype on one device; got dtypes "
                f"{sorted(str(d) for d in dtypes)} on devices {sorted(str(d) for d in devices)}"
            )
        with torch.no_grad():
            self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        self.grad = torch.zeros_like(self.flat)
        self.params = params
        self.grad_views: list[Tensor] = []
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.flat[offset:offset + n].view_as(p)
            self.grad_views.append(self.grad[offset:offset + n].view_as(p))
            offset += n
        self.ptrs = [p.data_ptr() for p in params]
        self.stochastic = any(isinstance(m, _DROPOUT) or (isinstance(m, nn.RNNBase) and m.dropout > 0)
                              for m in model.modules())
        # a frozen parameter must not move under weight decay or a proximal term
        self.mask: Tensor | None = None
        if not all(p.requires_grad for p in params):
            self.mask = torch.cat([torch.full((p.numel(),), float(p.requires_grad), dtype=self.flat.dtype,
                                              device=self.flat.device) for p in params])

    def valid_for(self, model: nn.Module) -> bool:
        """False when someone replaced the parameters (``model.to(other_device)``, a new tensor)."""
        params = list(model.parameters())
        return (len(params) == len(self.params)
                and all(p is q for p, q in zip(params, self.params))
                and all(p.data_ptr() == ptr for p, ptr in zip(params, self.ptrs)))

    def attach_grads(self) -> None:
        """Point every ``.grad`` at its view (``zero_grad(set_to_none=True)`` drops them)."""
        for p, g in zip(self.params, self.grad_views):
            if p.requires_grad and p.grad is not g:
                p.grad = g


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, _FlatLayout] = weakref.WeakKeyDictionary()


def _layout(model: nn.Module) -> _FlatLayout:
    layout = _LAYOUTS.get(model)
    if layout is None or not layout.valid_for(model):
        layout = _FlatLayout(model)
        _LAYOUTS[model] = layout
    return layout


def num_params(model: nn.Module) -> int:
    """Number of elements of the flat weight vector (every parameter, trainable or not)."""
    return int(_layout(model).flat.numel())


def flat_view(model: nn.Module) -> Tensor:
    """The model's live flat weights (no copy): changes when the model trains; do not resize."""
    return _layout(model).flat


def flat_params(model: nn.Module) -> Tensor:
    """A flat fp32 copy of the model's weights (the order of ``model.parameters()``)."""
    return _layout(model).flat.to(torch.float32, copy=True)


def load_flat_(model: nn.Module, flat: Tensor) -> None:
    """Copy a flat vector into the model's weights: one kernel (the engine does this per client)."""
    layout = _layout(model)
    if flat.numel() != layout.flat.numel():
        raise UsageError(f"flat vector has {flat.numel()} elements, the model has {layout.flat.numel()} parameters")
    with torch.no_grad():
        layout.flat.copy_(flat.reshape(-1))


def _constant_term(correction: GradientCorrection | Tensor | None, like: Tensor) -> tuple[Tensor | None, float]:
    """``offset - mu * anchor`` (fixed during local training) and ``mu``: the per-step work is
    then ``g += mu * w + constant``."""
    if correction is None:
        return None, 0.0
    if isinstance(correction, Tensor):
        correction = GradientCorrection(offset=correction)
    const: Tensor | None = None
    for name, t in (("offset", correction.offset), ("anchor", correction.anchor)):
        if t is not None and t.numel() != like.numel():
            raise UsageError(f"correction {name} has {t.numel()} elements, the model has {like.numel()} parameters")
    if correction.offset is not None:
        const = correction.offset.reshape(-1).to(like.dtype, copy=True)
    if correction.mu != 0.0 and correction.anchor is not None:
        anchor = correction.anchor.reshape(-1).to(like.dtype)
        const = anchor.mul(-correction.mu) if const is None else const.sub_(anchor, alpha=correction.mu)
    return const, float(correction.mu)


def local_sgd(ctx: ClientContext, correction: GradientCorrection | Tensor | None = None) -> int:
    """Mini-batch SGD on ``ctx.model`` over the client's samples; returns the number of steps.

    ``ctx.train.local_epochs`` epochs, each over a new permutation drawn from
    ``ctx.generator`` (CPU), in batches of ``ctx.train.batch_size`` with the last partial
    batch kept; loss ``ctx.loss_fn`` (mean cross-entropy). ``correction`` (a flat tensor is
    an ``offset``) is added to every gradient before the step.
    """
    model, train = ctx.model, ctx.train
    layout = _layout(model)
    n = int(ctx.x.shape[0])
    if n == 0:
        return 0
    if ctx.y.shape[0] != n:
        raise UsageError(f"client {ctx.client_id}: {n} inputs but {ctx.y.shape[0]} labels")
    w, g = layout.flat, layout.grad
    const, mu = _constant_term(correction, w)
    decay = train.weight_decay + mu
    lr, momentum, bs = train.lr, train.momentum, train.batch_size
    buf: Tensor | None = None
    layout.attach_grads()
    model.train()
    if layout.stochastic:
        # dropout draws from torch's global RNG: seed it from the client's generator so that a
        # client's training does not depend on which worker trained which clients before it
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=ctx.generator)))
    steps = 0
    for _ in range(train.local_epochs):
        perm = torch.randperm(n, generator=ctx.generator)
        if ctx.x.device != perm.device:
            perm = perm.to(ctx.x.device, non_blocking=True)
        xs, ys = ctx.x.index_select(0, perm), ctx.y.index_select(0, perm)
        for start in range(0, n, bs):
            g.zero_()
            loss = ctx.loss_fn(model(xs[start:start + bs]), ys[start:start + bs])
            loss.backward()
            with torch.no_grad():
                if decay != 0.0:
                    g.add_(w, alpha=decay)
                if const is not None:
                    g.add_(const)
                if layout.mask is not None:
                    g.mul_(layout.mask)
                if momentum != 0.0:
                    buf = g.clone() if buf is None else buf.mul_(momentum).add_(g)
                    w.sub_(buf, alpha=lr)
                else:
                    w.sub_(g, alpha=lr)
            steps += 1
    g.zero_()
    return steps


def momentum_steps_norm(steps: int, momentum: float) -> float:
    """``||a||_1`` of FedNova for ``steps`` SGD steps with heavy-ball ``momentum`` (Wang et al.
    2020): ``sum_{k=1..tau} (1 - rho^k) / (1 - rho)``; ``tau`` itself without momentum."""
    if momentum == 0.0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)

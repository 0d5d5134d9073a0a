"""Per-layer-type K-FAC math: the Kronecker factors' statistics and the gradient as a matrix.

Why one class per layer type: each type sees its input and output in its own shape (a Linear
any number of leading dims, a Conv2d patches, an Embedding indices), but the preconditioner
needs the same three things from all of them: ``A`` from the input (``in x in``, or its
diagonal), ``G`` from the gradient of the output (``out x out``), and the weight gradient as one
``out x in`` matrix (bias as the last column, matching the homogeneous coordinate of ``A``).
Everything here is tensor math on the parameters' device: no host reads, so the hooks that
call it never stall a CUDA stream.

Scaling (the convention kfac-pytorch/KAISA uses; the tests state it independently): with ``N``
rows after flattening and ``B`` the leading (batch) dimension of the output gradient,
``A = aᵀa / N`` and ``G = (B·g)ᵀ(B·g) / N`` (the loss is a mean over the batch, so ``B·g`` is
the per-example gradient). A Conv2d's ``L`` spatial positions are rows too, with KAISA's
``1/L`` on the patches and ``L`` on the output gradient; a Conv1d is a Conv2d of height 1.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.errors import UsageError

#: layer types left to the base optimizer without a warning (as in KAISA): their parameters
#: are vectors, for which a Kronecker factorization means nothing
_QUIET = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


class KFACLayer(ABC):
    """One preconditioned layer: its name, module, factor sizes and factor statistics."""

    #: True when ``A`` is diagonal (stored and communicated as a vector)
    a_diagonal = False

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module

    @property
    def weight(self) -> torch.Tensor:
        """The weight parameter (its device and the grads' device are the factors' device)."""
        return self.module.weight  # type: ignore[return-value]

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias parameter, or None."""
        b = getattr(self.module, "bias", None)
        return b if isinstance(b, torch.Tensor) else None

    @property
    @abstractmethod
    def a_dim(self) -> int:
        """Size of ``A`` (input features, +1 for the bias' homogeneous coordinate)."""

    @property
    def g_dim(self) -> int:
        """Size of ``G`` (output features)."""
        return int(self.weight.shape[0])

    @abstractmethod
    def a_stat(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``A`` of one (micro-)batch from the module's positional inputs, in float32."""

    def g_stat(self, grad_output: torch.Tensor) -> torch.Tensor:
        """``G`` of one (micro-)batch from the gradient of the module's output, in float32."""
        g = grad_output.detach().to(torch.float32)
        batch = g.shape[0] if g.dim() > 1 else 1
        g = g.reshape(-1, g.shape[-1]) * batch
        return g.t() @ (g / g.shape[0])

    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient as ``g_dim x a_dim`` (bias last), or None when the weight has none."""
        w = self.weight.grad
        if w is None:
            return None
        m = w.reshape(w.shape[0], -1)
        b = self.bias
        if b is not None:
            gb = b.grad if b.grad is not None else torch.zeros_like(b)
            m = torch.cat([m, gb.reshape(-1, 1)], dim=1)
        return m

    def set_grad(self, matrix: torch.Tensor) -> None:
        """Write a ``g_dim x a_dim`` matrix back into the parameters' ``.grad`` (in place)."""
        w = self.weight
        assert w.grad is not None
        cols = w.grad[0].numel()
        w.grad.copy_(matrix[:, :cols].reshape(w.grad.shape))
        b = self.bias
        if b is not None and b.grad is not None:
            b.grad.copy_(matrix[:, cols].reshape(b.grad.shape))


def _homogeneous(a: torch.Tensor, bias: bool) -> torch.Tensor:
    """Append the constant-1 column that makes the bias part of the weight matrix."""
    if not bias:
        return a
    return torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)


class LinearLayer(KFACLayer):
    """``nn.Linear`` (any leading dims): ``a`` is the input row, plus 1 with a bias."""

    @property
    def a_dim(self) -> int:
        """Input features (+1 with a bias)."""
        return int(self.weight.shape[1]) + (self.bias is not None)

    def a_stat(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``aᵀa / N`` over all rows of the input."""
        x = inputs[0].detach().to(torch.float32)
        a = _homogeneous(x.reshape(-1, x.shape[-1]), self.bias is not None)
        return a.t() @ (a / a.shape[0])


class Conv2dLayer(KFACLayer):
    """``nn.Conv2d`` (groups 1, zero padding): ``a`` is an unfolded patch, scaled by ``1/L``."""

    @property
    def a_dim(self) -> int:
        """``in·kh·kw`` (+1 with a bias)."""
        return int(self.weight[0].numel()) + (self.bias is not None)

    def _geometry(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Kernel, dilation, padding and stride as the 2-D pairs ``unfold`` takes."""
        m = self.module
        assert isinstance(m, nn.Conv2d)
        return m.kernel_size, m.dilation, m.padding, m.stride  # type: ignore[return-value]

    def _as_2d(self, t: torch.Tensor) -> torch.Tensor:
        """The module's input or output gradient as ``(B, C, H, W)``."""
        return t

    def a_stat(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Patches via ``unfold`` (rows: batch x positions), each divided by ``L``."""
        kernel, dilation, padding, stride = self._geometry()
        x = self._as_2d(inputs[0].detach().to(torch.float32))
        patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)  # (B, in·kh·kw, L)
        spatial = patches.shape[-1]
        a = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        a = _homogeneous(a, self.bias is not None) / spatial
        return a.t() @ (a / x.shape[0])

    def g_stat(self, grad_output: torch.Tensor) -> torch.Tensor:
        """Output gradient per position (rows: batch x positions), times ``B·L``."""
        g = self._as_2d(grad_output.detach().to(torch.float32))
        batch, spatial = g.shape[0], g.shape[2] * g.shape[3]
        g = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) * (batch * spatial)
        return g.t() @ (g / g.shape[0])


class Conv1dLayer(Conv2dLayer):
    """``nn.Conv1d`` (groups 1, zero padding) as a Conv2d with kernel ``(1, k)`` on a height-1
    input: the same patches, ``L`` and scaling, so one convention (and one tested code path)
    serves both; the ``out x in x k`` weight flattens to ``out x in·k`` like ``out x in·kh·kw``.
    An unbatched ``(C, L)`` input is one example, as ``nn.Conv1d`` treats it."""

    def _geometry(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
        """``(1, k)`` and friends: the height axis is a single row, never padded or strided."""
        m = self.module
        assert isinstance(m, nn.Conv1d)
        pad = m.padding
        assert not isinstance(pad, str)  # refused by _why_not
        return (1, m.kernel_size[0]), (1, m.dilation[0]), (0, pad[0]), (1, m.stride[0])

    def _as_2d(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, C, L)`` (or unbatched ``(C, L)``) -> ``(B, C, 1, L)``."""
        if t.dim() == 2:
            t = t.unsqueeze(0)
        return t.unsqueeze(2)


class EmbeddingLayer(KFACLayer):
    """``nn.Embedding``: ``a`` is one-hot, so ``A`` is diagonal (the index frequencies).

    The weight is ``num x dim`` with rows indexed by the input, i.e. the transpose of a
    Linear's ``out x in``: the gradient matrix is its transpose, ``dim x num``.
    """

    a_diagonal = True

    @property
    def a_dim(self) -> int:
        """Number of embeddings (no bias)."""
        return int(self.weight.shape[0])

    @property
    def g_dim(self) -> int:
        """Embedding dimension."""
        return int(self.weight.shape[1])

    def a_stat(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Index frequencies as a vector (``scatter_add``: no host read, unlike ``bincount``)."""
        idx = inputs[0].detach().reshape(-1)
        counts = torch.zeros(self.a_dim, dtype=torch.float32, device=idx.device)
        counts.index_add_(0, idx, torch.ones(idx.shape[0], dtype=torch.float32, device=idx.device))
        return counts / max(1, idx.shape[0])

    def grad_matrix(self) -> torch.Tensor | None:
        """``dim x num``: the transposed weight gradient."""
        w = self.weight.grad
        return None if w is None else w.t()

    def set_grad(self, matrix: torch.Tensor) -> None:
        """Write the ``dim x num`` matrix back, transposed."""
        assert self.weight.grad is not None
        self.weight.grad.copy_(matrix.t())


def _why_not(module: nn.Module) -> str | None:
    """Why a module of a supported type cannot be preconditioned, or None if it can."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        kind = type(module).__name__
        if module.groups != 1:
            return f"{kind} with groups={module.groups} (only groups=1 is built)"
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            return f"{kind} with string padding or a padding_mode other than 'zeros'"
    if isinstance(module, nn.Embedding) and module.sparse:
        return "Embedding with sparse=True (sparse gradients are not preconditioned)"
    return None


def _make(name: str, module: nn.Module) -> KFACLayer | None:
    if isinstance(module, nn.Linear):
        return LinearLayer(name, module)
    if isinstance(module, nn.Conv2d):
        return Conv2dLayer(name, module)
    if isinstance(module, nn.Conv1d):
        return Conv1dLayer(name, module)
    if isinstance(module, nn.Embedding):
        return EmbeddingLayer(name, module)
    return None


def _matches(name: str, cls: str, patterns: Sequence[str]) -> bool:
    """True if ``name`` (or its class name) equals or fully matches one of ``patterns``
    (a pattern that is not a valid regex matches by equality only)."""
    for p in patterns:
        if p in (name, cls):
            return True
        try:
            if re.fullmatch(p, name):
                return True
        except re.error:
            continue
    return False


def discover(model: nn.Module, skip_layers: Iterable[str] = ()) -> tuple[list[KFACLayer], list[str]]:
    """The layers to precondition, in module order, and one reason per layer left out.

    A layer matched by ``skip_layers`` (its name, its class name, or a regex that fully
    matches its name), or inside a matched module, is left to the base optimizer silently:
    the user asked for it. ``nn.MultiheadAttention`` is left out with a reason (its
    projections run inside ``F.multi_head_attention_forward``: ``out_proj``'s hooks never
    fire, kfac-pytorch issue 267), and so is every other module that owns parameters and is
    neither supported nor a normalization layer (the reason names it).
    """
    patterns = list(skip_layers)
    layers: list[KFACLayer] = []
    reasons: list[str] = []
    skipped: list[str] = []  # prefixes whose whole subtree is out

    def inside(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skipped)

    for name, module in model.named_modules():
        if inside(name):
            continue
        label = name or "<model>"
        if name and _matches(name, type(module).__name__, patterns):
            skipped.append(name)
            continue
        if isinstance(module, nn.MultiheadAttention):
            skipped.append(name)
            reasons.append(
                f"K-FAC skips nn.MultiheadAttention {label!r}: its projections run inside "
                "F.multi_head_attention_forward (out_proj's hooks never fire); left to the "
                "base optimizer (lowcomm's LowRankMultiheadAttention is preconditioned)"
            )
            continue
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        layer = _make(name, module)
        why = _why_not(module) if layer is not None else None
        if layer is not None and why is None and module.weight.requires_grad:  # type: ignore[union-attr]
            layers.append(layer)
        elif own and not isinstance(module, _QUIET):
            kind = why or f"{type(module).__name__} (no K-FAC factors for this layer type)"
            reasons.append(f"K-FAC skips {label!r}: {kind}; left to the base optimizer")
    return layers, reasons


def unwrap(model: Any) -> nn.Module:
    """The module inside DDP / DataParallel (hooks go on the real layers), or ``model``."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"KFAC needs a torch.nn.Module (bare or DDP-wrapped), got {type(model).__name__}")
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model

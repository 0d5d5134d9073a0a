"""Elastic operators: full-size weights, of which each forward uses the active slice.

Why slicing (as in OFA's ``dynamic_op.py``) and not one module per choice: every sub-network
shares the same numbers, so training one sub-network trains all that overlap with it, and a
sub-network is extracted by copying slices. Active *input* channels always follow the tensor
that arrives (``x.shape[1]``): the producer decides them, so width changes propagate without
the consumer being told. Active output channels, kernel size are set by the owning block.

Kernel elasticity (OFA): a kernel smaller than the maximum is the centre crop of the
next-larger *active* kernel, multiplied by a learned ``k^d x k^d`` matrix (one per shrink step
7->5, 5->3, shared by all channels of the layer, initialised to the identity). Without the
matrix the 3x3 centre would have to serve both as the middle of a 7x7 filter and as a 3x3
filter on its own; the matrix lets the small kernel re-mix it. Padding is "same" (k // 2).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowcomm.errors import UsageError

Dim = Literal[1, 2]


def check_dim(dim: int) -> None:
    """Refuse spatial dimensionalities other than 1 (sequences) and 2 (images)."""
    if dim not in (1, 2):
        raise UsageError(f"elastic ops are 1-D or 2-D (dim=1|2), got dim={dim!r}")


def conv_cls(dim: int) -> type[nn.Conv1d] | type[nn.Conv2d]:
    """``nn.Conv1d`` or ``nn.Conv2d``."""
    return nn.Conv1d if dim == 1 else nn.Conv2d


def bn_cls(dim: int) -> type[nn.BatchNorm1d] | type[nn.BatchNorm2d]:
    """``nn.BatchNorm1d`` or ``nn.BatchNorm2d``."""
    return nn.BatchNorm1d if dim == 1 else nn.BatchNorm2d


def _first(t: Tensor, n: int, dim: int = 0) -> Tensor:
    """The first ``n`` entries along ``dim``; the tensor itself when that is all of it (a
    full-size slice would still cost a zero-filled gradient buffer and a copy in backward,
    which is a noticeable share of a small network's step on CPU)."""
    return t if t.shape[dim] == n else t.narrow(dim, 0, n)


def _center_crop(weight: Tensor, k: int, dim: int) -> Tensor:
    full = weight.shape[-1]
    start = (full - k) // 2
    w = weight[..., start:start + k]
    if dim == 2:
        w = w[..., start:start + k, :]
    return w


def _depthwise(x: Tensor, w: Tensor, b: Tensor | None, stride: int, pad: int, dim: int) -> Tensor:
    """Depthwise conv computed as a channels-last 2-D conv.

    Why: on CPU, the weight gradient of a contiguous (NCHW) depthwise conv takes a slow path
    (~5x slower than the whole channels-last forward+backward on MNIST-1D-sized tensors);
    the values are the same convolution.
    """
    c = x.shape[1]
    if dim == 1:
        x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        y = F.conv2d(x4, w.unsqueeze(2), b, (1, stride), (0, pad), 1, c)
        return y.squeeze(2).contiguous()
    y = F.conv2d(x.contiguous(memory_format=torch.channels_last), w, b, stride, pad, 1, c)
    return y.contiguous()


class ElasticConv(nn.Module):
    """A 1-D/2-D convolution with elastic kernel size, output channels and input channels.

    ``groups="depthwise"`` makes a depthwise conv (one filter per channel; active output
    channels = active input channels). ``kernel_choices=(1,)`` is a pointwise conv, which
    only has elastic width.
    """

    def __init__(
        self,
        dim: int,
        in_channels: int,
        out_channels: int,
        kernel_choices: tuple[int, ...] | list[int] = (3, 5, 7),
        stride: int = 1,
        groups: int | Literal["depthwise"] = 1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        check_dim(dim)
        ks = tuple(sorted(set(int(k) for k in kernel_choices)))
        if not ks or any(k < 1 or k % 2 == 0 for k in ks):
            raise UsageError(f"kernel choices must be odd positive sizes, got {list(kernel_choices)}")
        self.depthwise = groups == "depthwise"
        if self.depthwise:
            if in_channels != out_channels:
                raise UsageError(
                    f"a depthwise conv keeps its channel count, got in={in_channels} out={out_channels}"
                )
        elif groups != 1:
            raise UsageError(f"groups must be 1 or 'depthwise', got {groups!r}")
        self.dim = dim
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_choices = ks
        self.stride = int(stride)
        kmax = ks[-1]
        shape = (out_channels, 1 if self.depthwise else in_channels) + (kmax,) * dim
        # Initialised like nn.Conv of the full size (kaiming uniform, a=sqrt(5)).
        ref = conv_cls(dim)(shape[1], out_channels, kmax, bias=bias)
        self.weight = nn.Parameter(ref.weight.detach().clone())
        self.bias = nn.Parameter(ref.bias.detach().clone()) if bias and ref.bias is not None else None
        # One transform per shrink step, named like OFA's ("7to5"), identity at start.
        self.transforms = nn.ParameterDict()
        for big, small in zip(ks[1:][::-1], ks[:-1][::-1], strict=True):
            self.transforms[f"{big}to{small}"] = nn.Parameter(torch.eye(small**dim))
        self.active_kernel = kmax
        self.active_out = out_channels

    def extra_repr(self) -> str:
        """The active choices, shown by ``print(module)``."""
        return (
            f"dim={self.dim}, {self.in_channels}, {self.out_channels}, kernels={list(self.kernel_choices)}, "
            f"stride={self.stride}, depthwise={self.depthwise}, active=(k={self.active_kernel}, "
            f"out={self.active_out})"
        )

    def set_active(self, *, kernel: int | None = None, out_channels: int | None = None) -> None:
        """Choose the kernel size and (not for depthwise) the output channel count."""
        if kernel is not None:
            if kernel not in self.kernel_choices:
                raise UsageError(f"kernel {kernel} is not one of this conv's {list(self.kernel_choices)}")
            self.active_kernel = int(kernel)
        if out_channels is not None:
            if not 1 <= out_channels <= self.out_channels:
                raise UsageError(f"active out channels must be in [1, {self.out_channels}], got {out_channels}")
            self.active_out = int(out_channels)

    def kernel_weight(self, kernel: int, *, keep_unused: bool = False) -> Tensor:
        """The full-channel filters of size ``kernel`` (crop + transform chain from the max).

        ``keep_unused`` adds ``0 * sum`` of the transforms the chain did not use, so that every
        parameter is in the autograd graph (DDP without ``find_unused_parameters`` needs it).
        """
        w: Tensor = self.weight
        ks = self.kernel_choices
        unused: list[Tensor] = []
        for big, small in zip(ks[1:][::-1], ks[:-1][::-1], strict=True):
            mat = self.transforms[f"{big}to{small}"]
            if small < kernel:
                unused.append(mat)
                continue
            crop = _center_crop(w, small, self.dim)
            flat = crop.reshape(crop.shape[0], crop.shape[1], small**self.dim)
            w = (flat @ mat.t()).reshape(crop.shape)  # OFA: F.linear(filter, matrix)
        if keep_unused and unused:
            w = w + sum(m.sum() for m in unused) * 0.0
        return w

    def active_weight(self, in_channels: int, *, keep_unused: bool = False) -> Tensor:
        """Filters for ``in_channels`` active inputs at the active kernel and width."""
        w = self.kernel_weight(self.active_kernel, keep_unused=keep_unused)
        if self.depthwise:
            return _first(w, in_channels)
        return _first(_first(w, self.active_out), in_channels, dim=1)

    def out_channels_for(self, in_channels: int) -> int:
        """Active output channels when ``in_channels`` arrive."""
        return in_channels if self.depthwise else self.active_out

    def forward(self, x: Tensor) -> Tensor:
        """Convolve with the active slice (input channels from ``x``)."""
        cin = x.shape[1]
        if cin > self.in_channels:
            raise UsageError(f"{cin} input channels reach a conv built for at most {self.in_channels}")
        w = self.active_weight(cin, keep_unused=self.training)
        cout = w.shape[0]
        b = None if self.bias is None else _first(self.bias, cout)
        groups = cin if self.depthwise else 1
        pad = self.active_kernel // 2
        if self.depthwise:
            return _depthwise(x, w, b, self.stride, pad, self.dim)
        if self.dim == 1:
            return F.conv1d(x, w, b, self.stride, pad, 1, groups)
        return F.conv2d(x, w, b, self.stride, pad, 1, groups)

    def extract(self, in_channels: int) -> nn.Conv1d | nn.Conv2d:
        """A plain ``nn.Conv1d/2d`` computing the active conv for ``in_channels`` inputs
        (weights copied, kernel transforms applied)."""
        with torch.no_grad():
            w = self.active_weight(in_channels).detach().clone()
            cout = w.shape[0]
            k = self.active_kernel
            conv = conv_cls(self.dim)(
                in_channels, cout, k, stride=self.stride, padding=k // 2,
                groups=in_channels if self.depthwise else 1, bias=self.bias is not None,
            )
            conv.weight.copy_(w)
            if self.bias is not None and conv.bias is not None:
                conv.bias.copy_(self.bias[:cout])
        return conv


class ElasticBatchNorm(nn.Module):
    """Batch norm over the first ``x.shape[1]`` channels of a full-size ``nn.BatchNorm``.

    The full-size BN lives in ``self.bn`` (a real ``nn.BatchNorm1d/2d``), so code that finds
    BN layers by type (re-calibration, ``SyncBatchNorm`` conversion) sees it; the forward
    calls ``F.batch_norm`` on slices of its tensors, which updates the running statistics of
    exactly the active channels in place.
    """

    def __init__(self, dim: int, channels: int, *, eps: float = 1e-5, momentum: float | None = 0.1) -> None:
        super().__init__()
        check_dim(dim)
        self.dim = dim
        self.channels = channels
        self.bn: nn.BatchNorm1d | nn.BatchNorm2d = bn_cls(dim)(channels, eps=eps, momentum=momentum)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the active channels (mirrors ``_BatchNorm.forward`` on slices)."""
        bn = self.bn
        c = x.shape[1]
        if c > self.channels:
            raise UsageError(f"{c} channels reach a batch norm built for at most {self.channels}")
        factor = 0.0
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
        use_batch = bn.training or bn.running_mean is None
        track = not bn.training or bn.track_running_stats
        rm = _first(bn.running_mean, c) if track and bn.running_mean is not None else None
        rv = _first(bn.running_var, c) if track and bn.running_var is not None else None
        w = None if bn.weight is None else _first(bn.weight, c)
        b = None if bn.bias is None else _first(bn.bias, c)
        return F.batch_norm(x, rm, rv, w, b, use_batch, factor, bn.eps)

    def extract(self, channels: int) -> nn.BatchNorm1d | nn.BatchNorm2d:
        """A plain BN of ``channels`` with the affine parameters and running stats copied."""
        src = self.bn
        out = bn_cls(self.dim)(channels, eps=src.eps, momentum=src.momentum)
        with torch.no_grad():
            if src.weight is not None:
                out.weight.copy_(src.weight[:channels])
                out.bias.copy_(src.bias[:channels])
            if src.running_mean is not None and out.running_mean is not None:
                out.running_mean.copy_(src.running_mean[:channels])
            if src.running_var is not None and out.running_var is not None:
                out.running_var.copy_(src.running_var[:channels])
            if src.num_batches_tracked is not None and out.num_batches_tracked is not None:
                out.num_batches_tracked.copy_(src.num_batches_tracked)
        out.train(src.training)
        return out


class ElasticLinear(nn.Module):
    """A linear layer using the first ``x.shape[-1]`` input features (a head after elastic width)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: Tensor) -> Tensor:
        """``x @ W[:, :in].T + b``."""
        cin = x.shape[-1]
        if cin > self.in_features:
            raise UsageError(f"{cin} features reach a linear layer built for at most {self.in_features}")
        return F.linear(x, _first(self.linear.weight, cin, dim=1), self.linear.bias)

    def extract(self, in_features: int) -> nn.Linear:
        """A plain ``nn.Linear`` on ``in_features`` inputs, weights copied."""
        lin = nn.Linear(in_features, self.out_features, bias=self.linear.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(self.linear.weight[:, :in_features])
            if lin.bias is not None and self.linear.bias is not None:
                lin.bias.copy_(self.linear.bias)
        return lin


def make_act(name: str) -> nn.Module:
    """A fresh activation module by name: relu, relu6, hswish."""
    acts: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "relu6": nn.ReLU6, "hswish": nn.Hardswish}
    if name not in acts:
        raise UsageError(f"unknown activation {name!r}; valid: {sorted(acts)}")
    return acts[name]()


ELASTIC_OPS = (ElasticConv, ElasticBatchNorm, ElasticLinear)

__all__ = [
    "ELASTIC_OPS",
    "ElasticBatchNorm",
    "ElasticConv",
    "ElasticLinear",
    "bn_cls",
    "check_dim",
    "conv_cls",
    "make_act",
]

"""Elastic inverted-residual blocks and stages, their plain extracted forms, channel sorting.

:class:`ElasticMBBlock` is MobileNetV2's block (1x1 expand + BN + act, kxk depthwise + BN +
act, 1x1 project + BN, identity shortcut when the shape allows) with elastic kernel, expansion
ratio and output width. The active middle width is ``round(active_in * expand)`` (as in OFA:
the expansion multiplies the channels that actually arrive). :class:`ElasticStage` runs the
first ``depth`` of its blocks, all at one output width (percent of the stage's maximum).

``extract`` turns the active configuration into :class:`MBBlock` / ``nn.Sequential`` built
only from ``nn.Conv``/``nn.BatchNorm``/activations, with weights (kernel transforms applied)
and running statistics copied: what a deployment runs, and what the latency table times.

Channel sorting (OFA's ``re_organize_middle_weights``): slicing keeps the *first* channels,
so before shrinking expansion or width the most important channels are moved to the front.
Importance of a channel = L1 norm of the weights that read it in the next layer. Permuting a
channel consistently in its producer (conv out-channel, BN), the depthwise conv and its
consumers (next conv's in-channel) leaves the function unchanged.

Residuals and width: a shortcut adds the block input to its output channel by channel, so the
whole chain of blocks joined by shortcuts carries one channel order ("stream"). Width sorting
therefore permutes a stream at once: every producer's output channels and every consumer's
input channels in it. A shortcut whose two sides are active at different widths (possible
only when a stage's first block is stride 1 with equal max channels) adds the narrower tensor
onto the first channels of the wider one (zero padding), in the supernet and the extracted
block alike.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lowcomm.elastic.ops import ElasticBatchNorm, ElasticConv, bn_cls, check_dim, conv_cls, make_act
from lowcomm.errors import UsageError


def _add_shortcut(y: Tensor, x: Tensor) -> Tensor:
    """``y + x`` where the narrower of the two is zero-padded in channels."""
    cy, cx = y.shape[1], x.shape[1]
    if cy == cx:
        return y + x
    if cx > cy:
        return y + x[:, :cy]
    return torch.cat([y[:, :cx] + x, y[:, cx:]], dim=1)


class MBBlock(nn.Module):
    """The plain (extracted) inverted-residual block: no elastic machinery."""

    def __init__(self, expand: nn.Sequential, depthwise: nn.Sequential, project: nn.Sequential,
                 residual: bool) -> None:
        super().__init__()
        self.expand = expand
        self.depthwise = depthwise
        self.project = project
        self.residual = residual

    def forward(self, x: Tensor) -> Tensor:
        """Expand, depthwise, project (+ shortcut). Images go through the depthwise conv in
        channels-last layout, as in the supernet (same values; its CPU backward is ~3x faster)."""
        h = self.expand(x)
        if h.dim() == 4:
            h = h.contiguous(memory_format=torch.channels_last)
        y = self.project(self.depthwise(h).contiguous())
        return _add_shortcut(y, x) if self.residual else y


def middle_channels(active_in: int, expand: int) -> int:
    """Active expanded width for ``active_in`` input channels at expansion ratio ``expand``."""
    return max(1, int(round(active_in * expand)))


class ElasticMBBlock(nn.Module):
    """Inverted residual block with elastic kernel, expansion and output width.

    Built for at most ``in_channels`` inputs and ``out_channels`` outputs; the full middle
    width is ``in_channels * max(expand_choices)``.
    """

    def __init__(
        self,
        dim: int,
        in_channels: int,
        out_channels: int,
        *,
        kernel_choices: tuple[int, ...] = (3, 5, 7),
        expand_choices: tuple[int, ...] = (2, 3, 4),
        stride: int = 1,
        act: str = "relu",
    ) -> None:
        super().__init__()
        check_dim(dim)
        if not expand_choices or any(int(e) < 1 for e in expand_choices):
            raise UsageError(f"expand choices must be integers >= 1, got {list(expand_choices)}")
        self.dim = dim
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_choices = tuple(sorted(kernel_choices))
        self.expand_choices = tuple(sorted(int(e) for e in expand_choices))
        self.stride = stride
        self.act_name = act
        mid = in_channels * self.expand_choices[-1]
        self.mid_channels = mid
        self.expand_conv = ElasticConv(dim, in_channels, mid, (1,))
        self.expand_bn = ElasticBatchNorm(dim, mid)
        self.dw_conv = ElasticConv(dim, mid, mid, self.kernel_choices, stride, groups="depthwise")
        self.dw_bn = ElasticBatchNorm(dim, mid)
        self.project_conv = ElasticConv(dim, mid, out_channels, (1,))
        self.project_bn = ElasticBatchNorm(dim, out_channels)
        self.act = make_act(act)
        self.residual = stride == 1 and in_channels == out_channels
        self.active_kernel = self.kernel_choices[-1]
        self.active_expand = self.expand_choices[-1]
        self.active_out = out_channels

    def extra_repr(self) -> str:
        """The active choices, shown by ``print(module)``."""
        return (
            f"active=(k={self.active_kernel}, e={self.active_expand}, out={self.active_out}), "
            f"residual={self.residual}"
        )

    def set_active(self, *, kernel: int | None = None, expand: int | None = None,
                   out_channels: int | None = None) -> None:
        """Choose kernel size, expansion ratio and output width (UsageError if invalid)."""
        if kernel is not None:
            self.dw_conv.set_active(kernel=kernel)
            self.active_kernel = int(kernel)
        if expand is not None:
            if expand not in self.expand_choices:
                raise UsageError(f"expand {expand} is not one of this block's {list(self.expand_choices)}")
            self.active_expand = int(expand)
        if out_channels is not None:
            self.project_conv.set_active(out_channels=out_channels)
            self.active_out = int(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        """Run the active configuration (input width from ``x``)."""
        self.expand_conv.set_active(out_channels=middle_channels(x.shape[1], self.active_expand))
        y = self.act(self.expand_bn(self.expand_conv(x)))
        y = self.act(self.dw_bn(self.dw_conv(y)))
        y = self.project_bn(self.project_conv(y))
        return _add_shortcut(y, x) if self.residual else y

    def extract(self, in_channels: int) -> MBBlock:
        """The active block for ``in_channels`` inputs as a plain :class:`MBBlock`."""
        mid = middle_channels(in_channels, self.active_expand)
        self.expand_conv.set_active(out_channels=mid)
        block = MBBlock(
            nn.Sequential(self.expand_conv.extract(in_channels), self.expand_bn.extract(mid), make_act(self.act_name)),
            nn.Sequential(self.dw_conv.extract(mid), self.dw_bn.extract(mid), make_act(self.act_name)),
            nn.Sequential(self.project_conv.extract(mid), self.project_bn.extract(self.active_out)),
            self.residual,
        )
        block.train(self.training)
        return block

    def sort_middle(self) -> None:
        """OFA's ``re_organize_middle_weights``: order the expanded channels by the L1 norm of
        the project conv's weights reading them (most important first)."""
        w = self.project_conv.weight.detach()
        importance = w.abs().transpose(0, 1).reshape(w.shape[1], -1).sum(dim=1)
        perm = torch.argsort(importance, descending=True, stable=True)
        permute_out(self.expand_conv, self.expand_bn, perm)
        permute_out(self.dw_conv, self.dw_bn, perm)
        permute_in(self.project_conv, perm)

    def input_importance(self) -> Tensor:
        """L1 importance of each input channel as read by the expand conv (for width sorting)."""
        w = self.expand_conv.weight.detach()
        return w.abs().transpose(0, 1).reshape(w.shape[1], -1).sum(dim=1)


def permute_out(conv: ElasticConv, bn: ElasticBatchNorm | None, perm: Tensor) -> None:
    """Reorder a conv's output channels (and the BN after it) by ``perm``."""
    with torch.no_grad():
        conv.weight.copy_(conv.weight[perm])
        if conv.bias is not None:
            conv.bias.copy_(conv.bias[perm])
        if bn is not None:
            b = bn.bn
            for t in (b.weight, b.bias, b.running_mean, b.running_var):
                if t is not None:
                    t.copy_(t[perm])


def permute_in(conv: ElasticConv, perm: Tensor) -> None:
    """Reorder a (non-depthwise) conv's input channels by ``perm``."""
    if conv.depthwise:
        raise UsageError("a depthwise conv's inputs are permuted with its outputs (permute_out)")
    with torch.no_grad():
        conv.weight.copy_(conv.weight[:, perm])


class ElasticStage(nn.Module):
    """A list of blocks at one output width; the first ``depth`` run.

    The first block takes ``in_channels`` (and ``stride``); the others map ``out_channels``
    to itself with stride 1 and a shortcut.
    """

    def __init__(
        self,
        dim: int,
        in_channels: int,
        out_channels: int,
        *,
        max_depth: int,
        stride: int = 1,
        kernel_choices: tuple[int, ...] = (3, 5, 7),
        expand_choices: tuple[int, ...] = (2, 3, 4),
        act: str = "relu",
    ) -> None:
        super().__init__()
        if max_depth < 1:
            raise UsageError(f"a stage needs at least one block, got max_depth={max_depth}")
        self.dim = dim
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.blocks = nn.ModuleList(
            ElasticMBBlock(dim, in_channels if i == 0 else out_channels, out_channels,
                           kernel_choices=kernel_choices, expand_choices=expand_choices,
                           stride=stride if i == 0 else 1, act=act)
            for i in range(max_depth)
        )
        self.active_depth = max_depth
        self.active_out = out_channels

    def block_list(self) -> list[ElasticMBBlock]:
        """The blocks, typed."""
        return [b for b in self.blocks if isinstance(b, ElasticMBBlock)]

    def extra_repr(self) -> str:
        """The active choices, shown by ``print(module)``."""
        return f"active=(depth={self.active_depth}, out={self.active_out})"

    def set_active(self, *, depth: int | None = None, kernels: list[int] | None = None,
                   expands: list[int] | None = None, out_channels: int | None = None) -> None:
        """Depth, per-block kernels and expansions (one per block, all of them), output width."""
        n = len(self.blocks)
        if depth is not None:
            if not 1 <= depth <= n:
                raise UsageError(f"stage depth must be in [1, {n}], got {depth}")
            self.active_depth = int(depth)
        for name, values in (("kernels", kernels), ("expands", expands)):
            if values is not None and len(values) != n:
                raise UsageError(f"{name} needs one value per block ({n}), got {values}")
        if out_channels is not None:
            self.active_out = int(out_channels)
        for i, block in enumerate(self.block_list()):
            block.set_active(
                kernel=None if kernels is None else kernels[i],
                expand=None if expands is None else expands[i],
                out_channels=self.active_out,
            )

    def forward(self, x: Tensor) -> Tensor:
        """The first ``active_depth`` blocks."""
        for block in self.blocks[: self.active_depth]:
            x = block(x)
        return x

    def extract(self, in_channels: int) -> nn.Sequential:
        """The active blocks as a plain ``nn.Sequential`` of :class:`MBBlock`."""
        out: list[nn.Module] = []
        cin = in_channels
        for block in self.block_list()[: self.active_depth]:
            out.append(block.extract(cin))
            cin = block.active_out
        return nn.Sequential(*out)

    def sort_middle(self) -> None:
        """Sort every block's expanded channels (:meth:`ElasticMBBlock.sort_middle`)."""
        for block in self.blocks:
            assert isinstance(block, ElasticMBBlock)
            block.sort_middle()


def sort_stream(producers: list[tuple[ElasticConv, ElasticBatchNorm | None]],
                consumers: list[ElasticConv], extra_importance: Tensor | None = None) -> Tensor:
    """Width sorting of one channel stream (see the module doc): channels ordered by the summed
    L1 norm of the consumers' weights reading them (plus ``extra_importance``, e.g. a linear
    head's), then permuted in every producer's outputs and consumer's inputs. Returns the
    permutation so a caller can apply it to consumers of other kinds (a linear head)."""
    importance = torch.zeros(producers[0][0].weight.shape[0])
    for conv in consumers:
        w = conv.weight.detach()
        importance += w.abs().transpose(0, 1).reshape(w.shape[1], -1).sum(dim=1)
    if extra_importance is not None:
        importance += extra_importance
    perm = torch.argsort(importance, descending=True, stable=True)
    for conv, bn in producers:
        permute_out(conv, bn, perm)
    for conv in consumers:
        permute_in(conv, perm)
    return perm


ELASTIC_BLOCKS = (ElasticMBBlock, ElasticStage)

__all__ = [
    "ELASTIC_BLOCKS",
    "ElasticMBBlock",
    "ElasticStage",
    "MBBlock",
    "bn_cls",
    "conv_cls",
    "middle_channels",
    "permute_in",
    "permute_out",
    "sort_stream",
]

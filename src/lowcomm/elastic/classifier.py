"""Elastic classifiers (MNIST-1D, digits, CIFAR) built from the elastic blocks.

They prove the supernet machinery is not stereo-specific: the same blocks, search space,
sorting, extraction and latency units on a small image/sequence classifier that trains in
seconds on CPU. Layout: a fixed stem (conv + BN + act), ``stages`` elastic stages of
inverted-residual blocks (depth, per-block kernel and expansion, per-stage width), adaptive
average pooling to a small fixed grid, flatten, linear (flatten keeps *where* a feature is,
which MNIST-1D needs; the pooled grid makes the head independent of the input size).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lowcomm.elastic.blocks import ElasticMBBlock, ElasticStage, middle_channels, permute_out, sort_stream
from lowcomm.elastic.ops import ElasticBatchNorm, ElasticConv, ElasticLinear, bn_cls, check_dim, conv_cls, make_act
from lowcomm.elastic.space import Config, Dimension, SearchSpace
from lowcomm.elastic.supernet import LatencyUnit, Supernet
from lowcomm.errors import UsageError
from lowcomm.models import ModelInfo, register_model


class InputShape(nn.Module):
    """Reads flat inputs ``(B, C*prod(spatial))`` as ``(B, C, *spatial)``; shaped inputs pass."""

    def __init__(self, in_channels: int, spatial: tuple[int, ...]) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.spatial = tuple(spatial)

    def forward(self, x: Tensor) -> Tensor:
        """Reshape to ``(B, C, *spatial)``."""
        return x.reshape(x.shape[0], self.in_channels, *self.spatial)


def _pool(dim: int, size: int) -> nn.Module:
    return nn.AdaptiveAvgPool1d(size) if dim == 1 else nn.AdaptiveAvgPool2d(size)


def _down(shape: tuple[int, ...], stride: int) -> tuple[int, ...]:
    # "same" padding with odd kernels: out = ceil(in / stride), whatever the kernel size.
    return tuple((s - 1) // stride + 1 for s in shape)


class ElasticClassifier(Supernet):
    """``forward(x) -> (B, num_classes)`` for the active config; see the module doc."""

    def __init__(
        self,
        *,
        dim: int,
        in_channels: int,
        spatial: tuple[int, ...],
        num_classes: int,
        base_channels: int,
        stage_channels: Sequence[int],
        strides: Sequence[int],
        stem_stride: int = 1,
        max_depth: int = 3,
        kernels: Sequence[int] = (3, 5, 7),
        expands: Sequence[int] = (2, 3, 4),
        widths: Sequence[int] = (50, 75, 100),
        pool: int = 2,
        act: str = "relu",
    ) -> None:
        super().__init__()
        check_dim(dim)
        if len(stage_channels) != len(strides) or not stage_channels:
            raise UsageError(f"need one stride per stage, got channels {list(stage_channels)}, strides {list(strides)}")
        if any(not 1 <= w <= 100 for w in widths):
            raise UsageError(f"width choices are percentages in [1, 100], got {list(widths)}")
        self.dim = dim
        self.in_channels = in_channels
        self.spatial = tuple(spatial)
        self.num_classes = num_classes
        self.pool_size = pool
        self.act_name = act
        self.reshape = InputShape(in_channels, self.spatial)
        self.stem = nn.Sequential(
            conv_cls(dim)(in_channels, base_channels, 3, stride=stem_stride, padding=1, bias=False),
            bn_cls(dim)(base_channels),
            make_act(act),
        )
        self.stem_stride = stem_stride
        self.stage_strides = tuple(int(s) for s in strides)
        cin = base_channels
        stages = []
        for cout, stride in zip(stage_channels, self.stage_strides, strict=True):
            stages.append(ElasticStage(dim, cin, cout, max_depth=max_depth, stride=stride,
                                       kernel_choices=tuple(kernels), expand_choices=tuple(expands), act=act))
            cin = cout
        self.stages = nn.ModuleList(stages)
        self.stem_channels = base_channels
        self.pool = _pool(dim, pool)
        self.head = ElasticLinear(cin * pool**dim, num_classes)
        n_stages = len(stages)
        n_blocks = n_stages * max_depth
        self.space = SearchSpace(
            [
                Dimension("kernel", tuple(sorted(kernels)), n_blocks),
                Dimension("expand", tuple(sorted(expands)), n_blocks),
                Dimension("depth", tuple(range(1, max_depth + 1)), n_stages),
                Dimension("width", tuple(sorted(widths)), n_stages),
            ],
            depth_groups=[list(range(s * max_depth, (s + 1) * max_depth)) for s in range(n_stages)],
        )
        self.max_depth = max_depth
        self.set_active(self.space.max_config())

    # -- config ------------------------------------------------------------------------
    def stage_list(self) -> list[ElasticStage]:
        """The stages, typed."""
        return [s for s in self.stages if isinstance(s, ElasticStage)]

    def stage_width(self, stage: int, percent: int) -> int:
        """Active output channels of ``stage`` at ``percent`` of its maximum."""
        full = self.stage_list()[stage].out_channels
        return max(1, int(round(full * percent / 100)))

    def _apply_config(self, config: Config) -> None:
        d = self.max_depth
        for s, stage in enumerate(self.stage_list()):
            stage.set_active(
                depth=config["depth"][s],
                kernels=config["kernel"][s * d:(s + 1) * d],
                expands=config["expand"][s * d:(s + 1) * d],
                out_channels=self.stage_width(s, config["width"][s]),
            )

    def forward(self, x: Tensor) -> Tensor:
        """Logits of the active sub-network."""
        x = self.stem(self.reshape(x))
        for stage in self.stages:
            x = stage(x)
        return self.head(torch.flatten(self.pool(x), 1))

    # -- extraction --------------------------------------------------------------------
    def _extract(self, config: Config) -> nn.Module:
        layers: list[nn.Module] = [copy.deepcopy(self.reshape), copy.deepcopy(self.stem)]
        cin = self.stem_channels
        for stage in self.stage_list():
            layers.extend(stage.extract(cin))
            cin = stage.active_out
        layers += [copy.deepcopy(self.pool), nn.Flatten(1), self.head.extract(cin * self.pool_size**self.dim)]
        return nn.Sequential(*layers)

    # -- channel sorting ---------------------------------------------------------------
    def sort_channels(self) -> None:
        """Middle channels of every block, then stage widths (see blocks' module doc).

        Stages joined by a shortcut (a first block with stride 1 and equal channels) share one
        channel stream and are sorted together; a stream joined to the stem (whose width is
        not elastic) is left unsorted, which only matters for custom stage layouts: the
        registered models' first stage changes the channel count.
        """
        stages = self.stage_list()
        for stage in stages:
            stage.sort_middle()
        s = 0
        while s < len(stages):
            group = [s]
            while group[-1] + 1 < len(stages) and self._first_block(stages[group[-1] + 1]).residual:
                group.append(group[-1] + 1)
            linked_to_stem = s == 0 and self._first_block(stages[0]).residual
            if not linked_to_stem:
                self._sort_group([stages[i] for i in group], stages[group[-1] + 1] if group[-1] + 1 < len(stages) else None)
            s = group[-1] + 1

    @staticmethod
    def _first_block(stage: ElasticStage) -> ElasticMBBlock:
        block = stage.blocks[0]
        assert isinstance(block, ElasticMBBlock)
        return block

    def _sort_group(self, group: list[ElasticStage], next_stage: ElasticStage | None) -> None:
        producers: list[tuple[ElasticConv, ElasticBatchNorm | None]] = []
        consumers: list[ElasticConv] = []
        for stage in group:
            for i, block in enumerate(stage.blocks):
                assert isinstance(block, ElasticMBBlock)
                producers.append((block.project_conv, block.project_bn))
                if i > 0 or stage is not group[0]:
                    consumers.append(block.expand_conv)
        extra = None
        if next_stage is not None:
            consumers.append(self._first_block(next_stage).expand_conv)
        else:
            w = self.head.linear.weight.detach()
            c = group[-1].out_channels
            extra = w.abs().reshape(w.shape[0], c, -1).sum(dim=(0, 2))
        perm = sort_stream(producers, consumers, extra)
        if next_stage is None:
            with torch.no_grad():
                w = self.head.linear.weight
                c = group[-1].out_channels
                w.copy_(w.reshape(w.shape[0], c, -1)[:, perm].reshape(w.shape))

    # -- latency -----------------------------------------------------------------------
    def _build_block(self, config: Config, stage: int, index: int, cin: int) -> nn.Module:
        previous = self.active_config()
        try:
            self._apply_config(self.space.validate(config))
            block = self.stage_list()[stage].blocks[index]
            assert isinstance(block, ElasticMBBlock)
            with torch.no_grad():
                module = block.extract(cin)
        finally:
            self._apply_config(previous)
        return module.eval()

    def _build_head(self, cin: int) -> nn.Module:
        with torch.no_grad():
            return nn.Sequential(copy.deepcopy(self.pool), nn.Flatten(1),
                                 self.head.extract(cin * self.pool_size**self.dim)).eval()

    def _build_stem(self) -> nn.Module:
        return nn.Sequential(copy.deepcopy(self.reshape), copy.deepcopy(self.stem)).eval()

    def latency_units(self, config: Config, sample_shape: tuple[int, ...]) -> list[LatencyUnit]:
        """Stem, each active block, head (batch 1, per-sample input ``sample_shape``)."""
        cfg = self.space.canonical(config)
        sample = tuple(int(s) for s in sample_shape)
        if math.prod(sample) != self.in_channels * math.prod(self.spatial):
            raise UsageError(
                f"sample shape {sample} does not hold {self.in_channels}x{'x'.join(map(str, self.spatial))} inputs"
            )
        units = [LatencyUnit(f"stem:{self.dim}d:{sample}", self._build_stem, ((1, *sample),))]
        shape = _down(self.spatial, self.stem_stride)
        cin = self.stem_channels
        d = self.max_depth
        for s, stage in enumerate(self.stage_list()):
            cout = self.stage_width(s, cfg["width"][s])
            for j in range(cfg["depth"][s]):
                block = stage.blocks[j]
                assert isinstance(block, ElasticMBBlock)
                k, e = cfg["kernel"][s * d + j], cfg["expand"][s * d + j]
                key = (f"mb{self.dim}d:in{cin}:mid{middle_channels(cin, e)}:out{cout}:k{k}:s{block.stride}:"
                       f"res{int(block.residual)}:{self.act_name}:{shape}")
                units.append(LatencyUnit(key, functools.partial(self._build_block, cfg, s, j, cin),
                                         ((1, cin, *shape),)))
                shape = _down(shape, block.stride)
                cin = cout
        units.append(LatencyUnit(f"head:{self.dim}d:{cin}:{shape}:p{self.pool_size}:{self.num_classes}",
                                 functools.partial(self._build_head, cin), ((1, cin, *shape),)))
        return units


def _check_count(name: str, value: int, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _stage_channels(base: int, stages: int) -> list[int]:
    # 1.5x, 2x, 2.5x, ... the stem width: grows as the resolution shrinks.
    return [int(round(base * (1 + 0.5 * (i + 1)))) for i in range(stages)]


@register_model("elastic_cnn1d", info=ModelInfo(
    "classification", (40,), default_num_classes=10,
    description="elastic 1-D inverted-residual supernet (MNIST-1D; kernel/expand/depth/width)"))
def elastic_cnn1d(
    *,
    num_classes: int = 10,
    input_dim: int = 40,
    base_channels: int = 16,
    stages: int = 2,
    max_depth: int = 3,
    kernels: Sequence[int] = (3, 5, 7),
    expands: Sequence[int] = (2, 3, 4),
    widths: Sequence[int] = (50, 75, 100),
    act: str = "relu",
) -> ElasticClassifier:
    """Registry entry: (B, input_dim) read as (B, 1, input_dim); the stem and every stage
    halve the length (like the reference cnn1d's strided convs), pooled to 5 positions before
    the linear head. Two stages of up to three blocks by default: on two shared CPU cores each
    block costs a few ms per forward+backward of 64 samples (per-op overhead dominates at this
    size), and the supernet should train in seconds per epoch."""
    for name, v in (("num_classes", num_classes), ("input_dim", input_dim), ("base_channels", base_channels),
                    ("stages", stages), ("max_depth", max_depth)):
        _check_count(name, v)
    return ElasticClassifier(
        dim=1, in_channels=1, spatial=(input_dim,), num_classes=num_classes, base_channels=base_channels,
        stage_channels=_stage_channels(base_channels, stages), strides=[2] * stages, stem_stride=2,
        max_depth=max_depth,
        kernels=kernels, expands=expands, widths=widths, pool=5, act=act,
    )


@register_model("elastic_cnn2d", info=ModelInfo(
    "classification", (64,), default_num_classes=10,
    description="elastic 2-D inverted-residual supernet (digits 8x8, CIFAR; kernel/expand/depth/width)"))
def elastic_cnn2d(
    *,
    num_classes: int = 10,
    input_dim: int | None = None,
    in_channels: int = 1,
    image_size: int | None = None,
    base_channels: int = 16,
    stages: int = 3,
    max_depth: int = 3,
    kernels: Sequence[int] = (3, 5, 7),
    expands: Sequence[int] = (2, 3, 4),
    widths: Sequence[int] = (50, 75, 100),
    act: str = "relu",
) -> ElasticClassifier:
    """Registry entry: square images ``in_channels x image_size x image_size``; flat inputs
    (``input_dim`` features, e.g. 64 = 1x8x8 digits) are reshaped. Default: digits. The first
    stage keeps the resolution, the others halve it; pooled to 2x2 before the head."""
    _check_count("in_channels", in_channels)
    if image_size is None:
        features = 64 if input_dim is None else _check_count("input_dim", input_dim)
        side = math.isqrt(features // in_channels) if features % in_channels == 0 else 0
        if side < 2 or side * side * in_channels != features:
            raise UsageError(
                f"elastic_cnn2d reads {features} flat features as {in_channels} square channel(s), "
                "but they are not; pass image_size (and in_channels) or use elastic_cnn1d"
            )
        image_size = side
    _check_count("image_size", image_size, 2)
    if input_dim is not None and input_dim != in_channels * image_size**2:
        raise UsageError(
            f"input_dim={input_dim} does not match in_channels x image_size^2 = {in_channels * image_size**2}"
        )
    for name, v in (("num_classes", num_classes), ("base_channels", base_channels), ("stages", stages),
                    ("max_depth", max_depth)):
        _check_count(name, v)
    return ElasticClassifier(
        dim=2, in_channels=in_channels, spatial=(image_size, image_size), num_classes=num_classes,
        base_channels=base_channels, stage_channels=_stage_channels(base_channels, stages),
        strides=[1] + [2] * (stages - 1), max_depth=max_depth, kernels=kernels, expands=expands,
        widths=widths, pool=2, act=act,
    )


__all__ = ["ElasticClassifier", "InputShape", "elastic_cnn1d", "elastic_cnn2d", "permute_out"]

"""The elastic stereo network ``elastic_stereo`` (EASNet: an elastic AANet) and its extracted form.

Pipeline (both views share every weight and run as one batch of ``2B``)::

    x (B, 6, H, W) -> stem (stride 4) -> stage 0 (1/4) -> stage 1 (1/8) -> stage 2 (1/16)
                                             |                |                |
                       refinement <- head 0  <----------  head 1  <--------  head 2
                       (full res)   (correlation, coarse-to-fine fusion, aggregation, soft argmin)

Why 1/4, 1/8, 1/16 (EASNet/AANet use 1/3, 1/6, 1/12; PSMNet/GwcNet match at 1/4): CPU cost.
Depthwise convolutions with 7x7 kernels are slow to back-propagate on CPU; with stage 0 at 1/2
the full network took ~0.4 s for forward+backward of 4 pairs at 64x128 on 2 cores, at 1/4 it
takes ~0.15 s (measured; channels-last memory, set by the stem, halves the depthwise cost
again). ``stem_stride=2`` gives 1/2, 1/4, 1/8 for whoever has the compute. Each scale has
``ceil(max_disp / downsample) + 1`` candidates (9, 5, 3 at the default ``max_disp`` 32), so
candidate ``D - 1`` reaches ``max_disp`` at every scale; AANet's ``max_disp // downsample``
would stop at 28 px of 32 at 1/4, a blind range that only matters at small ``max_disp``.

Elastic dimensions (EASNet's, sized for CPU): per block ``kernel`` {3,5,7} and ``expand``
{2,4,6}, per stage ``depth`` {2,3,4}, and ``scales`` {1,2,3}: the number of pyramid levels
used, **finest first** (EASNet's rule): scales = s runs stages 0..s-1 and their heads only;
the coarser stages are never computed, so fewer scales is faster, and the finest level, which
localises best, is always kept. Heads, stem and refinement are plain modules shared by every
sub-network (a correlation volume has one channel per candidate whatever the feature width).

Outputs follow contract E4: training mode returns ``[disparity of each active scale, coarsest
first, ..., refined]``, each ``(B, H, W)`` at the input resolution; eval mode returns the refined
map only.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from lowcomm.elastic.blocks import ElasticMBBlock, ElasticStage
from lowcomm.elastic.space import Config, Dimension, Gate, SearchSpace
from lowcomm.elastic.stereo.costvolume import ScaleHead
from lowcomm.elastic.stereo.refine import Refinement
from lowcomm.elastic.supernet import LatencyUnit, Supernet
from lowcomm.errors import UsageError, check_count, check_positive
from lowcomm.models import ModelInfo, register_model

__all__ = ["ElasticStereoNet", "PairStem", "StereoNet", "elastic_stereo"]


class PairStem(nn.Module):
    """``(B, 6, H, W) -> (2B, C, H/stride, W/stride)``: split the pair, stack the views on the
    batch axis (one pass of shared weights), then ``log2(stride)`` x (3x3 conv s2, BN, ReLU)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for _ in range(int(math.log2(stride))):
            layers += [nn.Conv2d(cin, channels, 3, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
            cin = channels
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """See the class docstring."""
        pair = torch.cat([x[:, :3], x[:, 3:]], dim=0)
        return self.layers(pair.contiguous(memory_format=torch.channels_last))


def _check_input(x: Tensor, multiple: int) -> None:
    if x.dim() != 4 or x.shape[1] != 6:
        raise UsageError(
            f"elastic_stereo takes (B, 6, H, W) = left and right RGB images on channels, got {tuple(x.shape)}"
        )
    if x.shape[-2] % multiple or x.shape[-1] % multiple:
        raise UsageError(
            f"elastic_stereo needs H and W divisible by {multiple} (its coarsest downsampling), "
            f"got {x.shape[-2]}x{x.shape[-1]}"
        )


def _run(
    x: Tensor, stem: nn.Module, stages: Sequence[nn.Module], heads: Sequence[nn.Module],
    refine: nn.Module, training: bool,
) -> Tensor | list[Tensor]:
    """The forward both the supernet and its extracted form run (so they cannot drift apart)."""
    feats = stem(x)
    pyramid = []
    for stage in stages:
        feats = stage(feats)
        pyramid.append(feats)
    cost: Tensor | None = None
    preds: list[Tensor] = []
    for i in reversed(range(len(stages))):  # coarsest first: each scale fuses the coarser cost
        cost, disp = heads[i](pyramid[i], cost)
        if disp is not None:
            preds.append(disp)
    final = refine(preds[-1], x)
    return [*preds, final] if training else final


class StereoNet(nn.Module):
    """An extracted sub-network: plain ``nn.Conv2d``/``nn.BatchNorm2d``/activations only.

    ``stages[i]`` is an ``nn.Sequential`` of the active blocks of pyramid stage ``i`` and
    ``heads[i]`` its scale head (the coarsest one without a fusion layer).
    """

    def __init__(self, *, stem: nn.Module, stages: Sequence[nn.Module], heads: Sequence[nn.Module],
                 refine: nn.Module, max_disp: float, multiple: int) -> None:
        super().__init__()
        self.stem = stem
        self.stages = nn.ModuleList(stages)
        self.heads = nn.ModuleList(heads)
        self.refine = refine
        self.max_disp = max_disp
        self.multiple = multiple

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:
        """Training: ``[per-scale disparities coarsest first..., refined]``; eval: refined."""
        _check_input(x, self.multiple)
        return _run(x, self.stem, list(self.stages), list(self.heads), self.refine, self.training)


def _key_shape(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


class ElasticStereoNet(Supernet):
    """The supernet. ``forward(x)`` runs the active config (see the module docstring).

    Sizes: ``stem_channels`` at ``1/stem_stride``; ``channels[i]`` the width of stage ``i``,
    which downsamples by 2 except stage 0 (stride 1); ``agg_channels`` the hidden width of each
    scale's aggregation; ``refine_channels`` the refinement's width.
    """

    def __init__(
        self,
        *,
        max_disp: float = 32,
        stem_channels: int = 16,
        channels: Sequence[int] = (16, 24, 32),
        stem_stride: int = 4,
        kernel_choices: Sequence[int] = (3, 5, 7),
        expand_choices: Sequence[int] = (2, 4, 6),
        depth_choices: Sequence[int] = (2, 3, 4),
        agg_channels: int = 16,
        refine_channels: int = 8,
        refine_dilations: Sequence[int] = (1, 2),
    ) -> None:
        super().__init__()
        check_positive("max_disp", max_disp)  # a data set's float (32.0) is fine too
        check_count("stem_channels", stem_channels)
        check_count("agg_channels", agg_channels)
        check_count("refine_channels", refine_channels)
        if stem_stride not in (2, 4):
            raise UsageError(f"stem_stride must be 2 or 4, got {stem_stride!r}")
        channels = tuple(int(c) for c in channels)
        if not channels or any(c < 1 for c in channels):
            raise UsageError(f"channels needs one positive width per pyramid stage, got {list(channels)}")
        n = len(channels)
        self.max_disp: int | float = int(max_disp) if float(max_disp).is_integer() else float(max_disp)
        self.stem_stride = stem_stride
        self.downsample = tuple(stem_stride * 2**i for i in range(n))
        self.multiple = self.downsample[-1]
        # candidates 0..D-1 at 1/down must reach max_disp: D = ceil(max_disp / down) + 1
        # (AANet's max_disp // down stops at 28 px of 32 at 1/4: a 12% blind range here)
        disps = [math.ceil(self.max_disp / d) + 1 for d in self.downsample]
        depths = tuple(sorted({int(d) for d in depth_choices}))
        if not depths or depths[0] < 1:
            raise UsageError(f"depth choices must be integers >= 1, got {list(depth_choices)}")
        max_depth = depths[-1]
        self.stem = PairStem(stem_channels, stem_stride)
        self.stages = nn.ModuleList(
            ElasticStage(2, stem_channels if i == 0 else channels[i - 1], channels[i], max_depth=max_depth,
                         stride=1 if i == 0 else 2, kernel_choices=tuple(kernel_choices),
                         expand_choices=tuple(expand_choices))
            for i in range(n)
        )
        self.heads = nn.ModuleList(
            ScaleHead(num_disp=disps[i], downsample=self.downsample[i], channels=agg_channels,
                      coarser_disp=disps[i + 1] if i + 1 < n else None, finest=i == 0)
            for i in range(n)
        )
        self.refine: Refinement = Refinement(
            max_disp=self.max_disp, channels=refine_channels, dilations=tuple(int(v) for v in refine_dilations)
        )
        self.stem_channels = stem_channels
        self.channels = channels
        blocks = [list(range(s * max_depth, (s + 1) * max_depth)) for s in range(n)]
        dims = [
            Dimension("kernel", tuple(sorted(set(kernel_choices))), n * max_depth),
            Dimension("expand", tuple(sorted(set(expand_choices))), n * max_depth),
            Dimension("depth", depths, n),
            Dimension("scales", tuple(range(1, n + 1)), 1),
        ]
        # "scales" = s switches off stages s..n-1: their depth and all their blocks' choices.
        gates = [
            Gate("scales", 0, "depth", tuple((s,) for s in range(n))),
            Gate("scales", 0, "kernel", tuple(tuple(g) for g in blocks)),
            Gate("scales", 0, "expand", tuple(tuple(g) for g in blocks)),
        ]
        self.space = SearchSpace(dims, blocks, gates=gates)
        self._max_depth = max_depth
        self.active_scales = n

    # ---- the active sub-network (Supernet hooks) ----------------------------------------------
    def _apply_config(self, config: Config) -> None:
        """Set every stage's depth, kernels and expansions and the number of scales."""
        d = self._max_depth
        for i, stage in enumerate(self.stages):
            assert isinstance(stage, ElasticStage)
            stage.set_active(depth=config["depth"][i], kernels=config["kernel"][i * d:(i + 1) * d],
                             expands=config["expand"][i * d:(i + 1) * d])
        self.active_scales = config["scales"][0]

    @contextlib.contextmanager
    def _applied(self, config: Config) -> Iterator[None]:
        """Apply a (validated) config for a block of code, then restore the active one."""
        before = self.active_config()
        self._apply_config(config)
        try:
            yield
        finally:
            self._apply_config(before)

    def forward(self, x: Tensor) -> Tensor | list[Tensor]:
        """Training: ``[per-scale disparities coarsest first..., refined]``; eval: refined."""
        _check_input(x, self.multiple)
        s = self.active_scales
        return _run(x, self.stem, list(self.stages[:s]), list(self.heads[:s]), self.refine, self.training)

    # ---- extraction ----------------------------------------------------------------------------
    def _extract_head(self, i: int, scales: int) -> ScaleHead:
        head = copy.deepcopy(self.heads[i])
        assert isinstance(head, ScaleHead)
        if i == scales - 1:
            head.fuse = None  # the coarsest active scale has nothing to fuse
        return head

    def _stage_inputs(self, scales: int) -> list[int]:
        return [self.stem_channels, *self.channels[: scales - 1]]

    def _extract(self, config: Config) -> StereoNet:
        """The active sub-network as a plain :class:`StereoNet` (the base class's ``extract``
        applies ``config``, sets the train/eval mode and restores the active config)."""
        s = config["scales"][0]
        cins = self._stage_inputs(s)
        stages = []
        for i in range(s):
            stage = self.stages[i]
            assert isinstance(stage, ElasticStage)
            stages.append(stage.extract(cins[i]))
        return StereoNet(stem=copy.deepcopy(self.stem), stages=stages,
                         heads=[self._extract_head(i, s) for i in range(s)],
                         refine=copy.deepcopy(self.refine), max_disp=self.max_disp, multiple=self.multiple)

    def extract(self, config: Config) -> StereoNet:
        """The sub-network of ``config`` as a plain :class:`StereoNet` (weights copied, kernel
        transforms applied), in this supernet's train/eval mode; the active config is kept."""
        net = super().extract(config)
        assert isinstance(net, StereoNet)
        return net

    def sort_channels(self) -> None:
        """OFA's importance sorting of every block's expanded channels (the function is
        unchanged). There is no elastic width here, so stage outputs keep their order."""
        for stage in self.stages:
            assert isinstance(stage, ElasticStage)
            stage.sort_middle()

    # ---- latency -------------------------------------------------------------------------------
    def latency_units(self, config: Config, sample_shape: tuple[int, ...]) -> list[LatencyUnit]:
        """Stem, each active block, each active scale's head, refinement: consecutive pieces of
        the batch-1 forward of ``config`` at ``sample_shape`` = (6, H, W) whose times add up to
        the whole. Block inputs have batch 2 (both views). Modules are built on demand."""
        cfg = self.space.validate(config)
        shape = tuple(int(v) for v in sample_shape)
        if len(shape) != 3:
            raise UsageError(f"elastic_stereo's sample shape is (6, H, W), got {shape}")
        _check_input(torch.empty(0, *shape), self.multiple)  # meta check of channels and sizes
        _, h, w = shape
        s = cfg["scales"][0]
        d = self._max_depth
        ss = self.stem_stride
        units = [LatencyUnit(
            key=f"stereo.stem:c{self.stem_channels}:s{ss}:x1x{_key_shape(shape)}",
            build=lambda: copy.deepcopy(self.stem), inputs=((1, *shape),),
        )]
        cin = self.stem_channels
        hh, ww = h // ss, w // ss
        for i in range(s):
            for j in range(cfg["depth"][i]):
                k, e = cfg["kernel"][i * d + j], cfg["expand"][i * d + j]
                stride = 1 if j else (1 if i == 0 else 2)
                in_shape = (2, cin, hh, ww)
                units.append(LatencyUnit(
                    key=f"mb2d:in{cin}:out{self.channels[i]}:k{k}:e{e}:s{stride}:x{_key_shape(in_shape)}",
                    build=self._block_builder(cfg, i, j, cin), inputs=(in_shape,),
                ))
                cin = self.channels[i]
                hh, ww = hh // stride, ww // stride
        for i in reversed(range(s)):
            head = self.heads[i]
            assert isinstance(head, ScaleHead)
            fh, fw = h // self.downsample[i], w // self.downsample[i]
            inputs: tuple[tuple[int, ...], ...] = ((2, self.channels[i], fh, fw),)
            fuse = "none"
            if i < s - 1:
                coarser = self.heads[i + 1]
                assert isinstance(coarser, ScaleHead)
                inputs += ((1, coarser.num_disp, fh // 2, fw // 2),)
                fuse = str(coarser.num_disp)
            units.append(LatencyUnit(
                key=(f"stereo.head:D{head.num_disp}:down{head.downsample}:agg{head.channels}"
                     f":fuse{fuse}:regress{int(head.finest)}:x{_key_shape(inputs[0])}"),
                build=self._head_builder(i, s), inputs=inputs,
            ))
        units.append(LatencyUnit(
            key=(f"stereo.refine:c{self.refine.channels}:dil{_key_shape(self.refine.dilations)}"
                 f":maxd{self.max_disp}:x1x{_key_shape(shape)}"),
            build=lambda: copy.deepcopy(self.refine), inputs=((1, h, w), (1, *shape)),
        ))
        return units

    def _block_builder(self, cfg: Config, stage: int, index: int, cin: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            with self._applied(cfg), torch.no_grad():
                st = self.stages[stage]
                assert isinstance(st, ElasticStage)
                block = st.blocks[index]
                assert isinstance(block, ElasticMBBlock)
                return block.extract(cin)

        return build

    def _head_builder(self, i: int, scales: int) -> Callable[[], nn.Module]:
        return lambda: self._extract_head(i, scales)


@register_model(
    "elastic_stereo",
    info=ModelInfo(
        task="stereo",
        default_input_shape=(6, 64, 128),
        description=(
            "EASNet-style elastic stereo network: MobileNet-block feature pyramid (elastic kernel, "
            "expansion, depth, number of scales), correlation cost volumes, AANet-style aggregation, "
            "full-resolution refinement"
        ),
    ),
)
def elastic_stereo(
    *,
    max_disp: float = 32,
    stem_channels: int = 16,
    channels: Sequence[int] = (16, 24, 32),
    stem_stride: int = 4,
    kernel_choices: Sequence[int] = (3, 5, 7),
    expand_choices: Sequence[int] = (2, 4, 6),
    depth_choices: Sequence[int] = (2, 3, 4),
    agg_channels: int = 16,
    refine_channels: int = 8,
    refine_dilations: Sequence[int] = (1, 2),
) -> ElasticStereoNet:
    """Build the supernet (defaults: 64x128 images, ``max_disp`` 32, the full config active)."""
    return ElasticStereoNet(
        max_disp=max_disp, stem_channels=stem_channels, channels=channels, stem_stride=stem_stride,
        kernel_choices=kernel_choices, expand_choices=expand_choices, depth_choices=depth_choices,
        agg_channels=agg_channels, refine_channels=refine_channels, refine_dilations=refine_dilations,
    )

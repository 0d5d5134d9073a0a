"""ResNets in two stems: CIFAR (3x3 conv, stride 1, no max-pool) and ImageNet (torchvision).

One class serves both so that every ResNet has the same torchvision module names
(``conv1``, ``bn1``, ``layer1..4``, ``fc``, blocks with ``downsample``); presets and the
low-rank converter rely on them.

* CIFAR forms follow kuangliu/pytorch-cifar (the de-facto reference used by Pufferfish,
  PowerSGD and most compression papers): ResNet-18 with 10 classes has 11,173,962 parameters.
  Shortcuts are 1x1 conv + BN, named ``downsample`` here (``shortcut`` in kuangliu).
* ImageNet forms are structurally identical to torchvision's (v1.5 bottleneck: stride on the
  3x3 conv): ResNet-50 has 25,557,032 parameters, Wide-ResNet-50-2 68,883,240.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from lowcomm.models import ModelInfo, register_model

Stem = Literal["cifar", "imagenet"]


class BasicBlock(nn.Module):
    """Two 3x3 convs with an identity (or 1x1 conv + BN) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, *, stride: int = 1, base_width: int = 64) -> None:
        super().__init__()
        if base_width != 64:
            raise ValueError("BasicBlock only supports base_width=64")
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(in_planes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision v1.5), 1x1 expand by 4."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, *, stride: int = 1, base_width: int = 64) -> None:
        super().__init__()
        width = int(planes * (base_width / 64.0))
        self.conv1 = nn.Conv2d(in_planes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(in_planes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _downsample(in_planes: int, out_planes: int, stride: int) -> nn.Sequential | None:
    if stride == 1 and in_planes == out_planes:
        return None
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_planes),
    )


class ResNet(nn.Module):
    """ResNet with a CIFAR or ImageNet stem; ``forward(x: (B, C, H, W)) -> (B, num_classes)``."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        *,
        num_classes: int,
        stem: Stem,
        in_channels: int = 3,
        base_width: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        self.in_planes = 64
        if stem == "cifar":
            self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        elif stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            raise ValueError(f"unknown stem {stem!r}")
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(block, 64, layers[0], 1, base_width)
        self.layer2 = self._make_layer(block, 128, layers[1], 2, base_width)
        self.layer3 = self._make_layer(block, 256, layers[2], 2, base_width)
        self.layer4 = self._make_layer(block, 512, layers[3], 2, base_width)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        self._init_weights(zero_init_residual)

    def _make_layer(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, n: int, stride: int,
        base_width: int,
    ) -> nn.Sequential:
        blocks = []
        for s in [stride] + [1] * (n - 1):
            blocks.append(block(self.in_planes, planes, stride=s, base_width=base_width))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*blocks)

    def _init_weights(self, zero_init_residual: bool) -> None:
        # torchvision's initialization (He fan-out for convs, unit BN).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)
                elif isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))




def _cifar_info(depth: int) -> ModelInfo:
    return ModelInfo("classification", (3, 32, 32), default_num_classes=10,
                     description=f"CIFAR ResNet-{depth} (3x3 stem, no max-pool)")


def _imagenet_info(desc: str) -> ModelInfo:
    return ModelInfo("classification", (3, 224, 224), default_num_classes=1000, description=desc)


@register_model("resnet18", info=_cifar_info(18))
def resnet18(*, num_classes: int = 10, in_channels: int = 3, zero_init_residual: bool = False) -> ResNet:
    """Registry entry: CIFAR ResNet-18 (3x3 stem, no max-pool)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, stem="cifar",
                  in_channels=in_channels, zero_init_residual=zero_init_residual)


@register_model("resnet34", info=_cifar_info(34))
def resnet34(*, num_classes: int = 10, in_channels: int = 3, zero_init_residual: bool = False) -> ResNet:
    """Registry entry: CIFAR ResNet-34."""
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes=num_classes, stem="cifar",
                  in_channels=in_channels, zero_init_residual=zero_init_residual)


@register_model("resnet50", info=_cifar_info(50))
def resnet50(*, num_classes: int = 10, in_channels: int = 3, zero_init_residual: bool = False) -> ResNet:
    """Registry entry: CIFAR ResNet-50 (bottleneck blocks)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, stem="cifar",
                  in_channels=in_channels, zero_init_residual=zero_init_residual)


@register_model("resnet18_imagenet", info=_imagenet_info("ImageNet ResNet-18 (torchvision structure)"))
def resnet18_imagenet(*, num_classes: int = 1000, in_channels: int = 3,
                      zero_init_residual: bool = False) -> ResNet:
    """Registry entry: ImageNet ResNet-18 (7x7 stem and max-pool)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, stem="imagenet",
                  in_channels=in_channels, zero_init_residual=zero_init_residual)


@register_model("resnet50_imagenet", info=_imagenet_info("ImageNet ResNet-50 (torchvision structure)"))
def resnet50_imagenet(*, num_classes: int = 1000, in_channels: int = 3,
                      zero_init_residual: bool = False) -> ResNet:
    """Registry entry: ImageNet ResNet-50."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, stem="imagenet",
                  in_channels=in_channels, zero_init_residual=zero_init_residual)


@register_model("wide_resnet50_2", info=_imagenet_info("Wide-ResNet-50-2 (torchvision structure)"))
def wide_resnet50_2(*, num_classes: int = 1000, in_channels: int = 3,
                    zero_init_residual: bool = False) -> ResNet:
    """Registry entry: ImageNet Wide ResNet-50-2 (Pufferfish's largest vision model)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, stem="imagenet",
                  in_channels=in_channels, base_width=128, zero_init_residual=zero_init_residual)

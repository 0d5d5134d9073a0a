"""VGG: CIFAR VGG-19/VGG-16 with batch norm, and torchvision's ImageNet VGG-16 layout.

CIFAR VGG-19 with batch norm matches Pufferfish's 20,560,330 parameters (10 classes).

How the count pins the architecture: the 16 convolutions of configuration "E" with BN and
the three-layer head of chengyangfu/pytorch-vgg-cifar10 (which Pufferfish's ``vgg.py``
follows) give exactly 20,560,330 when the convolutions have **no bias** (BN follows each one,
so a bias would be redundant):

* ``features``: 16 x [Conv2d 3x3 pad 1 (bias=False), BatchNorm2d, ReLU] with a 2x2 max-pool
  after conv 2, 4, 8, 12 and 16 -> 20,018,880 weights + 11,008 BN parameters.
* ``classifier``: Dropout(0.5), Linear(512, 512), ReLU, Dropout(0.5), Linear(512, 512),
  ReLU, Linear(512, C) (all with bias) -> 530,442 for C = 10.

(kuangliu's VGG19 has conv biases and a single Linear head: 20,040,522.) ``vgg16`` is the
same CIFAR form with configuration "D" (13 convolutions, the head above): 15,249,354
parameters for C = 10. ``vgg16_imagenet`` is torchvision's ``vgg16`` layout (configuration
"D" without BN, convolutions with bias, 7x7 adaptive pool, 25088-4096-4096-C head with
dropout): 138,357,544 parameters for C = 1000, about 124 M of them in the three Linear layers
(why Lee et al. run those layers model-parallel, :mod:`lowcomm.parallel.fc`). Pufferfish's hybrid
keeps conv 1-9 full-rank and factorizes conv 10-16 and the two 512x512 FC layers; the conv
positions inside ``features`` are :data:`VGG19_CONV_INDICES` (conv *k* is
``features.{VGG19_CONV_INDICES[k-1]}``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lowcomm.models import ModelInfo, register_model

# Configuration "E" (VGG-19): numbers are conv output channels, "M" a 2x2 max-pool.
CFG_E: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                          512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]


def _conv_indices(cfg: list[int | str], block: int = 3) -> list[int]:
    """Positions of the convolutions in ``features`` (a pool is one module, a conv block
    ``block``: three with batch norm, two without).

    Computed from the configuration, not by building the layers: building them at import
    would draw from torch's RNG, so the first model created in a process would get other
    initial weights than the next ones with the same seed.
    """
    out: list[int] = []
    position = 0
    for v in cfg:
        if v != "M":
            out.append(position)
        position += 1 if v == "M" else block
    return out


def _make_features(cfg: list[int | str], in_channels: int,
                   batch_norm: bool = True) -> tuple[nn.Sequential, list[int]]:
    """3x3 convolutions (with BN and no bias, or with bias and no BN) and ReLUs, 2x2 max-pools."""
    layers: list[nn.Module] = []
    c = in_channels
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            assert isinstance(v, int)
            conv = nn.Conv2d(c, v, 3, padding=1, bias=not batch_norm)
            layers += [conv, nn.BatchNorm2d(v), nn.ReLU(inplace=True)] if batch_norm else [conv, nn.ReLU(inplace=True)]
            c = v
    return nn.Sequential(*layers), _conv_indices(cfg, 3 if batch_norm else 2)


# Configuration "D" (VGG-16).
CFG_D: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                          512, 512, 512, "M", 512, 512, 512, "M"]

VGG19_CONV_INDICES: list[int] = _conv_indices(CFG_E)


class _PooledVGG(nn.Module):
    """The forward both VGG forms share: features, adaptive pool, flatten, classifier."""

    features: nn.Sequential
    avgpool: nn.Module
    classifier: nn.Sequential

    def forward(self, x: Tensor) -> Tensor:
        """The forward pass (``nn.Module`` calls it)."""
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class VGG(_PooledVGG):
    """VGG with BN for 32x32 inputs; ``forward(x: (B, 3, 32, 32)) -> (B, num_classes)``.

    ``avgpool`` (adaptive, to 1x1) is an identity at 32x32 and lets other sizes work.
    """

    def __init__(self, cfg: list[int | str], *, num_classes: int = 10, in_channels: int = 3,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.features, self.conv_indices = _make_features(cfg, in_channels)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(512, 512),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(512, 512),
            nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)


@register_model("vgg19", info=ModelInfo("classification", (3, 32, 32), default_num_classes=10,
                                       description="CIFAR VGG-19-BN, 2x512 FC head (Pufferfish)"))
def vgg19(*, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.5) -> VGG:
    """Registry entry: CIFAR VGG-19 with batch norm (Pufferfish's VGG model)."""
    return VGG(CFG_E, num_classes=num_classes, in_channels=in_channels, dropout=dropout)


@register_model("vgg16", info=ModelInfo("classification", (3, 32, 32), default_num_classes=10,
                                       description="CIFAR VGG-16-BN, 2x512 FC head"))
def vgg16(*, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.5) -> VGG:
    """Registry entry: CIFAR VGG-16 with batch norm (configuration "D", the VGG-19 model's head)."""
    return VGG(CFG_D, num_classes=num_classes, in_channels=in_channels, dropout=dropout)


class VGGImageNet(_PooledVGG):
    """torchvision's VGG-16 layout without BN, for 224x224 inputs (any size >= 32 works: the
    adaptive pool makes the classifier's input 512x7x7).

    Module names follow torchvision (``features``, ``avgpool``, ``classifier`` with Linear
    layers at ``0``, ``3``, ``6``), and so does the initialization (Kaiming-normal
    convolutions, N(0, 0.01) Linear weights, zero biases), written here without importing
    torchvision.
    """

    def __init__(self, cfg: list[int | str], *, num_classes: int = 1000, in_channels: int = 3,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.features, _ = _make_features(cfg, in_channels, batch_norm=False)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
            if isinstance(m, (nn.Conv2d, nn.Linear)) and m.bias is not None:
                nn.init.zeros_(m.bias)


@register_model("vgg16_imagenet", info=ModelInfo("classification", (3, 224, 224), default_num_classes=1000,
                                                description="ImageNet VGG-16 (torchvision layout, no BN)"))
def vgg16_imagenet(*, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5) -> VGGImageNet:
    """Registry entry: ImageNet VGG-16, 138,357,544 parameters at 1000 classes."""
    return VGGImageNet(CFG_D, num_classes=num_classes, in_channels=in_channels, dropout=dropout)

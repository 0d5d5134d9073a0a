"""VGG-16 in both forms: the parameter counts pin the architectures, and they run."""

from __future__ import annotations

import torch
from torch import nn

from lowcomm.models import create, info


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_vgg16_imagenet_has_torchvisions_138357544_parameters_and_layout() -> None:
    model = create("vgg16_imagenet")
    assert count(model) == 138_357_544
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    assert len(convs) == 13 and all(c.bias is not None for c in convs)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    fcs = [
        (i, m.in_features, m.out_features)
        for i, m in enumerate(model.classifier)
        if isinstance(m, nn.Linear)
    ]
    assert fcs == [(0, 25088, 4096), (3, 4096, 4096), (6, 4096, 1000)]
    assert info("vgg16_imagenet").default_input_shape == (3, 224, 224)
    assert float(model.classifier[0].bias.detach().abs().max()) == 0.0  # torchvision's zero biases


def test_vgg16_cifar_is_config_d_with_bn_and_the_vgg19_head() -> None:
    model = create("vgg16")
    assert count(model) == 15_249_354
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 13
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 13
    assert count(create("vgg16", num_classes=100)) == 15_249_354 + 90 * 513


def test_both_vgg16_forms_map_images_to_logits() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        assert create("vgg16").eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
        # 32x32 is enough for the ImageNet form: the adaptive pool gives the head 512x7x7
        assert create("vgg16_imagenet", num_classes=7).eval()(torch.randn(1, 3, 32, 32)).shape == (
            1,
            7,
        )

"""Elastic classifiers: the supernet API end to end (registry, configs, extraction, sorting,
BN re-calibration, latency units, gradients)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from tolerance import assert_close_eps

from lowcomm import models
from lowcomm.elastic.blocks import ELASTIC_BLOCKS, ElasticMBBlock
from lowcomm.elastic.classifier import ElasticClassifier
from lowcomm.elastic.ops import ELASTIC_OPS
from lowcomm.elastic.supernet import Supernet, recalibrate_bn
from lowcomm.errors import UsageError

# Tiny networks: a handful of channels, inputs of 40 features / 8x8 images.
TINY = {"base_channels": 4, "max_depth": 2}


def tiny(dim: int) -> tuple[ElasticClassifier, torch.Tensor]:
    torch.manual_seed(dim)
    if dim == 1:
        net = models.create("elastic_cnn1d", num_classes=5, input_dim=40, **TINY)
        x = torch.randn(6, 40)
    else:
        net = models.create("elastic_cnn2d", num_classes=5, in_channels=2, image_size=8, stages=2, **TINY)
        x = torch.randn(6, 2, 8, 8)
    assert isinstance(net, ElasticClassifier)
    net.train()
    for _ in range(2):  # non-trivial BN running statistics
        net(x)
    return net, x


def _network_ops(net: ElasticClassifier) -> float:
    # Sum over layers of the longest reduction (conv fan-in, depthwise k^d, linear fan-in):
    # the extracted network runs the same float operations, possibly in another order or
    # memory layout (one eps per rounding step, errors adding up layer by layer).
    total = 9 * net.in_channels
    for stage in net.stage_list():
        for block in stage.blocks:
            assert isinstance(block, ElasticMBBlock)
            total += block.in_channels + max(block.kernel_choices) ** net.dim + block.mid_channels + 8
    return float(total + net.head.in_features)


def test_registered_models_build_through_create_with_data_kwargs() -> None:
    assert models.info("elastic_cnn1d").task == "classification"
    net = models.create("elastic_cnn1d", **models.kwargs_for_data("elastic_cnn1d", num_classes=10, input_shape=(40,)))
    assert net(torch.randn(3, 40)).shape == (3, 10)
    digits = models.create("elastic_cnn2d", **models.kwargs_for_data("elastic_cnn2d", num_classes=10, input_shape=(64,)))
    assert digits(torch.randn(3, 64)).shape == (3, 10)
    cifar = models.create("elastic_cnn2d", num_classes=7, in_channels=3, image_size=16, base_channels=4)
    assert cifar(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    with pytest.raises(UsageError, match="square"):
        models.create("elastic_cnn2d", input_dim=40)


@pytest.mark.parametrize("dim", [1, 2])
def test_extract_equals_active_supernet_in_eval_for_random_configs(dim: int) -> None:
    net, x = tiny(dim)
    rng = random.Random(dim)
    configs = [net.space.max_config(), net.space.min_config()] + [net.sample_config(rng) for _ in range(3)]
    for config in configs:
        before = net.active_config()
        plain = net.extract(config)
        assert net.active_config() == before
        assert not any(isinstance(m, ELASTIC_OPS + ELASTIC_BLOCKS + (Supernet,)) for m in plain.modules())
        net.set_active(config)
        net.eval()
        plain.eval()
        assert_close_eps(plain(x), net(x), ops=_network_ops(net), msg=str(config))


@pytest.mark.parametrize("dim", [1, 2])
def test_sort_channels_leaves_the_full_network_unchanged(dim: int) -> None:
    net, x = tiny(dim)
    net.eval()
    before = net(x)
    net.sort_channels()
    assert_close_eps(net(x), before, ops=_network_ops(net))
    # the first stage's output channels are now ordered by importance for their consumers
    stages = net.stage_list()
    readers = [stages[1].blocks[0], *stages[0].blocks[1:]]
    importance = torch.zeros(stages[0].out_channels)
    for block in readers:
        assert isinstance(block, ElasticMBBlock)
        importance += block.expand_conv.weight.detach().abs().sum(dim=(0, 2) if dim == 1 else (0, 2, 3))
    assert torch.all(importance[:-1] >= importance[1:] - 1e-6)


@pytest.mark.parametrize("elastic", [{"kernel"}, {"expand"}, {"width"}, {"kernel", "expand", "width"}])
def test_every_parameter_gets_a_gradient_without_depth_change(elastic: set[str]) -> None:
    net, x = tiny(2)
    net.set_active(net.sample_config(random.Random(0), elastic))
    net.zero_grad(set_to_none=True)
    net(x).square().sum().backward()
    assert [n for n, p in net.named_parameters() if p.grad is None] == []


def test_bad_config_names_dimension_and_choices() -> None:
    net, _ = tiny(1)
    config = net.space.max_config()
    config["width"][0] = 60
    with pytest.raises(UsageError, match=r"width.*\[50, 75, 100\]"):
        net.set_active(config)
    with pytest.raises(UsageError, match="depth"):
        net.extract({**net.space.max_config(), "depth": [3, 3]})


def test_recalibrate_bn_gives_the_batch_statistics_and_restores_state() -> None:
    net, x = tiny(1)
    net.eval()
    bn = net.stem[1]
    assert isinstance(bn, nn.BatchNorm1d)
    momentum = bn.momentum
    batch = torch.randn(16, 40) * 2 + 1
    recalibrate_bn(net, [batch, batch, (batch, torch.zeros(16))], num_batches=3)
    assert not net.training and bn.momentum == momentum
    with torch.no_grad():
        h = net.stem[0](net.reshape(batch))
    assert bn.running_mean is not None and bn.running_var is not None
    assert_close_eps(bn.running_mean, h.mean(dim=(0, 2)), ops=16 * 40)
    assert_close_eps(bn.running_var, h.var(dim=(0, 2), unbiased=True), ops=16 * 40)
    with pytest.raises(UsageError, match="no batches"):
        recalibrate_bn(net, [], num_batches=2)


def test_recalibrate_bn_sets_sliced_statistics_of_the_active_subnet() -> None:
    net, x = tiny(1)
    net.set_active(net.space.min_config())
    recalibrate_bn(net, [x], num_batches=1)
    block = net.stage_list()[0].blocks[0]
    assert isinstance(block, ElasticMBBlock)
    active = net.stem_channels * 2
    stats = block.expand_bn.bn.running_mean
    assert stats is not None
    assert torch.count_nonzero(stats[:active]) == active
    assert torch.count_nonzero(stats[active:]) == 0  # reset, untouched by the small sub-network


@pytest.mark.parametrize("dim", [1, 2])
def test_latency_units_compose_to_the_extracted_network(dim: int) -> None:
    net, x = tiny(dim)
    config = net.sample_config(random.Random(7))
    sample_shape = tuple(x.shape[1:])
    units = net.latency_units(config, sample_shape)
    assert len(units) == 2 + sum(config["depth"])
    net.eval()
    h = x[:1]
    for unit in units:
        assert tuple(h.shape) == unit.inputs[0]
        module = unit.build()
        assert not any(isinstance(m, ELASTIC_OPS + ELASTIC_BLOCKS) for m in module.modules())
        h = module(h)
    assert_close_eps(h, net.extract(config).eval()(x[:1]), ops=_network_ops(net))
    # blocks beyond the active depth do not change the units
    again = net.latency_units(net.space.canonical(config), sample_shape)
    assert [u.key for u in again] == [u.key for u in units]


def test_equal_blocks_get_equal_latency_keys_and_different_kernels_different_keys() -> None:
    net, x = tiny(1)
    cfg = net.space.max_config()
    keys = [u.key for u in net.latency_units(cfg, (40,))]
    cfg_small = {**cfg, "kernel": [3] + cfg["kernel"][1:]}
    keys_small = [u.key for u in net.latency_units(cfg_small, (40,))]
    assert keys_small[1] != keys[1] and keys_small[2:] == keys[2:]


def _macs(module: nn.Module, x: torch.Tensor) -> int:
    total = 0

    def hook(m: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(m, (nn.Conv1d, nn.Conv2d)):
            total += out.numel() * m.weight[0].numel()
        elif isinstance(m, nn.Linear):
            total += out.numel() * m.in_features

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    with torch.no_grad():
        module(x)
    for h in handles:
        h.remove()
    return total


@pytest.mark.parametrize("name", ["elastic_cnn1d", "elastic_cnn2d"])
def test_min_config_is_at_least_three_times_cheaper_than_max(name: str) -> None:
    net = models.create(name)
    assert isinstance(net, ElasticClassifier)
    x = torch.randn(1, 40 if name == "elastic_cnn1d" else 64)
    big = _macs(net.extract(net.space.max_config()).eval(), x)
    small = _macs(net.extract(net.space.min_config()).eval(), x)
    assert big >= 3 * small


@pytest.mark.parametrize(("channels", "strides"), [((6, 6), (2, 1)), ((4, 6), (1, 2))])
def test_sort_channels_with_shortcut_joined_stages_leaves_function_unchanged(
    channels: tuple[int, int], strides: tuple[int, int]
) -> None:
    # (6, 6) with stride 1: stage 1's first block has a shortcut, so both stages share one
    # channel order; (4, 6) with stride 1 first: stage 0 is joined to the stem (left unsorted).
    torch.manual_seed(11)
    net = ElasticClassifier(dim=1, in_channels=1, spatial=(16,), num_classes=3, base_channels=4,
                            stage_channels=channels, strides=strides, max_depth=2, pool=2)
    x = torch.randn(5, 16)
    net.train()
    net(x)
    net.eval()
    before = net(x)
    net.sort_channels()
    assert_close_eps(net(x), before, ops=_network_ops(net))

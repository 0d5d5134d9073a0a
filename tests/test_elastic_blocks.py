"""Elastic ops and blocks: kernel transforms, slicing, extraction, channel sorting, gradients."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.elastic.blocks import ELASTIC_BLOCKS, ElasticMBBlock, ElasticStage
from lowcomm.elastic.ops import ELASTIC_OPS, ElasticBatchNorm, ElasticConv
from lowcomm.errors import UsageError
from tolerance import assert_close_eps


def _input(dim: int, channels: int, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, channels, *((16,) if dim == 1 else (8, 8)))


def _block_ops(in_c: int, mid: int, k: int, dim: int) -> float:
    # Longest reduction chain through a block: expand (in_c terms), depthwise (k^dim),
    # project (mid), BN and shortcut (a few). Extraction runs the same convolutions with
    # possibly different summation order/memory layout, so one eps per term bounds it.
    return in_c + k**dim + mid + 8


@pytest.mark.parametrize("dim", [1, 2])
def test_kernel_transform_at_init_gives_the_center_crop(dim: int) -> None:
    conv = ElasticConv(dim, 4, 4, (3, 5, 7), groups="depthwise")
    w = conv.weight
    crop5 = w[..., 1:6] if dim == 1 else w[..., 1:6, 1:6]
    crop3 = w[..., 2:5] if dim == 1 else w[..., 2:5, 2:5]
    torch.testing.assert_close(conv.kernel_weight(5), crop5, rtol=0, atol=0)
    torch.testing.assert_close(conv.kernel_weight(3), crop3, rtol=0, atol=0)
    torch.testing.assert_close(conv.kernel_weight(7), w, rtol=0, atol=0)


def test_smaller_kernel_chains_crop_and_transform_matrices() -> None:
    torch.manual_seed(0)
    conv = ElasticConv(2, 3, 3, (3, 5, 7), groups="depthwise")
    with torch.no_grad():
        conv.transforms["7to5"].copy_(torch.randn(25, 25))
        conv.transforms["5to3"].copy_(torch.randn(9, 9))
    w5 = (conv.weight[..., 1:6, 1:6].reshape(3, 1, 25) @ conv.transforms["7to5"].t()).reshape(3, 1, 5, 5)
    w3 = (w5[..., 1:4, 1:4].reshape(3, 1, 9) @ conv.transforms["5to3"].t()).reshape(3, 1, 3, 3)
    assert_close_eps(conv.kernel_weight(3), w3, ops=25 + 9)


@pytest.mark.parametrize("dim", [1, 2])
def test_elastic_conv_is_the_sliced_convolution(dim: int) -> None:
    torch.manual_seed(1)
    conv = ElasticConv(dim, 6, 8, (3, 5), stride=2)
    conv.set_active(kernel=3, out_channels=5)
    x = _input(dim, 4)
    ref_fn = F.conv1d if dim == 1 else F.conv2d
    w = conv.weight[:5, :4, 1:4] if dim == 1 else conv.weight[:5, :4, 1:4, 1:4]
    expected = ref_fn(x, w, None, 2, 1)
    assert_close_eps(conv(x), expected, ops=4 * 9)
    assert_close_eps(conv.extract(4)(x), expected, ops=4 * 9)


def test_elastic_conv_refuses_bad_settings() -> None:
    with pytest.raises(UsageError, match="kernel 9"):
        ElasticConv(1, 4, 4, (3, 5)).set_active(kernel=9)
    with pytest.raises(UsageError, match="odd"):
        ElasticConv(1, 4, 4, (2, 4))
    with pytest.raises(UsageError, match="dim=1\\|2"):
        ElasticConv(3, 4, 4)


def test_elastic_batch_norm_updates_only_active_channels() -> None:
    bn = ElasticBatchNorm(1, 6)
    x = torch.randn(8, 4, 10) * 3 + 2
    bn.train()
    y = bn(x)
    ref = nn.BatchNorm1d(4)
    with torch.no_grad():
        ref.weight.copy_(bn.bn.weight[:4])
        ref.bias.copy_(bn.bn.bias[:4])
    assert_close_eps(y, ref(x), ops=80)
    mean, var = bn.bn.running_mean, bn.bn.running_var
    assert mean is not None and var is not None and ref.running_mean is not None
    assert_close_eps(mean[:4], ref.running_mean, ops=80)
    assert torch.equal(mean[4:], torch.zeros(2))
    assert torch.equal(var[4:], torch.ones(2))


def _random_block_config(block: ElasticMBBlock, rng: random.Random) -> dict[str, int]:
    return {
        "kernel": rng.choice(block.kernel_choices),
        "expand": rng.choice(block.expand_choices),
        "out_channels": rng.randint(1, block.out_channels),
    }


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("stride", [1, 2])
def test_block_extract_equals_active_block_in_eval(dim: int, stride: int) -> None:
    torch.manual_seed(2)
    rng = random.Random(dim * 10 + stride)
    block = ElasticMBBlock(dim, 6, 6, kernel_choices=(3, 5, 7), expand_choices=(2, 3), stride=stride)
    block.train()
    for _ in range(3):  # give the BN running stats non-trivial values
        block(_input(dim, 6))
    for _ in range(4):
        cfg = _random_block_config(block, rng)
        cin = rng.randint(1, 6)
        block.set_active(**cfg)
        x = _input(dim, cin)
        block.eval()
        expected = block(x)
        plain = block.extract(cin).eval()
        assert not any(isinstance(m, ELASTIC_OPS + ELASTIC_BLOCKS) for m in plain.modules())
        mid = round(cin * cfg["expand"])
        assert_close_eps(plain(x), expected, ops=_block_ops(cin, mid, cfg["kernel"], dim), msg=str(cfg))


@pytest.mark.parametrize("dim", [1, 2])
def test_sort_middle_leaves_the_full_block_unchanged(dim: int) -> None:
    torch.manual_seed(3)
    block = ElasticMBBlock(dim, 6, 6, expand_choices=(2, 4))
    block.train()
    block(_input(dim, 6))
    block.eval()
    x = _input(dim, 6)
    before = block(x)
    block.sort_middle()
    assert_close_eps(block(x), before, ops=_block_ops(6, 24, 7, dim))
    importance = block.project_conv.weight.abs().sum(dim=(0, 2) if dim == 1 else (0, 2, 3))
    assert torch.all(importance[:-1] >= importance[1:])


def test_residual_with_narrower_input_pads_with_zeros_in_supernet_and_extract() -> None:
    torch.manual_seed(4)
    block = ElasticMBBlock(1, 6, 6, stride=1)
    assert block.residual
    block.set_active(kernel=3, expand=2, out_channels=6)
    block.eval()
    x = _input(1, 4)
    y = block(x)
    assert y.shape[1] == 6
    assert_close_eps(block.extract(4).eval()(x), y, ops=_block_ops(4, 8, 3, 1))


@pytest.mark.parametrize("setting", [{"kernel": 3}, {"expand": 2}, {"out_channels": 3}])
def test_every_block_parameter_gets_a_gradient(setting: dict[str, int]) -> None:
    block = ElasticMBBlock(2, 4, 6, kernel_choices=(3, 5, 7), expand_choices=(2, 3), stride=2)
    block.set_active(**setting)
    block.train()
    block(_input(2, 4)).square().sum().backward()
    missing = [n for n, p in block.named_parameters() if p.grad is None]
    assert missing == []


def test_stage_runs_and_extracts_its_first_depth_blocks() -> None:
    torch.manual_seed(5)
    stage = ElasticStage(1, 4, 6, max_depth=3, stride=2, expand_choices=(2, 3))
    stage.set_active(depth=2, kernels=[3, 5, 7], expands=[2, 3, 2], out_channels=4)
    stage.eval()
    x = _input(1, 4)
    plain = stage.extract(4).eval()
    assert len(plain) == 2
    assert_close_eps(plain(x), stage(x), ops=2 * _block_ops(4, 12, 5, 1))
    with pytest.raises(UsageError, match="depth"):
        stage.set_active(depth=4)

"""Behaviour of the elastic stereo network: cost volume, regression, refinement, loss, metrics,
the supernet API (set_active / extract / sort_channels / latency_units) and learning."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from lowcomm.elastic.blocks import ELASTIC_BLOCKS, ElasticMBBlock, ElasticStage
from lowcomm.elastic.ops import ELASTIC_OPS
from lowcomm.elastic.stereo.costvolume import ScaleHead, correlation_volume, soft_argmin
from lowcomm.elastic.stereo.loss import d1, default_weights, epe, error_sums, multiscale_loss
from lowcomm.elastic.stereo.model import ElasticStereoNet, StereoNet, elastic_stereo
from lowcomm.elastic.stereo.refine import Refinement, warp_right_to_left
from lowcomm.elastic.supernet import Supernet
from lowcomm.errors import UsageError
from tolerance import assert_close_eps

# ---- cost volume and regression ---------------------------------------------------------


def test_correlation_volume_is_channel_mean_of_left_times_shifted_right() -> None:
    torch.manual_seed(0)
    c = 6
    left, right = torch.randn(2, c, 5, 9), torch.randn(2, c, 5, 9)
    cost = correlation_volume(left, right, 4)
    ref = torch.zeros(2, 4, 5, 9, dtype=torch.float64)
    l64, r64 = left.double(), right.double()
    for d in range(4):
        for x in range(d, 9):  # x < d has no match: stays 0
            ref[:, d, :, x] = (l64[..., x] * r64[..., x - d]).mean(1)
    # each entry: c products summed then divided -> c + 1 roundings
    assert_close_eps(cost, ref.float(), torch.float32, ops=c + 1)
    assert torch.all(cost[:, 3, :, :3] == 0)


def test_correlation_volume_peaks_at_the_true_shift() -> None:
    torch.manual_seed(0)
    # unit-norm features: by Cauchy-Schwarz the product is largest with the feature itself
    left = nn.functional.normalize(torch.randn(1, 8, 4, 16), dim=1)
    right = torch.zeros_like(left)
    right[..., :13] = left[..., 3:]  # right[x] = left[x + 3]: disparity 3 everywhere
    cost = correlation_volume(left, right, 6)
    assert torch.all(cost[0, :, :, 3:13].argmax(0) == 3)


def test_correlation_volume_refuses_mismatched_features() -> None:
    with pytest.raises(UsageError, match="same"):
        correlation_volume(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5), 2)


def test_soft_argmin_of_a_sharp_peak_is_its_index_and_stays_in_range() -> None:
    cost = torch.full((1, 5, 2, 2), -1e4)
    cost[0, 3] = 0.0
    assert torch.allclose(soft_argmin(cost), torch.full((1, 2, 2), 3.0))
    d = soft_argmin(torch.randn(2, 7, 3, 3) * 10)
    assert d.min() >= 0 and d.max() <= 6


def test_scale_head_regresses_only_where_needed_and_upsamples_in_input_pixels() -> None:
    head = ScaleHead(num_disp=4, downsample=2, channels=4, coarser_disp=2, finest=False)
    feats, coarser = torch.randn(2, 3, 4, 6), torch.randn(1, 2, 2, 3)
    cost, disp = head(feats, coarser)
    assert cost.shape == (1, 4, 4, 6) and disp is not None and disp.shape == (1, 8, 12)
    assert disp.min() >= 0 and disp.max() <= 3 * 2  # candidates 0..3 at half resolution
    head.eval()
    cost, disp = head(feats, coarser)
    assert disp is None  # a coarse scale's disparity is only a training signal


# ---- refinement --------------------------------------------------------------------------


def test_warping_the_right_view_with_the_true_disparity_gives_the_left_view() -> None:
    torch.manual_seed(0)
    left = torch.randn(1, 3, 4, 12)
    right = torch.zeros_like(left)
    right[..., :10] = left[..., 2:]
    warped = warp_right_to_left(right, torch.full((1, 4, 12), 2.0))
    # bilinear sampling at integer positions: a weight of 1 on one pixel, plus round-off
    assert_close_eps(warped[..., 2:], left[..., 2:], ops=4)


def test_refinement_output_is_a_nonnegative_full_resolution_disparity() -> None:
    ref = Refinement(max_disp=8, channels=4)
    out = ref(torch.rand(2, 8, 16) * 8, torch.randn(2, 6, 8, 16))
    assert out.shape == (2, 8, 16) and out.min() >= 0


# ---- loss and metrics --------------------------------------------------------------------

# Hand-worked example (max_disp 32). Valid: 0 < target < 32, i.e. 10, 20, 5, 30, 1; the 0, 40
# and 32 entries are invalid and have wild predictions that must not count.
TARGET = torch.tensor([[[0.0, 10.0, 20.0, 40.0], [5.0, 32.0, 30.0, 1.0]]])
PRED = torch.tensor([[[7.0, 13.5, 20.5, 0.0], [9.0, 0.0, 31.0, 0.5]]])
# errors 3.5, 0.5, 4, 1, 0.5 -> sum 9.5 over 5 pixels; D1 outliers (> 3 px and > 5%): 3.5, 4
# smooth-L1 (beta 1): 3.0 + 0.125 + 3.5 + 0.5 + 0.125 = 7.25 -> mean 1.45


def test_epe_and_d1_match_hand_computed_values() -> None:
    assert epe(PRED, TARGET, 32).item() == pytest.approx(1.9)
    assert d1(PRED, TARGET, 32).item() == pytest.approx(0.4)
    sums = error_sums(PRED, TARGET, 32)
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([9.5, 2.0, 5.0])


def test_d1_needs_both_three_pixels_and_five_percent() -> None:
    target = torch.tensor([[[100.0, 100.0, 40.0]]])
    pred = torch.tensor([[[104.0, 106.0, 43.5]]])  # 4 < 5% of 100; 6 > 5; 3.5 > 3 and > 2
    assert d1(pred, target, 192).item() == pytest.approx(2 / 3)


def test_error_sums_of_shards_add_up_to_the_whole() -> None:
    torch.manual_seed(0)
    target = torch.rand(4, 6, 8) * 40
    pred = target + torch.randn_like(target) * 4
    whole = error_sums(pred, target, 32)
    parts = error_sums(pred[:1], target[:1], 32) + error_sums(pred[1:], target[1:], 32)
    assert_close_eps(parts, whole, torch.float64, ops=4 * 6 * 8)
    assert whole[2].item() == int(((target > 0) & (target < 32)).sum())


def test_multiscale_loss_is_weighted_smooth_l1_over_valid_pixels() -> None:
    assert multiscale_loss([PRED], TARGET, 32).item() == pytest.approx(1.45)
    assert default_weights(3) == [0.5, 1.0, 1.0]
    assert default_weights(4) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])  # AANet's
    assert multiscale_loss([PRED, PRED, PRED], TARGET, 32).item() == pytest.approx(2.5 * 1.45)
    got = multiscale_loss([PRED, PRED], TARGET, 32, weights=[0.25, 2.0])
    assert got.item() == pytest.approx(2.25 * 1.45)


def test_invalid_pixels_get_no_loss_and_no_gradient() -> None:
    pred = PRED.clone().requires_grad_(True)
    loss = multiscale_loss([pred], TARGET, 32)
    loss.backward()
    invalid = ~((TARGET > 0) & (TARGET < 32))
    assert pred.grad is not None
    assert torch.all(pred.grad[invalid] == 0) and torch.all(pred.grad[~invalid] != 0)
    moved = PRED.clone()
    moved[invalid] += 100.0
    assert multiscale_loss([moved], TARGET, 32).item() == pytest.approx(1.45)
    assert epe(moved, TARGET, 32).item() == pytest.approx(1.9)


def test_loss_without_valid_pixels_is_zero_but_connected() -> None:
    pred = torch.rand(1, 2, 3, requires_grad=True)
    loss = multiscale_loss([pred], torch.zeros(1, 2, 3), 32)
    loss.backward()
    assert loss.item() == 0.0 and pred.grad is not None
    assert epe(pred, torch.zeros(1, 2, 3), 32).item() == 0.0


def test_loss_refuses_bad_inputs() -> None:
    with pytest.raises(UsageError, match="weights"):
        multiscale_loss([PRED, PRED], TARGET, 32, weights=[1.0])
    with pytest.raises(UsageError, match="shape"):
        epe(PRED[..., :3], TARGET, 32)
    with pytest.raises(UsageError, match="max_disp"):
        epe(PRED, TARGET, 0)
    with pytest.raises(UsageError, match="at least one"):
        multiscale_loss([], TARGET, 32)


# ---- the supernet ------------------------------------------------------------------------

# Tiny: 16x32 images, stem stride 2 -> scales at 1/2, 1/4, 1/8 with 9, 5, 3 candidates.
TINY: dict[str, Any] = {"max_disp": 16, "stem_channels": 4, "channels": (4, 6, 8), "stem_stride": 2,
        "depth_choices": (1, 2), "agg_channels": 4, "refine_channels": 4}


def tiny_net(seed: int = 0) -> ElasticStereoNet:
    torch.manual_seed(seed)
    return ElasticStereoNet(**TINY)  # what elastic_stereo(**TINY) builds, typed


def with_scales(net: ElasticStereoNet, s: int) -> dict[str, list[int]]:
    cfg = net.space.max_config()
    cfg["scales"] = [s]
    return cfg


def settle_bn(net: nn.Module, x: torch.Tensor) -> None:
    """A few training forwards so BN running statistics differ from their init (1, 0)."""
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(x)


@pytest.mark.parametrize("scales", [1, 2, 3])
def test_training_returns_one_map_per_scale_plus_refined_and_eval_the_refined(scales: int) -> None:
    net = tiny_net()
    net.set_active(with_scales(net, scales))
    x = torch.randn(2, 6, 16, 32)
    out = net.train()(x)
    assert isinstance(out, list) and len(out) == scales + 1
    assert all(o.shape == (2, 16, 32) and o.min() >= 0 for o in out)
    with torch.no_grad():
        final = net.eval()(x)
    assert isinstance(final, torch.Tensor) and final.shape == (2, 16, 32) and final.min() >= 0


def test_every_scale_can_reach_max_disp_and_no_further() -> None:
    net = tiny_net()
    heads = [h for h in net.heads if isinstance(h, ScaleHead)]
    assert [h.num_disp for h in heads] == [9, 5, 3]  # ceil(16 / down) + 1 at 1/2, 1/4, 1/8
    assert all((h.num_disp - 1) * h.downsample == 16 for h in heads)
    with torch.no_grad():
        out = net.train()(torch.randn(1, 6, 16, 32) * 3)
    assert all(float(pred.max()) <= 16 + 1e-3 for pred in out[:3])


def test_extract_equals_the_active_supernet_in_eval_mode() -> None:
    net = tiny_net()
    x = torch.randn(2, 6, 16, 32)
    rng = random.Random(0)
    configs = [net.space.max_config(), net.space.min_config()] + [net.sample_config(rng) for _ in range(4)]
    for cfg in configs:
        net.set_active(cfg)
        settle_bn(net, x)
        net.eval()
        sub = net.extract(cfg)
        assert isinstance(sub, StereoNet) and not sub.training
        with torch.no_grad():
            expected, got = net(x), sub(x)
        assert isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
        # Same weights, sliced vs copied: kernels may differ only in summation order. Longest
        # chain: stem + 2 blocks x 3 convs per stage x 3 stages + 3 head convs + 3 refine convs
        # ~ 27 layers, each a sum of <= 9 * 3 * 3 = 81 terms (a 3x3 conv over 9 disparity
        # candidates; the 1x1 projections sum <= 48, the 7x7 depthwise 49) -> 27 * 81 roundings
        assert_close_eps(got, expected, torch.float32, ops=27 * 81, msg=str(cfg))
        assert net.active_config() == net.space.validate(cfg)


def test_extracted_network_holds_no_elastic_module_and_trains_alone() -> None:
    net = tiny_net()
    cfg = net.sample_config(random.Random(3))
    sub = net.extract(cfg)
    elastic = (*ELASTIC_OPS, *ELASTIC_BLOCKS, Supernet)
    assert not [type(m).__name__ for m in sub.modules() if isinstance(m, elastic)]
    assert sub.max_disp == net.max_disp
    out = sub.train()(torch.randn(1, 6, 16, 32))
    assert isinstance(out, list) and len(out) == cfg["scales"][0] + 1


def test_sort_channels_leaves_the_function_unchanged() -> None:
    net = tiny_net()
    x = torch.randn(2, 6, 16, 32)
    settle_bn(net, x)
    with torch.no_grad():
        for p in net.parameters():  # break the init's symmetry so the sort permutes something
            p.add_(torch.randn_like(p) * 0.1)
    net.eval()
    # expansion at its max: sorting decides WHICH middle channels a smaller expansion keeps
    # (that is its purpose), so only the full width is invariant (OFA sorts before that phase)
    cfg = net.sample_config(random.Random(1), elastic=("kernel", "depth", "scales"))
    net.set_active(cfg)
    stage = net.stages[0]
    assert isinstance(stage, ElasticStage)
    block = stage.blocks[0]
    assert isinstance(block, ElasticMBBlock)
    first = block.expand_conv.weight.detach().clone()
    with torch.no_grad():
        before = net(x)
        net.sort_channels()
        after = net(x)
    assert not torch.equal(first, block.expand_conv.weight)  # it did permute
    assert isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
    # a permutation reorders the terms of each project conv's sum over the middle channels
    # (<= 8 * 6 = 48 terms; 6 blocks on the longest chain) and nothing else
    assert_close_eps(after, before, torch.float32, ops=6 * 48)


def test_every_parameter_receives_a_gradient_for_the_max_config() -> None:
    net = tiny_net()
    net.set_active(net.space.max_config())
    y = torch.rand(2, 16, 32) * 15 + 0.5
    multiscale_loss(net.train()(torch.randn(2, 6, 16, 32)), y, 16).backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None]
    assert not missing


def test_adam_overfits_one_pair_with_known_disparity() -> None:
    net = tiny_net(seed=1)
    torch.manual_seed(1)
    left = torch.rand(1, 3, 16, 40)
    # right[x] = left[x + 5]: disparity 5 everywhere (cropped so every pixel has its match)
    x = torch.cat([left[..., 5:37], left[..., 0:32]], dim=1)
    y = torch.full((1, 16, 32), 5.0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net.train()
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = multiscale_loss(net(x), y, 16)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # starting near a uniform soft argmin (~4 px error on several maps), an overfit single
    # pair ends far below (about 40x lower on this machine): a 4x margin cannot come from noise
    assert losses[-1] < losses[0] / 4, losses


def test_latency_units_cover_the_extracted_network_and_keys_follow_config_and_shape() -> None:
    net = tiny_net()
    cfg = net.sample_config(random.Random(5))
    cfg["scales"] = [3]
    units = net.latency_units(cfg, (6, 16, 32))
    s, depths = cfg["scales"][0], cfg["depth"]
    assert len(units) == 1 + sum(depths[:s]) + s + 1  # stem, blocks, heads, refinement
    built = [u.build() for u in units]
    sub = net.extract(cfg)
    count = sum(p.numel() for m in built for p in m.parameters())
    assert count == sum(p.numel() for p in sub.parameters())
    kinds = sorted(type(m).__name__ for b in built for m in b.modules())
    assert kinds == sorted(type(m).__name__ for m in sub.modules() if m is not sub
                           and not isinstance(m, nn.ModuleList) and not (
                               isinstance(m, nn.Sequential) and any(m is st for st in sub.stages)))
    assert all(u.inputs and all(shape[0] in (1, 2) for shape in u.inputs) for u in units)
    # the keys change with the input shape ...
    other = net.latency_units(cfg, (6, 32, 64))
    assert not {u.key for u in units} & {u.key for u in other}
    # ... and with the config, only where the module changed
    changed = dict(cfg, kernel=list(cfg["kernel"]))
    changed["kernel"][0] = 3 if cfg["kernel"][0] != 3 else 5
    diff = [a.key != b.key for a, b in zip(units, net.latency_units(changed, (6, 16, 32)))]
    assert diff == [i == 1 for i in range(len(units))]


def test_latency_units_chained_give_the_extracted_forward() -> None:
    net = tiny_net()
    cfg = net.sample_config(random.Random(2))
    x = torch.randn(1, 6, 16, 32)
    settle_bn(net, x)
    net.eval()
    units = net.latency_units(cfg, (6, 16, 32))
    mods = [u.build().eval() for u in units]
    s = cfg["scales"][0]
    with torch.no_grad():
        h = mods[0](x)
        feats, i = [], 1
        for stage in range(s):
            for _ in range(cfg["depth"][stage]):
                h = mods[i](h)
                i += 1
            feats.append(h)
        cost = None
        for stage in reversed(range(s)):
            cost, disp = mods[i](feats[stage], *([] if cost is None else [cost]))
            i += 1
        final = mods[i](disp, x)
        expected = net.extract(cfg).eval()(x)
    assert isinstance(expected, torch.Tensor)
    # the same modules on the same tensors in the same order: equal up to one rounding
    assert_close_eps(final, expected, ops=1)


def test_canonical_ignores_stages_beyond_the_active_scales() -> None:
    net = tiny_net()
    a = net.space.min_config()
    b = net.space.min_config()
    b["kernel"][-1] = 7  # a block of stage 2, which scales = 1 never runs
    b["depth"][2] = 2
    assert a != b and net.space.canonical(a) == net.space.canonical(b)
    b["scales"] = [3]
    a["scales"] = [3]
    assert net.space.canonical(a) != net.space.canonical(b)


def test_bad_configs_and_inputs_are_refused_with_the_valid_choices() -> None:
    net = tiny_net()
    cfg = net.space.max_config()
    cfg["scales"] = [4]
    with pytest.raises(UsageError, match=r"scales.*\[1, 2, 3\]"):
        net.set_active(cfg)
    with pytest.raises(UsageError, match="6, H, W"):
        net(torch.randn(1, 3, 16, 32))
    with pytest.raises(UsageError, match="divisible by 8"):
        net(torch.randn(1, 6, 12, 32))
    with pytest.raises(UsageError, match="max_disp"):
        elastic_stereo(max_disp=0)
    with pytest.raises(UsageError, match="stem_stride"):
        elastic_stereo(stem_stride=3)


def test_registered_model_builds_with_the_contract_defaults() -> None:
    from lowcomm import models

    meta = models.info("elastic_stereo")
    assert meta.task == "stereo" and meta.default_input_shape == (6, 64, 128)
    net = models.create("elastic_stereo")
    assert isinstance(net, ElasticStereoNet) and net.max_disp == 32
    assert [h.num_disp for h in net.heads if isinstance(h, ScaleHead)] == [9, 5, 3]  # 1/4..1/16
    same = models.create("elastic_stereo", max_disp=32.0)  # what a data set's float gives
    assert isinstance(same, ElasticStereoNet) and same.max_disp == 32
    assert net.space.names == ("kernel", "expand", "depth", "scales")
    assert net.space.dim("scales").choices == (1, 2, 3)
    with torch.no_grad():
        out = net.eval()(torch.randn(1, 6, 64, 128))
    assert isinstance(out, torch.Tensor) and out.shape == (1, 64, 128)

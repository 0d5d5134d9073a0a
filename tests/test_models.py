"""Behaviour of the model registry: shapes, gradients, reference parameter counts, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowcomm import models
from lowcomm.errors import UsageError
from lowcomm.models import count_parameters, non_embedding_parameters
from tolerance import assert_close_eps

# Tiny configurations: every registered model, cheap to run forward+backward on 2 cores.
TINY_KWARGS: dict[str, dict] = {
    "resnet18": {},
    "resnet34": {},
    "resnet50": {},
    "resnet18_imagenet": {"num_classes": 7},
    "resnet50_imagenet": {"num_classes": 7},
    "wide_resnet50_2": {"num_classes": 7},
    "vgg19": {},
    "vgg16": {},
    "vgg16_imagenet": {"num_classes": 7},  # the 25088x4096 head stays: 1.1 GB with its gradient
    "lstm_lm": {"vocab_size": 100, "emb_size": 32, "hidden_size": 32},
    "transformer": {"vocab_size": 50, "d_model": 32, "nhead": 4, "num_encoder_layers": 2,
                    "num_decoder_layers": 2, "dim_feedforward": 64},
    "transformer_lm": {"vocab_size": 50, "d_model": 32, "nhead": 4, "num_layers": 2,
                       "max_len": 16},
    "cnn1d": {},
    "cnn2d": {},
    "mlp": {},
    "elastic_cnn1d": {},
    "elastic_cnn2d": {},
    "elastic_stereo": {"max_disp": 16, "stem_channels": 4, "channels": (4, 6, 8), "stem_stride": 2,
                       "depth_choices": (1, 2), "agg_channels": 4, "refine_channels": 4},
}
TINY_INPUT_SHAPE = {"resnet18_imagenet": (3, 64, 64), "resnet50_imagenet": (3, 64, 64), "vgg16_imagenet": (3, 32, 32),
                    "wide_resnet50_2": (3, 64, 64), "elastic_stereo": (6, 16, 32)}


def test_every_registered_model_has_a_tiny_test_configuration() -> None:
    assert sorted(TINY_KWARGS) == models.names()


@pytest.mark.parametrize("name", sorted(TINY_KWARGS))
def test_forward_backward_gives_contract_shapes_and_gradients(name: str) -> None:
    torch.manual_seed(0)
    kw = TINY_KWARGS[name]
    meta = models.info(name)
    model = models.create(name, **kw)
    assert model.lowcomm_name == name
    b = 2
    if meta.task == "classification":
        shape = TINY_INPUT_SHAPE.get(name, meta.default_input_shape)
        x = torch.randn(b, *shape)
        out = model(x)
        assert out.shape == (b, kw.get("num_classes", meta.default_num_classes))
        target = torch.randint(0, out.shape[1], (b,))
        loss = nn.functional.cross_entropy(out, target)
    elif meta.task == "stereo":
        from lowcomm.elastic.stereo.loss import multiscale_loss

        out = model(torch.randn(b, *TINY_INPUT_SHAPE[name]))
        assert all(o.shape == (b, 16, 32) for o in out)  # one map per scale, then the refined one
        loss = multiscale_loss(out, torch.rand(b, 16, 32) * 15 + 0.5, 16)
    else:
        vocab = kw["vocab_size"]
        x = torch.randint(0, vocab, (b, 9), dtype=torch.int64)
        out = model(x)
        assert out.shape == (b, 9, vocab)
        loss = nn.functional.cross_entropy(out.reshape(-1, vocab), x.reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("resnet18", 11_173_962),  # kuangliu/pytorch-cifar ResNet18, 10 classes
        ("resnet50_imagenet", 25_557_032),  # torchvision resnet50
        ("resnet18_imagenet", 11_689_512),  # torchvision resnet18
        ("wide_resnet50_2", 68_883_240),  # torchvision wide_resnet50_2
        ("vgg19", 20_560_330),  # Pufferfish CIFAR VGG-19-BN
        ("lstm_lm", 85_962_278),  # Pufferfish 2x1500 tied LSTM, vocab 33,278
    ],
)
def test_reference_configurations_have_published_parameter_counts(name: str, expected: int) -> None:
    assert count_parameters(models.create(name)) == expected


def test_transformer_non_embedding_parameters_match_pufferfish() -> None:
    model = models.create("transformer")
    assert non_embedding_parameters(model) == 44_103_680
    # The shared embedding (32000 x 512) is counted once in the total.
    assert count_parameters(model) == 44_103_680 + 32000 * 512


def test_non_embedding_parameters_exclude_untied_output_projection() -> None:
    model = models.create("transformer_lm", vocab_size=50, d_model=32, nhead=4, num_layers=1,
                          max_len=8)
    tied = non_embedding_parameters(model)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untie
    assert non_embedding_parameters(model) == tied
    assert count_parameters(model) == tied + 50 * 32 * 2 + 8 * 32


def test_lstm_lm_with_nn_lstm_keeps_two_bias_vectors() -> None:
    # Documented difference: nn.LSTM's bias_ih + bias_hh adds 4h per layer.
    model = models.create("lstm_lm", vocab_size=100, emb_size=16, hidden_size=16, impl="torch")
    reference = models.create("lstm_lm", vocab_size=100, emb_size=16, hidden_size=16)
    assert count_parameters(model) == count_parameters(reference) + 2 * 4 * 16


def test_linear_lstm_matches_torch_lstm_with_same_weights() -> None:
    torch.manual_seed(0)
    ours = models.create("lstm_lm", vocab_size=30, emb_size=8, hidden_size=8, num_layers=2).eval()
    ref = models.create("lstm_lm", vocab_size=30, emb_size=8, hidden_size=8, num_layers=2,
                        impl="torch").eval()
    with torch.no_grad():
        ref.encoder.weight.copy_(ours.encoder.weight)
        ref.decoder.bias.copy_(ours.decoder.bias)
        for k, layer in enumerate(ours.rnn.layers):
            getattr(ref.rnn, f"weight_ih_l{k}").copy_(layer.ih.weight)
            getattr(ref.rnn, f"weight_hh_l{k}").copy_(layer.hh.weight)
            getattr(ref.rnn, f"bias_ih_l{k}").copy_(layer.ih.bias)
            getattr(ref.rnn, f"bias_hh_l{k}").zero_()
    tokens = torch.randint(0, 30, (3, 7))
    # Same arithmetic but a different grouping (our gates as separate products, biases summed
    # once): 2 layers x 7 steps x (ih 8 + hh 8 + biases 2), then the decoder's 8
    assert_close_eps(ours(tokens), ref(tokens), torch.float32, ops=2 * 7 * (8 + 8 + 2) + 8)


def test_lstm_lm_decoder_is_tied_to_encoder() -> None:
    model = models.create("lstm_lm", vocab_size=100, emb_size=16, hidden_size=16)
    assert model.decoder.weight is model.encoder.weight
    with pytest.raises(UsageError, match="emb_size == hidden_size"):
        models.create("lstm_lm", vocab_size=100, emb_size=16, hidden_size=32)


@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_copy_task_equals_explicit_shifted_target(norm_first: bool) -> None:
    torch.manual_seed(0)
    model = models.create("transformer", **TINY_KWARGS["transformer"], norm_first=norm_first,
                          bos_id=1).eval()
    src = torch.randint(2, 50, (2, 6))
    shifted = torch.cat([torch.ones(2, 1, dtype=torch.long), src[:, :-1]], dim=1)
    torch.testing.assert_close(model(src), model(src, shifted))
    assert models.info("transformer").lm_target == "input"
    assert models.info("transformer_lm").lm_target == "next"


def test_transformer_decoder_is_causal() -> None:
    torch.manual_seed(0)
    model = models.create("transformer", **TINY_KWARGS["transformer"]).eval()
    src = torch.randint(0, 50, (1, 6))
    tgt = torch.randint(0, 50, (1, 6))
    changed = tgt.clone()
    changed[0, 4:] = (changed[0, 4:] + 1) % 50
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_transformer_lm_is_causal_and_refuses_overlong_input() -> None:
    torch.manual_seed(0)
    model = models.create("transformer_lm", **TINY_KWARGS["transformer_lm"]).eval()
    x = torch.randint(0, 50, (1, 10))
    y = x.clone()
    y[0, 7] = (y[0, 7] + 1) % 50
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_transformer_attention_is_nn_multihead_attention_without_bias() -> None:
    model = models.create("transformer", **TINY_KWARGS["transformer"])
    attn = model.encoder.layers[0].self_attn
    assert isinstance(attn, nn.MultiheadAttention)
    assert attn.in_proj_bias is None and attn.out_proj.bias is None
    assert isinstance(model.decoder.layers[1].cross_attn, nn.MultiheadAttention)


@pytest.mark.parametrize("name", ["cnn1d", "mlp"])
def test_small_models_accept_64_feature_digits(name: str) -> None:
    model = models.create(name, input_dim=64)
    assert model(torch.randn(5, 64)).shape == (5, 10)


def test_resnets_use_torchvision_module_names() -> None:
    cifar = dict(models.create("resnet18").named_modules())
    for key in ["conv1", "bn1", "layer1.0.conv1", "layer2.0.downsample.0", "layer4.1.bn2", "fc"]:
        assert key in cifar
    assert "layer1.0.downsample" not in cifar or cifar["layer1.0.downsample"] is None
    assert cifar["conv1"].kernel_size == (3, 3) and cifar["conv1"].stride == (1, 1)
    imagenet = dict(models.create("resnet50_imagenet", num_classes=10).named_modules())
    assert imagenet["conv1"].kernel_size == (7, 7)
    assert imagenet["layer2.0.conv2"].stride == (2, 2)  # v1.5: stride on the 3x3
    assert "layer1.0.downsample.1" in imagenet


def test_vgg19_has_16_convs_without_bias_and_two_fc_head() -> None:
    from lowcomm.models.vgg import VGG19_CONV_INDICES

    model = models.create("vgg19")
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    assert len(convs) == 16 and all(c.bias is None for c in convs)
    assert [model.features[i] for i in VGG19_CONV_INDICES] == convs
    linears = [m for m in model.classifier if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(512, 512), (512, 512), (512, 10)]


def test_unknown_model_name_lists_valid_names() -> None:
    with pytest.raises(UsageError) as err:
        models.create("resnet19")
    msg = str(err.value)
    assert "resnet19" in msg and "resnet18" in msg and "lstm_lm" in msg and "vgg19" in msg
    with pytest.raises(UsageError):
        models.info("nope")


def test_unknown_model_option_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="num_clases.*valid: .*num_classes"):
        models.create("resnet18", num_clases=3)


def test_kwargs_for_data_maps_dataset_description_to_model_options() -> None:
    assert models.kwargs_for_data("mlp", num_classes=10, input_shape=(64,)) == {
        "num_classes": 10, "input_dim": 64}
    assert models.kwargs_for_data("resnet18", num_classes=100, input_shape=(3, 32, 32)) == {
        "num_classes": 100, "in_channels": 3}
    assert models.kwargs_for_data("lstm_lm", vocab_size=123) == {"vocab_size": 123}
    with pytest.raises(UsageError, match="language model"):
        models.kwargs_for_data("lstm_lm", num_classes=10)
    with pytest.raises(UsageError, match="classifier"):
        models.kwargs_for_data("cnn1d", vocab_size=10)
    with pytest.raises(UsageError, match="flat"):
        models.kwargs_for_data("cnn1d", num_classes=10, input_shape=(3, 32, 32))

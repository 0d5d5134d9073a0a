"""The ``pufferfish`` method: identical factorization on every rank, switch, resume, options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods, models
from lowcomm.cli import main
from lowcomm.errors import UsageError
from lowcomm.lowrank import LowRankLinear, LowRankLSTM, factorize, factorized_ranks
from lowcomm.lowrank.decay import frobenius_decay_
from lowcomm.runtime import checkpoint
from lowcomm.testing.distributed import run_distributed
from tolerance import assert_close_eps


def _factorize_on_rank(auto_rank: bool) -> dict[str, list[float]]:
    torch.manual_seed(1234)  # identical initial weights on every rank, as DDP guarantees
    model = models.create("cnn1d", channels=16)
    opts = "pufferfish:warmup_epochs=1" + (",auto_rank=true" if auto_rank else "")
    method = methods.create(opts)
    method.prepare(model)
    with torch.no_grad():  # "train": add a dominant direction, so stable ranks fall
        for p in model.parameters():
            if p.dim() >= 2:
                w = p.view(p.shape[0], -1)
                u = torch.arange(w.shape[0], dtype=w.dtype).cos()
                v = torch.arange(w.shape[1], dtype=w.dtype).sin()
                w.add_(torch.outer(u, v) * (3 * w.norm() / (u.norm() * v.norm())))
    assert method.on_epoch_end(1) is True
    model = method.prepare(model)
    assert any(isinstance(m, nn.Module) and type(m).__name__.startswith("LowRank") for m in model.modules())
    assert dist.get_world_size() == 2
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()} | {"_ranks": [json.dumps(method.ranks)]}


@pytest.mark.parametrize("auto_rank", [False, True])
def test_every_rank_factorizes_identically(auto_rank: bool) -> None:
    a, b = run_distributed(_factorize_on_rank, 2, auto_rank, timeout=120)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k  # bit-identical factors and ranks


def test_frobenius_decay_matches_autograd_of_product_norm() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleDict({
        "lin": LowRankLinear(6, 8, 3),
        "gates": LowRankLinear(5, 8, 2, blocks=4),
        "lstm": LowRankLSTM(nn.LSTM(4, 3, num_layers=1), [(2, 2)]),
    })
    with torch.no_grad():  # the constructors leave factors uninitialized (torch.empty)
        for p in layers.parameters():
            p.normal_()
    for p in layers.parameters():
        p.grad = torch.zeros_like(p)
    frobenius_decay_(layers, 0.5)
    penalty = torch.zeros(())
    for mod in (layers["lin"], layers["gates"]):
        for a, b in mod.factors():
            penalty = penalty + 0.25 * (a @ b).square().sum()
    for a, b in layers["lstm"].factors():
        penalty = penalty + 0.25 * (a @ b).square().sum()
    grads = torch.autograd.grad(penalty, list(layers.parameters()), allow_unused=True)
    for (name, p), g in zip(layers.named_parameters(), grads):
        expected = g if g is not None else torch.zeros_like(p)
        # closed form vs autograd of 0.25 |A B|^2: product of rank r <= 3, then a product over
        # up to 12 rows (the LSTM's 4 gates x 3), and the 0.5 factor: r + rows + 2 roundings
        assert_close_eps(p.grad, expected, torch.float32, ops=3 + 12 + 2, msg=name)


def test_options_are_validated() -> None:
    for bad, msg in [
        ("pufferfish:rank_ratio=0", "rank_ratio"),
        ("pufferfish:rank_ratio=1.5", "rank_ratio"),
        ("pufferfish:warmup_epochs=-1", "warmup_epochs"),
        ("pufferfish:auto_rank=true", "warm-up"),
        ("pufferfish:warmup_method=pufferfish", "itself"),
        ("pufferfish:warmup_method=nosuch", "unknown method"),
    ]:
        with pytest.raises(UsageError, match=msg):
            methods.create(bad)


def test_model_with_nothing_to_factorize_is_refused_by_the_method() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(UsageError, match="nothing to factorize"):
        methods.create("pufferfish").prepare(model)


def test_lstm_lm_gate_preset_is_per_gate() -> None:
    model = models.create("lstm_lm", vocab_size=50, emb_size=16, hidden_size=16, dropout=0.0)
    model = factorize(model)
    ranks = factorized_ranks(model)
    assert ranks == {"rnn.layers.0.ih": 4, "rnn.layers.0.hh": 4, "rnn.layers.1.ih": 4, "rnn.layers.1.hh": 4}
    assert model.rnn.layers[0].ih.blocks == 4
    assert model.decoder.weight is model.encoder.weight  # tied output layer untouched


FAST = ["--model", "mlp", "--data", "mnist1d", "--nproc", "2", "--batch-size", "128", "--lr", "0.05",
        "--threads", "1", "--quiet", "--no-progress", "--epochs", "2"]


def _final(ckpt: Path) -> dict[str, torch.Tensor]:
    manifest = checkpoint.latest(str(ckpt))
    assert manifest is not None
    return checkpoint.load_rank(str(ckpt), manifest["step"], 0)["model"]


def test_switch_then_resume_before_and_after_the_switch_matches_straight_run(tmp_path: Path) -> None:
    method = ["--method", "pufferfish:warmup_epochs=1,rewarmup_epochs=0.5,frob_decay=0.0001"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    out = tmp_path / "s.json"
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(straight), "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    info = s["method_info"]
    assert info["switched"] and info["switch_epoch"] == 1
    assert s["params"] < s["params_initial"] and s["params"] == info["lowrank"]["params"]["after"]
    assert info["lowrank"]["macs"]["after"] < info["lowrank"]["macs"]["before"]
    # after the switch, plain all-reduce of the smaller model: 2(P-1)/P * 4 bytes * params
    assert s["bytes_per_worker_per_iter"] == 4 * s["params"]

    # 16 steps per epoch: stop inside warm-up (step 10), then after the switch (step 22).
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(resumed), "--stop-after-steps", "10"]) == 0
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(resumed), "--resume",
                 "--stop-after-steps", "12"]) == 0
    assert checkpoint.latest(str(resumed))["step"] == 22
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    a, b = _final(straight), _final(resumed)
    assert a.keys() == b.keys() and any(".v.weight" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k

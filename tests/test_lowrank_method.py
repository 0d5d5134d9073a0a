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
from lowcomm.methods.base import split_top_level, strip_parens
from lowcomm.optim import frobenius_decay_
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


# --- nested method specs: then= and warmup_method= take any method with any options --------

def test_nested_specs_split_only_outside_parentheses() -> None:
    assert split_top_level("then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.25") == [
        "then=(acpsgd:rank=4,start_iter=5)", "rank_ratio=0.25"]
    assert split_top_level(" a=((b:c=1,d=2)) , ,e=3") == ["a=((b:c=1,d=2))", "e=3"]
    assert strip_parens(" (acpsgd:rank=4,start_iter=5) ") == "acpsgd:rank=4,start_iter=5"
    assert strip_parens("(a)(b)") == "(a)(b)"  # not one enclosing pair
    assert strip_parens("acpsgd:rank=4") == "acpsgd:rank=4"


@pytest.mark.parametrize("spec", ["pufferfish:then=(acpsgd:rank=4", "pufferfish:then=acpsgd:rank=4),rank_ratio=0.5"])
def test_unbalanced_parentheses_are_a_one_line_usage_error(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="unbalanced parentheses"):
        methods.create(spec)
    assert main(["train", "--model", "mlp", "--data", "digits", "--steps", "1", "--quiet", "--method", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unbalanced parentheses" in err[0]


def test_nested_specs_build_the_inner_methods_with_their_options() -> None:
    p = methods.create("pufferfish:then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.5,warmup_epochs=1,"
                       "warmup_method=(powersgd:rank=2,warm_start=false)")
    assert p.options.rank_ratio == 0.5
    assert p.inner.describe()["method"] == "powersgd"
    assert p.inner.describe()["options"]["rank"] == 2 and p.inner.describe()["options"]["warm_start"] is False
    assert p.on_epoch_end(1) is True
    inner = p.inner.describe()
    assert inner["method"] == "acpsgd" and inner["options"]["rank"] == 4 and inner["options"]["start_iter"] == 5
    # one option needs no parentheses; no warm-up: the then= method runs from the start
    assert methods.create("pufferfish:then=acpsgd:rank=3").inner.describe()["options"]["rank"] == 3
    # the old ";" separator of warmup_method still reads (deprecated alias)
    old = methods.create("pufferfish:warmup_epochs=1,warmup_method=powersgd:rank=4;start_iter=10")
    assert old.inner.describe()["options"]["start_iter"] == 10


def test_nested_spec_errors_name_the_nested_method_or_the_missing_parentheses() -> None:
    with pytest.raises(UsageError, match=r"start_iter.*then=\(acpsgd:rank=4,start_iter=\.\.\.\)"):
        methods.create("pufferfish:then=acpsgd:rank=4,start_iter=5")
    with pytest.raises(UsageError, match="unknown option 'nosuch' for method 'acpsgd'"):
        methods.create("pufferfish:then=(acpsgd:nosuch=1)")
    with pytest.raises(UsageError, match="then cannot be pufferfish itself"):
        methods.create("pufferfish:then=(pufferfish:rank_ratio=0.5)")


def test_then_method_with_its_own_momentum_sets_the_optimizer_for_the_whole_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lowcomm.methods import pufferfish
    from lowcomm.methods.base import Method, OptimizerOverride
    from lowcomm.runtime.config import TrainConfig

    cfg = TrainConfig()
    assert {o.field: o.value for o in methods.create("pufferfish:then=signum").optimizer_overrides(cfg)} == {
        "momentum": 0.0, "lr": pytest.approx(cfg.lr * (1 + cfg.momentum))}
    both = methods.create("pufferfish:warmup_epochs=1,warmup_method=signum,then=signum").optimizer_overrides(cfg)
    assert [o.field for o in both] == ["momentum", "lr"]  # the same needs, once

    class Wants(Method):  # a method needing lr = its option
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.lr = lr

        def optimizer_overrides(self, cfg: object) -> list[OptimizerOverride]:
            return [OptimizerOverride("lr", self.lr, "why")]

    monkeypatch.setattr(pufferfish, "_make_inner", lambda key, spec: Wants(0.1 if key == "then" else 0.2))
    method = methods.create("pufferfish:warmup_epochs=1")
    with pytest.raises(UsageError, match="warmup_method needs lr=0.2 but then needs lr=0.1; give --lr explicitly"):
        method.optimizer_overrides(cfg)
    cfg.explicit_flags = ["lr"]  # typed: kept (apply_method_overrides warns), no conflict to solve
    assert [o.value for o in method.optimizer_overrides(cfg)] == [0.2]


def test_pufferfish_then_acpsgd_switches_to_acpsgd_and_resumes_exactly(tmp_path: Path) -> None:
    # 16 steps per epoch: warm-up (ssgd) for epoch 1, then acpsgd rank 2 from step 16 (its
    # start_iter counts its own steps: all-reduce for 3 more steps, then low-rank factors)
    method = ["--method", "pufferfish:warmup_epochs=1,then=(acpsgd:rank=2,start_iter=3),rewarmup_epochs=0.25"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    out, log = tmp_path / "s.json", tmp_path / "s.jsonl"
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(straight), "--json", str(out),
                 "--log", str(log)]) == 0
    s = json.loads(out.read_text())
    inner = s["method_info"]["current_method"]
    assert s["method_info"]["switched"] and inner["method"] == "acpsgd"
    assert inner["options"]["rank"] == 2 and inner["options"]["start_iter"] == 3
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "step"]
    dense = 4 * s["params"]  # ssgd's bytes per step for P = 2 on the factorized model
    assert [r["bytes"] == dense for r in steps[16:]] == [True] * 3 + [False] * 13
    assert all(r["bytes"] < dense for r in steps[19:])  # acpsgd's factors are smaller
    # resume after the switch (step 20: acpsgd's error feedback is live) is bit-identical
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(resumed), "--stop-after-steps", "20"]) == 0
    assert main(["train", *FAST, *method, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    a, b = _final(straight), _final(resumed)
    assert a.keys() == b.keys() and any(".v.weight" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_frob_decay_with_a_sharding_then_engine_is_refused_at_parse_time() -> None:
    """Frobenius decay adds to the factors' ``.grad``; dear / lee18 hold gradient shards
    (``p.grad`` is None), so the decay would silently do nothing. Every method is placed by
    its engine ``mode`` (nothing listed by name): sharding modes are refused with a one-line
    reason naming what works; full-gradient engines and DDP methods are accepted, as are
    a sharding then= without decay and a sharding warm-up (no factors exist before the switch)."""
    from lowcomm.sched.pairing import Mode

    modes = {n: getattr(methods.method_class(n), "mode", None) for n in methods.names() if n != "pufferfish"}
    sharding = [n for n, m in modes.items() if isinstance(m, Mode) and m is not Mode.ALLREDUCE]
    full = [n for n, m in modes.items() if m is Mode.ALLREDUCE]
    assert sharding and full  # the engine methods are registered
    for name in sharding:
        with pytest.raises(UsageError) as e:
            methods.create(f"pufferfish:frob_decay=0.0001,then={name}")
        text = str(e.value)
        assert "\n" not in text and "frob_decay" in text and "shards" in text and "DDP method" in text
        assert all(n in text for n in full)
        methods.create(f"pufferfish:frob_decay=0,then={name}")
        methods.create(f"pufferfish:frob_decay=0.0001,warmup_epochs=1,warmup_method={name}")
    for name in modes:
        if name not in sharding:
            methods.create(f"pufferfish:frob_decay=0.0001,then={name}")
    with pytest.raises(UsageError, match="frob_decay"):  # with its options, in parentheses
        methods.create("pufferfish:frob_decay=0.0001,then=(lee18:compress=fp16)")

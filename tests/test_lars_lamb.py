"""LARS and LAMB: the update each paper defines, the same on both code paths, sync-free,
exact checkpoints, and the trainer's ``--optimizer lars|lamb[:key=value,...]``.

References are written from the papers' formulas in float64 (You et al. 2017, eq. 6 with
torch-SGD momentum; You et al. 2019, Algorithm 2), independent of the implementation's
multi-tensor code. Tolerances (tests/tolerance.py): the float32 implementation against a
float64 reference differs by the rounding of its longest dependency chain: a norm of n
elements (n roundings, Higham §3.1) feeds the ratio, which scales every element of the step,
then a few elementwise ops; ``ops = steps * (n + 8)`` counts it generously but in eps units.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.optim import LAMB, LARS, LARSWrapper
from lowcomm.optim.builders import build_optimizer, param_groups
from lowcomm.optim.sharded import check_elementwise
from lowcomm.runtime.config import TrainConfig
from test_host_sync import HostReads
from tolerance import assert_close_eps

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "lars": lambda ps, **kw: LARS(ps, lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.02, **kw),
    "lars-nesterov": lambda ps, **kw: LARS(ps, lr=0.5, momentum=0.9, weight_decay=1e-3, nesterov=True, **kw),
    "lars-no-momentum": lambda ps, **kw: LARS(ps, lr=0.5, momentum=0.0, weight_decay=0.0, **kw),
    "lamb": lambda ps, **kw: LAMB(ps, lr=0.01, weight_decay=0.01, **kw),
    "lamb-no-bias-correction": lambda ps, **kw: LAMB(ps, lr=0.01, bias_correction=False, trust_clip=2.0, **kw),
}


class Net(nn.Module):
    """Conv + norm + linear layers (2-D and 4-D weights, 1-D biases and norm parameters) and a
    layer with no gradient this step (``unused``), which every path must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # no conv bias: the norm right after it removes its gradient (left with round-off
        # noise, which any two correct implementations turn into different steps)
        self.conv = nn.Conv1d(1, 4, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4 * 8, 5)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 1, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen)


def _train(net: nn.Module, opt: Any, steps: range) -> None:
    for s in steps:
        x, y = _batch(s)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


# --- the update the papers define --------------------------------------------------------------
def _lars_reference(w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, *, lr: float, momentum: float,
                    wd: float, eta: float, eps: float, adapted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, g = w.double(), g.double()
    if adapted:
        wn, gn = w.norm(), g.norm()
        trust = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else torch.tensor(1.0, dtype=torch.float64)
        d = trust * (g + wd * w)
    else:
        d = g
    buf = momentum * buf.double() + d
    return w - lr * buf, buf


def test_lars_step_is_the_papers_trust_ratio_update_and_spares_biases() -> None:
    net = Net()
    ref = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = LARS(net.parameters(), lr=0.7, momentum=0.9, weight_decay=1e-3, eta=0.01, eps=1e-8)
    bufs = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in net.named_parameters()}
    for s in range(3):
        x, y = _batch(s)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
        weights = {n: p.detach().clone() for n, p in net.named_parameters()}  # current (float32) weights
        opt.step()
        for n, p in net.named_parameters():
            if n not in grads:
                assert torch.equal(p, ref[n]), f"{n} has no gradient and must not move"
                continue
            expected, bufs[n] = _lars_reference(weights[n], grads[n], bufs[n], lr=0.7, momentum=0.9, wd=1e-3,
                                                eta=0.01, eps=1e-8, adapted=p.ndim > 1)
            assert_close_eps(p.detach(), expected.float(), torch.float32, ops=p.numel() + 8, msg=n)


def test_lamb_first_step_is_the_trust_ratio_times_the_decayed_adam_step() -> None:
    net = Net()
    before = {n: p.detach().clone().double() for n, p in net.named_parameters()}
    # betas exact in binary (0.5, 0.75): 1 - beta^t is then exact in float32; with 0.999 the
    # float32 bias correction alone carries a cancellation error of 1000 eps (cond 1/(1-beta2))
    opt = LAMB(net.parameters(), lr=0.01, betas=(0.5, 0.75), eps=1e-6, weight_decay=0.01)
    x, y = _batch(0)
    nn.functional.cross_entropy(net(x), y).backward()
    grads = {n: p.grad.detach().double() for n, p in net.named_parameters() if p.grad is not None}
    opt.step()
    for n, p in net.named_parameters():
        if n not in grads:
            continue
        w, g = before[n], grads[n]
        # step 1 with bias correction: m_hat = g, v_hat = g^2
        u = g / (g.abs() + 1e-6)
        if p.ndim > 1:
            u = u + 0.01 * w
            u = (w.norm() / u.norm()) * u
        assert_close_eps(p.detach(), (w - 0.01 * u).float(), torch.float32, ops=p.numel() + 8, msg=n)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_a_group_marked_excluded_takes_the_plain_step(name: str) -> None:
    """``exclude_from_adaptation`` on a group: no ratio, no decay, also for 2-D weights
    (LARS then is torch's SGD, LAMB torch's Adam)."""
    net = Net()
    twin = copy.deepcopy(net)
    group = [{"params": list(net.parameters()), "exclude_from_adaptation": True}]
    if name == "lars":
        ours: torch.optim.Optimizer = LARS(group, lr=0.5, momentum=0.9, weight_decay=1e-3)
        plain: torch.optim.Optimizer = torch.optim.SGD(twin.parameters(), lr=0.5, momentum=0.9)
    else:  # betas exact in binary: torch's Adam computes 1 - beta^t in float64, LAMB on the device
        ours = LAMB(group, lr=0.01, betas=(0.5, 0.75), weight_decay=0.01)
        plain = torch.optim.Adam(twin.parameters(), lr=0.01, betas=(0.5, 0.75), eps=1e-6)
    _train(net, ours, range(3))
    _train(twin, plain, range(3))
    for (n, a), b in zip(net.named_parameters(), twin.parameters()):
        assert_close_eps(a.detach(), b.detach(), ops=3 * 8, msg=n)


def test_param_groups_mark_the_no_decay_group_not_adapted() -> None:
    groups = param_groups(Net(), 1e-4, no_decay_norm_bias=True)
    assert groups[0]["weight_decay"] == 1e-4 and not groups[0].get("exclude_from_adaptation", False)
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["exclude_from_adaptation"] is True
    assert all(p.ndim <= 1 for p in groups[1]["params"]) and all(p.ndim > 1 for p in groups[0]["params"])


def test_a_zero_weight_or_zero_gradient_gives_ratio_one_not_nan() -> None:
    for cls in (LARS, LAMB):
        w = nn.Parameter(torch.zeros(3, 4))
        opt = cls([w], lr=0.1)
        w.grad = torch.ones(3, 4)
        opt.step()
        assert torch.isfinite(w).all() and not torch.equal(w, torch.zeros(3, 4)), cls.__name__
        v = nn.Parameter(torch.ones(3, 4))
        opt = cls([v], lr=0.1, weight_decay=0.0)
        v.grad = torch.zeros(3, 4)
        opt.step()
        assert torch.equal(v, torch.ones(3, 4)), cls.__name__


# --- two code paths, one rule --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_multi_tensor_path_equals_per_parameter_loop(name: str) -> None:
    steps = 5
    a, b = Net(), Net()
    groups: list[dict[str, Any]] = [
        {"params": [a.conv.weight, a.fc.weight, a.unused.weight]},
        {"params": [a.norm.weight, a.norm.bias, a.fc.bias, a.unused.bias], "weight_decay": 0.0,
         "exclude_from_adaptation": True},
    ]
    names = {id(p): n for n, p in a.named_parameters()}
    bp = dict(b.named_parameters())
    twin = [{**g, "params": [bp[names[id(p)]] for p in g["params"]]} for g in groups]
    _train(a, OPTIMIZERS[name](groups, foreach=True), range(steps))
    _train(b, OPTIMIZERS[name](twin, foreach=False), range(steps))
    n = max(p.numel() for p in a.parameters())
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert_close_eps(pa.detach(), pb.detach(), ops=steps * (n + 8), msg=k)


def test_lars_wrapper_around_torch_sgd_is_lars() -> None:
    a, b = Net(), Net()
    _train(a, LARS(a.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3), range(4))
    _train(b, LARSWrapper(torch.optim.SGD(b.parameters(), lr=0.5, momentum=0.9), weight_decay=1e-3), range(4))
    n = max(p.numel() for p in a.parameters())
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert_close_eps(pa.detach(), pb.detach(), ops=4 * (n + 8), msg=k)


def test_lars_wrapper_refuses_decay_in_the_wrapped_optimizer() -> None:
    with pytest.raises(UsageError, match="weight_decay"):
        LARSWrapper(torch.optim.SGD(Net().parameters(), lr=0.1, weight_decay=1e-4))


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_multi_tensor_step_reads_nothing_back_to_the_host(name: str) -> None:
    """No ``.item()`` / ``bool(tensor)`` per parameter: on CUDA the step never waits for the GPU."""
    net = Net()
    opt = OPTIMIZERS[name](net.parameters())
    x, y = _batch(0)
    nn.functional.cross_entropy(net(x), y).backward()
    with HostReads() as reads:
        opt.step()
        opt.step()  # the state exists now: the steady-state path too
    assert reads.count == 0, reads.report()


# --- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lars", "lamb-no-bias-correction", "lamb"])
def test_state_dict_round_trip_resumes_exactly(name: str) -> None:
    straight = Net()
    _train(straight, OPTIMIZERS[name](straight.parameters()), range(6))

    first = Net()
    opt = OPTIMIZERS[name](first.parameters())
    _train(first, opt, range(3))
    blob = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, map_location="cpu", weights_only=True)
    resumed = Net()
    resumed.load_state_dict(saved["model"])
    opt2 = OPTIMIZERS[name](resumed.parameters())
    opt2.load_state_dict(saved["opt"])
    _train(resumed, opt2, range(3, 6))
    for (k, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), k


def test_lamb_moves_a_loaded_step_count_beside_its_parameter() -> None:
    net = Net()
    opt = LAMB(net.parameters())
    _train(net, opt, range(1))
    # parameters on another device than the checkpoint's map_location ("meta" stands for cuda)
    elsewhere = LAMB(Net().to("meta").parameters())
    elsewhere.load_state_dict(opt.state_dict())
    assert all(s["step"].device == p.device == torch.device("meta") for p, s in elsewhere.state.items())


# --- mixed precision -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_under_a_grad_scaler_the_trust_ratio_sees_unscaled_gradients(name: str) -> None:
    """``scaler.step`` unscales before the step (``unscale_``), so the layer-wise ratio, which is
    not scale-invariant (LARS's ``+ wd * ||w||`` term, LAMB's eps), is that of the true gradient.
    The scale is a power of two: dividing by it is exact, so the runs agree bit for bit."""
    a, b = Net(), Net()
    opt_a, opt_b = OPTIMIZERS[name](a.parameters()), OPTIMIZERS[name](b.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for s in range(3):
        x, y = _batch(s)
        for net, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(x), y)
            if net is a:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    for (k, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), k


# --- errors and the trainer ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda ps: LARS(ps, lr=-1.0), "lr"),
        (lambda ps: LARS(ps, momentum=1.0), "momentum"),
        (lambda ps: LARS(ps, eta=0.0), "eta"),
        (lambda ps: LARS(ps, momentum=0.0, nesterov=True), "nesterov"),
        (lambda ps: LAMB(ps, betas=(0.9, 1.0)), "beta2"),
        (lambda ps: LAMB(ps, eps=float("nan")), "eps"),
        (lambda ps: LAMB(ps, trust_clip=0.0), "trust_clip"),
    ],
)
def test_bad_hyperparameters_are_usage_errors_naming_them(make: Callable[..., Any], fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        make(Net().parameters())


def test_sharded_lee18_refuses_layer_wise_optimizers() -> None:
    for opt in (LARS(Net().parameters()), LAMB(Net().parameters())):
        with pytest.raises(UsageError, match="elementwise"):
            check_elementwise(opt)


def _resolved(spec: str, **kw: Any) -> TrainConfig:
    cfg = TrainConfig(optimizer=spec, **kw)
    cfg.validate()
    return cfg


def test_optimizer_specs_resolve_to_the_name_and_every_key() -> None:
    cfg = _resolved("lars:eta=0.002,trust_clip=1.5")
    assert cfg.optimizer == "lars" and cfg.optimizer_options["eta"] == 0.002
    assert cfg.optimizer_options["trust_clip"] == 1.5 and cfg.optimizer_options["exclude_1d"] is True
    cfg = _resolved("lamb:beta2=0.98,bias_correction=false")
    assert cfg.optimizer == "lamb" and cfg.optimizer_options["beta2"] == 0.98
    assert cfg.optimizer_options["bias_correction"] is False
    cfg.validate()  # idempotent (the trainer resolves again)
    assert cfg.optimizer == "lamb" and cfg.optimizer_options["beta2"] == 0.98
    cfg = _resolved("kfac:base=lars")
    assert cfg.optimizer == "lars" and cfg.kfac is not None


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("lars:nosuch=1", ["'nosuch'", "--optimizer lars", "eta", "trust_clip"]),
        ("lars:lr=1", ["lr", "--lr"]),
        ("lamb:weight_decay=0.1", ["--weight-decay"]),
        ("lars:eta=0", ["eta", "(0,"]),
        ("lamb:beta1=1.5", ["beta1", "[0, 1)"]),
        ("lars:foreach=maybe", ["foreach"]),
        ("sgd:eta=1", ["sgd takes no options"]),
    ],
)
def test_bad_optimizer_specs_are_usage_errors_naming_the_key(spec: str, fragments: list[str]) -> None:
    with pytest.raises(UsageError) as e:
        _resolved(spec)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert "method" not in str(e.value)


def test_optimizer_options_for_sgd_from_python_are_refused() -> None:
    with pytest.raises(UsageError, match="lars and lamb"):
        _resolved("sgd", optimizer_options={"eta": 0.1})


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_builder_passes_trainer_flags_and_keys_and_exempts_norms_and_biases(name: str) -> None:
    cfg = _resolved(f"{name}:trust_clip=3", lr=0.25, weight_decay=1e-3, momentum=0.8)
    opt = build_optimizer(cfg, Net())
    assert type(opt).__name__ == name.upper()
    decayed, exempt = opt.param_groups
    assert decayed["lr"] == 0.25 and decayed["weight_decay"] == 1e-3 and decayed["trust_clip"] == 3
    assert exempt["weight_decay"] == 0.0 and exempt["exclude_from_adaptation"] is True
    if name == "lars":
        assert decayed["momentum"] == 0.8


def test_cli_trains_with_lars_and_poly_and_resumes_exactly(tmp_path: Path) -> None:
    from lowcomm.cli import main
    from lowcomm.runtime import checkpoint

    common = ["--model", "mlp", "--data", "mnist1d", "--nproc", "1", "--batch-size", "500", "--lr", "2",
              "--optimizer", "lars:eta=0.01", "--schedule", "poly", "--lr-warmup-epochs", "0.5",
              "--weight-decay", "1e-4", "--epochs", "2", "--threads", "1", "--quiet", "--no-progress"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *common, "--checkpoint-dir", str(straight)]) == 0
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--stop-after-steps", "11"]) == 0
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    last_a, last_b = checkpoint.latest(str(straight)), checkpoint.latest(str(resumed))
    assert last_a is not None and last_b is not None and last_a["step"] == last_b["step"] == 16
    a = checkpoint.load_rank(str(straight), last_a["step"], 0)["model"]
    b = checkpoint.load_rank(str(resumed), last_b["step"], 0)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_half_precision_parameters_get_a_finite_trust_ratio(name: str) -> None:
    """Norms are taken in float32: an fp16 tensor of 10,000 entries of 1000 has norm 1e5, past
    fp16's largest value (65504), which would make the ratio inf/inf = nan."""
    w = nn.Parameter(torch.full((100, 100), 1000.0, dtype=torch.float16))
    w.grad = torch.full_like(w, 1000.0)
    opt = OPTIMIZERS[name]([w])
    opt.step()
    assert torch.isfinite(w).all() and not torch.equal(w, torch.full_like(w, 1000.0))

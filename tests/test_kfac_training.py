"""K-FAC inside training loops: gradient accumulation and a grad scaler give the factors and
the update of the plain full-batch step."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.optim.kfac import KFAC
from tolerance import assert_close_eps


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)


KW = {"factor_update_steps": 1, "inv_update_steps": 1, "factor_decay": 0.0, "damping": 0.1, "kl_clip": None}


def test_accumulated_micro_batches_give_the_full_batch_factors_and_update() -> None:
    x, y = _data()
    full, micro = _model(), _model()
    kfac_full = KFAC(full, **KW)
    kfac_micro = KFAC(micro, accumulation_steps=2, **KW)
    F.cross_entropy(full(x), y).backward()
    for half in (slice(0, 4), slice(4, 8)):  # each loss divided by accumulation_steps
        (F.cross_entropy(micro(x[half]), y[half]) / 2).backward()
    kfac_full.step()
    kfac_micro.step()
    # ops: a factor entry is a sum of 8 products either way, summed in another order (8);
    # the preconditioned gradient adds matmuls of size <= 8 (8). cond: a relative error δ in
    # A or G moves (F + γI)⁻¹ by κ(F + γI)·δ, both factors add (worst layer)
    cond = 1.0
    for (name, f), g in zip(kfac_full.state_dict()["factors"].items(), kfac_micro.state_dict()["factors"].values()):
        kappa = 0.0
        for kind in "AG":
            assert_close_eps(g[kind], f[kind], ops=8, msg=f"{name}.{kind}")
            d = torch.linalg.eigvalsh(f[kind].double()).clamp(min=0)
            kappa += float((d.max() + KW["damping"]) / (d.min() + KW["damping"]))
        cond = max(cond, kappa)
    for (name, p), q in zip(full.named_parameters(), micro.parameters()):
        assert_close_eps(q.grad, p.grad, ops=16, cond=cond, msg=name)


def test_grad_scaler_is_undone_in_G_and_non_finite_steps_leave_factors_unchanged() -> None:
    x, y = _data()
    plain, scaled = _model(), _model()
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(scaled.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    kw = {**KW, "factor_decay": 0.5}
    kfac_p, kfac_s = KFAC(plain, **kw), KFAC(scaled, grad_scaler=scaler, **kw)
    F.cross_entropy(plain(x), y).backward()
    kfac_p.step()
    opt_p.step()
    scaler.scale(F.cross_entropy(scaled(x), y)).backward()
    scaler.unscale_(opt_s)
    kfac_s.step()
    scaler.step(opt_s)
    scaler.update()
    # a power-of-two scale is exact: the same factors and weights, bit for bit
    for (name, p), q in zip(plain.named_parameters(), scaled.parameters()):
        assert torch.equal(p, q), name
    before = copy.deepcopy(kfac_s.state_dict()["factors"])
    for name, f in kfac_p.state_dict()["factors"].items():
        assert torch.equal(f["G"], before[name]["G"]), name
    # an overflowing step (inf gradients): the scaler skips it, the factors keep their values
    opt_s.zero_grad()
    out = scaled(x)
    scaler.scale(F.cross_entropy(out, y) * float("inf")).backward()
    scaler.unscale_(opt_s)
    kfac_s.step()
    scaler.step(opt_s)
    after = kfac_s.state_dict()["factors"]
    for name, f in before.items():
        assert torch.equal(after[name]["G"], f["G"]), name

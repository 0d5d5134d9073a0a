"""K-FAC on one process: the preconditioned gradient against closed forms computed here.

The references are written independently of ``lowcomm.optim.kfac`` and run in float64 from
the float32 layer inputs and output gradients captured by the test's own hooks:

* factors (KAISA's scaling): ``A = aᵀa/N`` with ``a`` the input row (+1 for the bias), ``N``
  rows; ``G = (B·g)ᵀ(B·g)/N`` with ``g`` the output gradient, ``B`` the batch. For a Conv2d
  the rows are (example, position) pairs, ``a`` the patch (built here by slicing, not
  ``unfold``) divided by ``L`` positions and ``g`` multiplied by ``L``.
* inverse form ``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` (by ``solve``); eigen form
  ``Q_G [(Q_Gᵀ ∇W Q_A) / (d_G d_Aᵀ + γ)] Q_Aᵀ``.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.lowrank.layers import LowRankConv, LowRankLinear
from lowcomm.optim.kfac import KFAC
from lowcomm.optim.kfac.options import grad_workers
from lowcomm.optim.kfac.placement import FactorKey, assign, assign_layers, loads
from tolerance import eps, rel_err

F64 = torch.float64


# --- references --------------------------------------------------------------------------------
def _patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """(B·L, C·kh·kw) patches by slicing the padded input (row order: example, then position)."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    xp = F.pad(x, (pw, pw, ph, ph))
    oh = (xp.shape[2] - kh) // sh + 1
    ow = (xp.shape[3] - kw) // sw + 1
    cols = [xp[:, :, i: i + sh * (oh - 1) + 1: sh, j: j + sw * (ow - 1) + 1: sw]
            for i in range(kh) for j in range(kw)]  # each (B, C, oh, ow)
    p = torch.stack(cols, dim=2)  # (B, C, kh·kw, oh, ow): C major, then kernel offset
    return p.reshape(x.shape[0], -1, oh * ow).transpose(1, 2).reshape(-1, p.shape[1] * p.shape[2])


def _with_one(a: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1) if bias else a


def reference_factors(layer: nn.Module, x: torch.Tensor, gout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, G) in float64 for a Linear or Conv2d (module docstring)."""
    x, gout = x.to(F64), gout.to(F64)
    bias = layer.bias is not None
    if isinstance(layer, nn.Conv2d):
        spatial = gout.shape[2] * gout.shape[3]
        a = _with_one(_patches(x, layer), bias) / spatial
        g = gout.permute(0, 2, 3, 1).reshape(-1, gout.shape[1]) * (gout.shape[0] * spatial)
        return a.t() @ a / x.shape[0], g.t() @ g / g.shape[0]
    a = _with_one(x.reshape(-1, x.shape[-1]), bias)
    g = gout.reshape(-1, gout.shape[-1]) * gout.shape[0]
    return a.t() @ a / a.shape[0], g.t() @ g / g.shape[0]


def inverse_form(grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float) -> torch.Tensor:
    eye_a, eye_g = torch.eye(a.shape[0], dtype=F64), torch.eye(g.shape[0], dtype=F64)
    left = torch.linalg.solve(g + damping * eye_g, grad)
    return torch.linalg.solve(a + damping * eye_a, left.t()).t()  # (A+γI) symmetric


def eigen_form(grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float) -> torch.Tensor:
    da, qa = torch.linalg.eigh(a)
    dg, qg = torch.linalg.eigh(g)
    da, dg = da.clamp(min=0), dg.clamp(min=0)
    return qg @ ((qg.t() @ grad @ qa) / (dg[:, None] * da[None, :] + damping)) @ qa.t()


def condition(m: torch.Tensor, damping: float) -> float:
    """κ(M + γI) of a symmetric PSD ``m``."""
    d = torch.linalg.eigvalsh(m).clamp(min=0)
    return float((d.max() + damping) / (d.min() + damping))


# --- fixtures --------------------------------------------------------------------------------
def _grad_matrix(layer: nn.Module) -> torch.Tensor:
    w = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    return torch.cat([w, layer.bias.grad[:, None]], 1) if layer.bias is not None else w


def _capture(layer: nn.Module, store: dict[str, torch.Tensor]) -> None:
    def fwd(m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        store["x"] = inp[0].detach().clone()
        out.register_hook(lambda g: store.__setitem__("g", g.detach().clone()))

    layer.register_forward_hook(fwd)


CASES: dict[str, Any] = {
    "linear": (lambda: nn.Linear(6, 5), (12, 6)),
    "linear_seq_nobias": (lambda: nn.Linear(6, 4, bias=False), (5, 3, 6)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (4, 3, 7, 7)),
}


def _one_step(case: str, compute: str, damping: float, kl_clip: float | None = None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    make, shape = CASES[case]
    layer = make()
    store: dict[str, torch.Tensor] = {}
    _capture(layer, store)
    kfac = KFAC(layer, factor_update_steps=1, inv_update_steps=1, factor_decay=0.0,
                damping=lambda step: damping, kl_clip=kl_clip, lr=0.5, compute=compute)
    x = torch.randn(shape)
    out = layer(x)
    loss = ((out - torch.randn_like(out)) ** 2).mean()
    loss.backward()
    grad = _grad_matrix(layer).detach().clone()
    kfac.step()
    a, g = reference_factors(layer, store["x"], store["g"])
    return layer, grad.to(F64), a, g


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("compute", ["inverse", "eigen"])
def test_preconditioned_gradient_equals_the_closed_form(case: str, compute: str) -> None:
    damping = 0.05
    layer, grad, a, g = _one_step(case, compute, damping)
    form = inverse_form if compute == "inverse" else eigen_form
    other = eigen_form if compute == "inverse" else inverse_form
    expected = form(grad, a, g, damping)
    # float32 implementation vs float64 reference. ops: the longest float32 chain is forming a
    # factor entry (a sum over N rows) plus the matmuls of size a_dim and g_dim (Higham §3.1).
    # cond: a relative error δ in A or G moves (F + γI)⁻¹ by κ(F + γI)·δ; both factors add.
    rows = store_rows(layer, CASES[case][1])
    ops = rows + a.shape[0] + g.shape[0]
    cond = condition(a, damping) + condition(g, damping)
    tol = ops * cond * eps(torch.float32)
    err = rel_err(_grad_matrix(layer), expected)
    assert err <= tol, f"{err:.3g} > {tol:.3g} ({err / eps(torch.float32):.0f} eps)"
    # the test discriminates: the other form (and the raw gradient) are far outside the bound
    assert rel_err(other(grad, a, g, damping), expected) > 10 * tol
    assert rel_err(grad, expected) > 10 * tol


def store_rows(layer: nn.Module, shape: tuple[int, ...]) -> int:
    """Rows N summed into a factor entry: examples x positions (Conv2d) or x leading dims."""
    if isinstance(layer, nn.Conv2d):
        return shape[0] * 16  # 7x7 input, stride 2, padding 1: 4x4 positions
    n = 1
    for s in shape[:-1]:
        n *= s
    return n


def test_kl_clip_scales_every_layer_by_the_closed_form_factor() -> None:
    damping, kl, lr = 0.05, 1e-4, 0.5
    layer, grad, a, g = _one_step("linear", "eigen", damping, kl_clip=kl)
    v = eigen_form(grad, a, g, damping)
    nu = min(1.0, (kl / abs(float((v * grad).sum()) * lr * lr)) ** 0.5)
    assert nu < 0.5  # the clip is active in this case
    rows, cond = 12, condition(a, damping) + condition(g, damping)
    tol = (rows + a.shape[0] + g.shape[0]) * cond * eps(torch.float32)
    assert rel_err(_grad_matrix(layer), v * nu) <= tol


@pytest.mark.parametrize("compute", ["inverse", "eigen"])
def test_embedding_uses_a_diagonal_input_factor(compute: str) -> None:
    torch.manual_seed(1)
    emb = nn.Embedding(7, 4)
    store: dict[str, torch.Tensor] = {}
    _capture(emb, store)
    damping = 0.1
    kfac = KFAC(emb, factor_update_steps=1, inv_update_steps=1, factor_decay=0.0, damping=damping,
                kl_clip=None, compute=compute)
    idx = torch.tensor([[0, 1, 1, 3], [3, 3, 5, 0]])
    out = emb(idx)
    (out * torch.randn_like(out)).sum().backward()
    dw = emb.weight.grad.detach().clone().to(F64)  # (num, dim): rows indexed by the input
    kfac.step()
    counts = torch.zeros(7, dtype=F64)
    for i in idx.reshape(-1).tolist():
        counts[i] += 1
    a = counts / idx.numel()
    gr = store["g"].to(F64).reshape(-1, 4) * idx.shape[0]
    g = gr.t() @ gr / gr.shape[0]
    if compute == "inverse":
        expected = (dw / (a[:, None] + damping)) @ torch.linalg.inv(g + damping * torch.eye(4, dtype=F64))
    else:
        dg, qg = torch.linalg.eigh(g)
        expected = ((dw @ qg) / (a[:, None] * dg.clamp(min=0)[None, :] + damping)) @ qg.t()
    tol = (idx.numel() + 7 + 4) * (condition(g, damping) + (1 + damping) / damping) * eps(torch.float32)
    assert rel_err(emb.weight.grad, expected) <= tol


# --- resume ---------------------------------------------------------------------------------
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 5 * 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, kfac: KFAC, steps: range) -> None:
    for s in steps:
        gen = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(6, 2, 5, 5, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()


def _kfac(model: nn.Module) -> KFAC:
    return KFAC(model, factor_update_steps=lambda s: 2, inv_update_steps=3, factor_decay=0.9,
                damping=0.01, kl_clip=1e-2)


def test_state_dict_resume_is_exact() -> None:
    torch.manual_seed(0)
    ref = Small()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    kfac_ref = _kfac(ref)
    _train(ref, opt_ref, kfac_ref, range(8))

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = _kfac(model)
    _train(model, opt, kfac, range(4))  # the last inverse update (step 3) is inside
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), kfac.state_dict()))
    assert saved[2]["steps"] == 4 and saved[2]["factors"]["fc"]["A"] is not None

    torch.manual_seed(123)  # a different fresh model: everything must come from the checkpoint
    resumed = Small()
    resumed.load_state_dict(saved[0])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved[1])
    kfac2 = _kfac(resumed)
    kfac2.load_state_dict(saved[2])
    _train(resumed, opt2, kfac2, range(4, 8))
    for (name, p), q in zip(ref.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_loading_state_of_another_model_is_refused() -> None:
    kfac = KFAC(nn.Linear(2, 2))
    with pytest.raises(UsageError, match="layers"):
        kfac.load_state_dict(KFAC(Small()).state_dict())


# --- arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"damping": -1.0}, "damping"),
    ({"factor_decay": 1.0}, "factor_decay"),
    ({"factor_update_steps": 0}, "factor_update_steps"),
    ({"lr": float("nan")}, "lr"),
    ({"compute": "svd"}, "'eigen', 'inverse'"),
    ({"placement": "random"}, "'balanced', 'round_robin'"),
    ({"grad_worker_fraction": 0.0}, "grad_worker_fraction"),
    ({"accumulation_steps": 0}, "accumulation_steps"),
    ({"local_inverse_below": -1}, "local_inverse_below"),
    ({"pipeline": "yes"}, "pipeline"),
    ({"skip_layers": [1]}, "skip_layers"),
    ({"grad_scaler": object()}, "grad_scaler"),
])
def test_invalid_arguments_raise_usage_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=re.escape(match) if "'" in match else match):
        KFAC(nn.Linear(2, 2), **kwargs)


def test_grad_worker_fractions_give_a_whole_divisor_of_the_world_size() -> None:
    assert grad_workers(1.0, 4) == 4 and grad_workers(0.25, 4) == 1 and grad_workers(0.5, 1) == 1
    assert grad_workers(0.5, 4) == 2 and grad_workers(0.1, 4) == 1  # KAISA: max(1, world * fraction)
    for fraction in (0.3, 0.75):  # 1.2 workers; 3 workers do not divide 4 ranks
        with pytest.raises(UsageError, match=r"valid fractions on 4 ranks: 1/4 = 0.25, 2/4 = 0.5, 4/4 = 1"):
            grad_workers(fraction, 4)


def test_a_bad_schedule_value_names_the_option_and_step() -> None:
    layer = nn.Linear(2, 2)
    kfac = KFAC(layer, damping=lambda step: -1.0 if step >= 1 else 0.1)
    for _ in range(2):
        layer(torch.randn(3, 2)).sum().backward()
        if kfac.steps == 1:
            with pytest.raises(UsageError, match=r"damping.*step 1"):
                kfac.step()
        else:
            kfac.step()
    with pytest.raises(UsageError, match="Module"):
        KFAC("model")  # type: ignore[arg-type]


# --- placement --------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["balanced", "round_robin"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_placement_covers_every_factor_exactly_once(strategy: str, world: int) -> None:
    dims = [5, 40, 40, 7, 300, 64, 2000, 12, 129, 129]
    keys = [FactorKey(i // 2, "AG"[i % 2], d, diagonal=(i == 3)) for i, d in enumerate(dims)]
    plan = assign(keys, world, strategy, local_below=10)
    assert set(plan) == set(keys) and len(plan) == len(keys)
    for key, owner in plan.items():
        local = world == 1 or key.diagonal or key.dim < 10
        assert (owner is None) == local
        assert owner is None or 0 <= owner < world


def test_dp_placement_gives_both_factors_of_a_layer_one_owner() -> None:
    keys = [FactorKey(i // 2, "AG"[i % 2], d, diagonal=(i == 0)) for i, d in enumerate([50, 3, 20, 30, 4, 4, 40, 2])]
    plan = assign_layers(keys, 2, "balanced", local_below=10)
    owner = {i: {plan[k] for k in keys if k.layer == i} for i in range(4)}
    assert all(len(o) == 1 for o in owner.values())
    # layer 0: diagonal A and G of 3 -> local; layer 2: 4 and 4 -> local
    assert owner[0] == {None} and owner[2] == {None}
    # layer 1 (20³ + 30³ = 35000) first to rank 0, layer 3 (40³ + 2³ = 64008) -> largest first: rank 0
    assert owner[3] == {0} and owner[1] == {1}


def test_balanced_placement_gives_each_factor_to_the_least_loaded_rank() -> None:
    keys = [FactorKey(i, "A", d) for i, d in enumerate([10, 20, 30, 40])]
    plan = assign(keys, 2, "balanced", local_below=0)
    # 40³ -> rank 0; 30³ -> rank 1; 20³ -> rank 1 (27000 < 64000); 10³ -> rank 1 (35000 < 64000)
    assert [plan[k] for k in keys] == [1, 1, 1, 0]
    assert loads(plan, 2) == [64000, 36000]
    assert [assign(keys, 2, "round_robin", 0)[k] for k in keys] == [0, 1, 0, 1]


# --- layer coverage -----------------------------------------------------------------------------
class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.lconv = LowRankConv(nn.Conv2d(1, 2, 3, padding=1), 1)
        self.low = LowRankLinear(8, 6, 2)
        self.blocks = LowRankLinear(8, 4, 1, blocks=2)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6 + 4 + 2 * 2 * 8 * 4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)  # (B, 4, 8)
        h, _ = self.attn(h, h, h)
        c = torch.cat([self.conv(h.unsqueeze(1)).flatten(1), self.lconv(h.unsqueeze(1)).flatten(1)], 1)
        z = torch.cat([self.norm(self.low(h.mean(1))), self.blocks(h.mean(1)), c], 1)
        return self.head(z)


def _zoo_step(skip: Any = ()) -> tuple[Zoo, KFAC, dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = Zoo()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kfac = KFAC(model, factor_update_steps=1, inv_update_steps=1, skip_layers=skip)
        grads = {}
        for _ in range(3):
            model.zero_grad()
            model(torch.randint(0, 11, (5, 4))).square().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            kfac.step()
    return model, kfac, grads, [str(w.message) for w in caught]


def test_every_layer_type_runs_and_unsupported_ones_warn_once_by_name() -> None:
    model, kfac, grads, messages = _zoo_step()
    names = [layer.name for layer in kfac.layers]
    assert names == ["emb", "conv", "lconv.v", "lconv.u", "low.v", "low.u", "blocks.v", "head"]
    assert sum("'attn'" in m for m in messages) == 1
    assert sum("'blocks'" in m and "LowRankLinear" in m for m in messages) == 1
    assert not any("norm" in m for m in messages)  # normalization layers: silently left out
    assert len(messages) == 2
    params = dict(model.named_parameters())
    for name in ("attn.in_proj_weight", "attn.out_proj.weight", "blocks.u_blocks", "norm.weight"):
        assert torch.equal(params[name].grad, grads[name]), name  # left to the base optimizer
    for name in ("emb.weight", "conv.weight", "lconv.v.weight", "lconv.u.bias", "low.u.weight", "head.bias"):
        assert not torch.equal(params[name].grad, grads[name]), name
        assert torch.isfinite(params[name].grad).all()


def test_skip_layers_by_name_and_regex_leave_layers_to_the_base_optimizer() -> None:
    model, kfac, grads, _ = _zoo_step(skip=("head", r"low\..*", "Embedding"))
    assert [layer.name for layer in kfac.layers] == ["conv", "lconv.v", "lconv.u", "blocks.v"]
    params = dict(model.named_parameters())
    for name in ("head.weight", "low.v.weight", "emb.weight"):
        assert torch.equal(params[name].grad, grads[name]), name


def test_a_layer_whose_hooks_never_fire_warns_once_and_is_left_alone() -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Unused()
    kfac = KFAC(model, factor_update_steps=1, inv_update_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            model.spare.weight.grad = torch.ones(2, 3)  # as if set by someone else
            kfac.step()
    assert [str(w.message).count("'spare'") for w in caught] == [1]
    assert torch.equal(model.spare.weight.grad, torch.ones(2, 3))


@pytest.mark.parametrize("guard", [False, True])
def test_running_average_updates_the_factor_in_place(guard: bool) -> None:
    from lowcomm.optim.kfac.factors import running_average

    gen = torch.Generator().manual_seed(3)
    old, new = torch.rand(6, 6, generator=gen), torch.rand(6, 6, generator=gen)
    expected = 0.9 * old.double() + 0.1 * new.double()
    out = running_average(old, new.clone(), 0.9, guard)
    assert out is old  # no factor-sized temporary survives
    assert rel_err(out, expected) <= 4 * eps(torch.float32)  # two roundings of a convex sum


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_statistic_leaves_the_factor_unchanged(bad: float) -> None:
    from lowcomm.optim.kfac.factors import running_average

    old = torch.rand(4, 4, generator=torch.Generator().manual_seed(4))
    before = old.clone()
    new = torch.ones(4, 4)
    new[1, 2] = bad
    assert torch.equal(running_average(old, new.clone(), 0.95, True), before)  # the statistic is consumed
    first = running_average(None, new, 0.95, True)  # the first statistic: the factor starts at 0
    assert torch.equal(first, torch.zeros(4, 4))

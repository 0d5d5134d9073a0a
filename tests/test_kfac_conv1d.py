"""K-FAC on ``nn.Conv1d``: closed forms, the Conv2d equivalence, and the layers it skips.

Why: MNIST-1D's default model ``cnn1d`` is three Conv1d layers and a Linear head; without
Conv1d, K-FAC preconditions only the head there. The convention is KAISA's Conv2d one on a
height-1 input: ``a`` the patch (``in·k``, +1 with a bias) divided by ``L`` output positions,
``g`` the output gradient times ``L``, rows (example, position); the reference patches are
built here by slicing the zero-padded input (dilation and stride by hand), not by ``unfold``.
The closed forms themselves (``(G+γI)⁻¹∇W(A+γI)⁻¹`` and the eigen form) and the condition
number are the ones of ``tests/test_kfac_core.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowcomm.models.small import CNN1d
from lowcomm.optim.kfac import KFAC
from test_kfac_core import condition, eigen_form, inverse_form
from tolerance import eps, rel_err

F64 = torch.float64


def _patches_1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """(B·L, C·k) patches by slicing the zero-padded input (rows: example, then position;
    columns: channel major, then kernel offset, as the ``(out, in, k)`` weight flattens)."""
    (k,), (s,), (d,) = conv.kernel_size, conv.stride, conv.dilation
    pad = conv.padding[0]
    assert isinstance(pad, int)
    xp = F.pad(x, (pad, pad))
    length = (xp.shape[2] - d * (k - 1) - 1) // s + 1
    cols = [xp[:, :, j * d: j * d + s * (length - 1) + 1: s] for j in range(k)]  # each (B, C, L)
    p = torch.stack(cols, dim=2)  # (B, C, k, L)
    return p.reshape(x.shape[0], -1, length).transpose(1, 2).reshape(-1, p.shape[1] * p.shape[2])


def reference_factors(conv: nn.Conv1d, x: torch.Tensor, gout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, G) in float64 (module docstring)."""
    x, gout = x.to(F64), gout.to(F64)
    positions = gout.shape[2]
    a = _patches_1d(x, conv)
    if conv.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=F64)], 1)
    a = a / positions
    g = gout.permute(0, 2, 1).reshape(-1, gout.shape[1]) * (gout.shape[0] * positions)
    return a.t() @ a / x.shape[0], g.t() @ g / g.shape[0]


def _grad(p: Any) -> torch.Tensor:
    assert isinstance(p, torch.Tensor) and p.grad is not None
    return p.grad


def _grad_matrix(conv: nn.Module) -> torch.Tensor:
    w = _grad(conv.weight)
    w = w.reshape(w.shape[0], -1)
    return torch.cat([w, _grad(conv.bias)[:, None]], 1) if conv.bias is not None else w


def _present(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t


def _capture(layer: nn.Module, store: dict[str, torch.Tensor]) -> None:
    def fwd(m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        store["x"] = inp[0].detach().clone()
        out.register_hook(lambda g: store.__setitem__("g", g.detach().clone()))

    layer.register_forward_hook(fwd)


def _kfac(model: nn.Module, compute: str, damping: float) -> KFAC:
    return KFAC(model, factor_update_steps=1, inv_update_steps=1, factor_decay=0.0, damping=damping,
                kl_clip=None, compute=compute)


def _loss(out: torch.Tensor, seed: int = 1) -> torch.Tensor:
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return ((out - target) ** 2).mean()


#: (in, out, kernel, stride, padding, dilation, bias), input length: cnn1d's first two layers,
#: a valid (unpadded) stride-1 conv, a dilated one without bias, and a kernel of 1
CASES: dict[str, tuple[tuple[int, int, int, int, int, int, bool], int]] = {
    "cnn1d_first": ((1, 6, 5, 2, 2, 1, True), 40),
    "cnn1d_second": ((4, 5, 3, 2, 1, 1, True), 20),
    "valid_stride1": ((3, 4, 3, 1, 0, 1, True), 9),
    "dilated_nobias": ((3, 4, 3, 1, 2, 2, False), 11),
    "pointwise": ((5, 3, 1, 1, 0, 1, True), 7),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("compute", ["inverse", "eigen"])
def test_preconditioned_conv1d_gradient_equals_the_closed_form(case: str, compute: str) -> None:
    (cin, cout, k, s, p, d, bias), length = CASES[case]
    torch.manual_seed(0)
    conv = nn.Conv1d(cin, cout, k, stride=s, padding=p, dilation=d, bias=bias)
    store: dict[str, torch.Tensor] = {}
    _capture(conv, store)
    damping = 0.05
    kfac = _kfac(conv, compute, damping)
    x = torch.randn(4, cin, length)
    _loss(conv(x)).backward()
    grad = _grad_matrix(conv).detach().clone().to(F64)
    kfac.step()
    a, g = reference_factors(conv, store["x"], store["g"])
    assert a.shape[0] == cin * k + bias and g.shape[0] == cout
    form, other = (inverse_form, eigen_form) if compute == "inverse" else (eigen_form, inverse_form)
    expected = form(grad, a, g, damping)
    # float32 vs a float64 reference; ops: a factor entry sums N = B·L rows, then the matmuls
    # of size a_dim and g_dim; cond: κ(F + γI) of each factor amplifies its relative error
    rows = store["g"].shape[0] * store["g"].shape[2]
    tol = (rows + a.shape[0] + g.shape[0]) * (condition(a, damping) + condition(g, damping)) * eps(torch.float32)
    err = rel_err(_grad_matrix(conv), expected)
    assert err <= tol, f"{err:.3g} > {tol:.3g}"
    # the test discriminates: the other form and the raw gradient are far outside the bound
    assert rel_err(other(grad, a, g, damping), expected) > 10 * tol
    assert rel_err(grad, expected) > 10 * tol


@pytest.mark.parametrize("compute", ["inverse", "eigen"])
def test_a_conv1d_is_preconditioned_as_the_conv2d_with_kernel_1_by_k(compute: str) -> None:
    torch.manual_seed(0)
    c1 = nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2)
    c2 = nn.Conv2d(3, 4, (1, 3), stride=(1, 2), padding=(0, 1), dilation=(1, 2))
    with torch.no_grad():
        c2.weight.copy_(c1.weight.unsqueeze(2))
        _present(c2.bias).copy_(_present(c1.bias))
    store: dict[str, torch.Tensor] = {}
    _capture(c1, store)
    x = torch.randn(5, 3, 13)
    k1, k2 = _kfac(c1, compute, 0.05), _kfac(c2, compute, 0.05)
    _loss(c1(x)).backward()
    _loss(c2(x.unsqueeze(2)).squeeze(2)).backward()
    raw = _grad_matrix(c1).detach().clone()
    # the two backward kernels may round differently: 1 eps per term of the B·L = 5·6 sum
    assert rel_err(_grad_matrix(c2), raw) <= 30 * eps(torch.float32)
    k1.step()
    k2.step()
    # both see the same input and output gradient, so the same factors: the preconditioner P
    # is one linear map, and P applied to gradients that agree to δ agrees to κ(P)·δ plus
    # the rounding of applying it (a_dim + g_dim terms), κ(P) = κ(A + γI)·κ(G + γI)
    a, g = reference_factors(c1, store["x"], store["g"])
    tol = (30 + a.shape[0] + g.shape[0]) * condition(a, 0.05) * condition(g, 0.05) * eps(torch.float32)
    assert rel_err(_grad_matrix(c2), _grad_matrix(c1)) <= tol
    assert rel_err(_grad_matrix(c1), raw) > 100 * tol  # something was preconditioned


def test_an_unbatched_conv1d_input_is_one_example() -> None:
    torch.manual_seed(0)
    conv = nn.Conv1d(2, 3, 3, padding=1)
    x = torch.randn(2, 9)
    layer = KFAC(conv, factor_update_steps=1, inv_update_steps=1).layers[0]
    assert torch.equal(layer.a_stat((x,)), layer.a_stat((x.unsqueeze(0),)))
    gout = torch.randn(3, 9)
    assert torch.equal(layer.g_stat(gout), layer.g_stat(gout.unsqueeze(0)))


UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "groups": (lambda: nn.Conv1d(4, 4, 3, padding=1, groups=2), "Conv1d with groups=2"),
    "depthwise": (lambda: nn.Conv1d(4, 4, 3, padding=1, groups=4), "Conv1d with groups=4"),
    "same": (lambda: nn.Conv1d(4, 4, 3, padding="same"), "string padding"),
    "circular": (lambda: nn.Conv1d(4, 4, 3, padding=1, padding_mode="circular"), "padding_mode"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_an_unsupported_conv1d_is_skipped_with_one_warning_naming_it(case: str) -> None:
    make, why = UNSUPPORTED[case]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Flatten(), nn.Linear(4 * 6, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kfac = KFAC(model, factor_update_steps=1, inv_update_steps=1)
        for _ in range(3):  # never a crash, and still one warning
            model.zero_grad()
            _loss(model(torch.randn(5, 4, 6))).backward()
            before = _grad(model[0].weight).clone()
            kfac.step()
            assert torch.equal(_grad(model[0].weight), before)  # left to the base optimizer
    messages = [str(w.message) for w in caught]
    assert [layer.name for layer in kfac.layers] == ["2"]
    assert len(messages) == 1 and "'0'" in messages[0] and why in messages[0], messages


def test_every_layer_of_cnn1d_is_preconditioned_without_a_warning() -> None:
    torch.manual_seed(0)
    model = CNN1d(input_dim=40, num_classes=10, channels=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kfac = KFAC(model, factor_update_steps=1, inv_update_steps=1)
        model.zero_grad()
        F.cross_entropy(model(torch.randn(6, 40)), torch.randint(0, 10, (6,))).backward()
        raw = {n: _grad(p).clone() for n, p in model.named_parameters()}
        kfac.step()
    assert not caught, [str(w.message) for w in caught]  # BatchNorm is left out silently
    assert [layer.name for layer in kfac.layers] == ["conv1", "conv2", "conv3", "fc"]
    params = dict(model.named_parameters())
    for name in ("conv1.weight", "conv2.bias", "conv3.weight", "fc.weight"):
        assert torch.isfinite(_grad(params[name])).all()
        assert not torch.equal(_grad(params[name]), raw[name]), name
    assert torch.equal(_grad(params["bn1.weight"]), raw["bn1.weight"])


def test_a_low_rank_conv1d_has_both_factors_preconditioned() -> None:
    from lowcomm.lowrank.layers import LowRankConv

    torch.manual_seed(0)
    model = LowRankConv(nn.Conv1d(3, 4, 3, stride=2, padding=1), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kfac = KFAC(model, factor_update_steps=1, inv_update_steps=1)
        _loss(model(torch.randn(5, 3, 9))).backward()
        raw = _grad(model.v.weight).clone()
        kfac.step()
    assert not caught, [str(w.message) for w in caught]
    assert [layer.name for layer in kfac.layers] == ["v", "u"]
    assert not torch.equal(_grad(model.v.weight), raw)

"""The federated algorithms against hand-computed formulas, on a linear softmax model.

A tiny reference loop plays a round the way the engine does (clients one after another with
one model, contributions summed, one ``server_update``); every expected value is computed
independently: the linear model's cross-entropy gradient is written out by hand
(``(softmax(xW^T + b) - onehot)^T x / n``) and the local training is replayed in float64
with the same batch order. Single process, tiny data: the whole file runs in a few seconds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch
from torch import Tensor, nn

from lowcomm.errors import UsageError
from lowcomm.fl.algorithms import (
    algorithm_class,
    algorithm_names,
    check_algorithm_spec,
    create_algorithm,
    load_algorithm_module,
    register_algorithm,
)
from lowcomm.fl.algorithms.fedavg import FedAvg
from lowcomm.fl.api import Algorithm, ClientContext, LocalTraining
from lowcomm.fl.local import GradientCorrection, flat_params, flat_view, load_flat_, local_sgd
from tolerance import rel_err, tolerance

D, C = 5, 3  # input features, classes
P = C * D + C  # flat parameters of nn.Linear(D, C): weight rows, then bias
NUM_CLIENTS = 6
SIZES = [7, 12, 3, 9, 12, 5]  # unequal n_i
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fl_fedavgm.py"


def _clients() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, D, generator=g), torch.randint(0, C, (n,), generator=g)) for n in SIZES]


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(D, C)


def _gen(rnd: int, cid: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rnd + cid)


def play_round(alg: Algorithm, model: nn.Module, global_params: Tensor, sampled: list[int], rnd: int,
               train: LocalTraining, states: dict[int, dict[str, Tensor]]) -> Tensor:
    """One round as the engine plays it: each client from the global weights, sums, server step."""
    data = _clients()
    server = {k: v.clone() for k, v in alg.server_broadcast().items()}
    assert {k: v.numel() for k, v in server.items()} == alg.server_broadcast_spec(P)
    spec = alg.contribution_spec(P)
    sums: dict[str, Tensor] = {k: torch.zeros(n) for k, n in spec.items()}
    for cid in sampled:
        load_flat_(model, global_params)
        state = states.setdefault(cid, {k: torch.zeros(n) for k, n in alg.client_state_spec(P).items()})
        x, y = data[cid]
        ctx = ClientContext(client_id=cid, round=rnd, model=model, x=x, y=y, global_params=global_params,
                            server=server, state=state, train=train, generator=_gen(rnd, cid))
        contribution = alg.client_update(ctx)
        assert {k: v.numel() for k, v in contribution.items()} == spec
        for k, v in contribution.items():
            sums[k] += v.reshape(-1)
    return alg.server_update(global_params, sums, round=rnd, num_sampled=len(sampled), num_clients=NUM_CLIENTS)


def play(spec: str, rounds: int, train: LocalTraining, sampled: list[int] | None = None,
         alg: Algorithm | None = None) -> tuple[Algorithm, Tensor, dict[int, dict[str, Tensor]]]:
    alg = alg or create_algorithm(spec)
    model = _model()
    alg.setup(P, torch.device("cpu"))
    w = flat_params(model)
    states: dict[int, dict[str, Tensor]] = {}
    for rnd in range(rounds):
        w = play_round(alg, model, w, sampled or list(range(NUM_CLIENTS)), rnd, train, states)
    return alg, w, states


# --- the independent reference: the linear model's gradient by hand, SGD replayed in float64 ----
def ce_grad(w: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Gradient of the mean cross-entropy of softmax(x W^T + b) in the flat (W, b) layout."""
    weight, bias = w[: C * D].reshape(C, D), w[C * D:]
    p = torch.softmax(x @ weight.T + bias, dim=1) - nn.functional.one_hot(y, C).to(w.dtype)
    return torch.cat([(p.T @ x).reshape(-1) / len(y), p.mean(0)])


def ref_sgd(w0: Tensor, cid: int, rnd: int, train: LocalTraining,
            extra: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, int]:
    """The client's model after local SGD (float64), same batch order; and its step count."""
    x, y = (t.double() if t.is_floating_point() else t for t in _clients()[cid])
    w, gen, steps, buf = w0.double().clone(), _gen(rnd, cid), 0, None
    for _ in range(train.local_epochs):
        perm = torch.randperm(len(y), generator=gen)
        for s in range(0, len(y), train.batch_size):
            idx = perm[s:s + train.batch_size]
            d = ce_grad(w, x[idx], y[idx]) + train.weight_decay * w + (extra(w) if extra else 0.0)
            buf = d if buf is None or train.momentum == 0 else train.momentum * buf + d
            w = w - train.lr * buf
            steps += 1
    return w, steps


def tsum(tensors: Iterable[Tensor]) -> Tensor:
    return torch.stack(list(tensors)).sum(0)


def close(actual: Tensor, expected: Tensor, ops: float) -> None:
    err, tol = rel_err(actual, expected), tolerance(torch.float32, ops=ops)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


TRAIN = LocalTraining(lr=0.1, local_epochs=2, batch_size=4)
FULL_BATCH = LocalTraining(lr=0.1, local_epochs=1, batch_size=64)
#: per SGD step: a D-term dot product, softmax (exp + C-term sum), the update; x a few steps
OPS = 40 * (D + C + 4)


def w0() -> Tensor:
    return flat_params(_model())


# --- local training and the flat helpers ---------------------------------------------------------
def test_flat_helpers_follow_parameter_order_and_round_trip() -> None:
    model = _model()
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat_params(model), expected)
    load_flat_(model, torch.arange(P, dtype=torch.float32))
    assert torch.equal(list(model.parameters())[1].detach(), torch.arange(C * D, P, dtype=torch.float32))
    assert torch.equal(flat_view(model), torch.arange(P, dtype=torch.float32))
    with pytest.raises(UsageError, match=f"model has {P} parameters"):
        load_flat_(model, torch.zeros(P + 1))


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.01)])
def test_local_sgd_is_torch_sgd_with_the_generators_batch_order(momentum: float, weight_decay: float) -> None:
    train = LocalTraining(lr=0.05, local_epochs=3, batch_size=5, momentum=momentum, weight_decay=weight_decay)
    x, y = _clients()[1]  # 12 samples: batches 5, 5, 2 (the partial batch is kept)
    model, twin = _model(), _model()
    ctx = ClientContext(client_id=1, round=0, model=model, x=x, y=y, global_params=flat_params(model),
                        server={}, state={}, train=train, generator=_gen(0, 1))
    assert local_sgd(ctx) == 9
    opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    gen = _gen(0, 1)
    for _ in range(3):
        perm = torch.randperm(12, generator=gen)
        for s in range(0, 12, 5):
            opt.zero_grad()
            nn.functional.cross_entropy(twin(x[perm[s:s + 5]]), y[perm[s:s + 5]]).backward()
            opt.step()
    close(flat_params(model), flat_params(twin), ops=9 * 4)


def test_local_sgd_survives_zero_grad_and_empty_clients() -> None:
    model = _model()
    x, y = _clients()[0]
    model.zero_grad(set_to_none=True)  # drops the flat gradient views; local_sgd re-attaches them
    ctx = ClientContext(client_id=0, round=0, model=model, x=x, y=y, global_params=w0(), server={}, state={},
                        train=FULL_BATCH, generator=_gen(0, 0))
    local_sgd(ctx)
    expected, _ = ref_sgd(w0(), 0, 0, FULL_BATCH)
    close(flat_params(model), expected, OPS)
    empty = ClientContext(client_id=0, round=0, model=model, x=x[:0], y=y[:0], global_params=w0(), server={},
                          state={}, train=FULL_BATCH, generator=_gen(0, 0))
    assert local_sgd(empty) == 0


def test_a_client_with_dropout_trains_alike_whatever_ran_before_it() -> None:
    x, y = _clients()[1]
    results = []
    for prior_seed in (0, 12345):  # another worker, other clients before: another global RNG state
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(D, 8), nn.Dropout(0.5), nn.Linear(8, C))
        torch.manual_seed(prior_seed)
        ctx = ClientContext(client_id=1, round=0, model=model, x=x, y=y, global_params=flat_params(model),
                            server={}, state={}, train=TRAIN, generator=_gen(0, 1))
        local_sgd(ctx)
        results.append(flat_params(model))
    assert torch.equal(results[0], results[1])


def test_gradient_correction_adds_offset_and_proximal_term() -> None:
    model = _model()
    anchor, offset = w0() + 0.5, torch.linspace(-1, 1, P)
    x, y = _clients()[3]
    ctx = ClientContext(client_id=3, round=0, model=model, x=x, y=y, global_params=w0(), server={}, state={},
                        train=TRAIN, generator=_gen(0, 3))
    local_sgd(ctx, GradientCorrection(offset=offset, mu=0.3, anchor=anchor))
    expected, _ = ref_sgd(w0(), 3, 0, TRAIN, lambda w: offset.double() + 0.3 * (w - anchor.double()))
    close(flat_params(model), expected, OPS)


# --- the algorithms, each against its paper's formula --------------------------------------------
def test_fedavg_with_one_full_batch_step_is_a_sample_weighted_gradient_step() -> None:
    _, w, _ = play("fedavg", 1, FULL_BATCH)
    x0 = w0().double()
    grads = [n * ce_grad(x0, x.double(), y) for n, (x, y) in zip(SIZES, _clients())]
    close(w, x0 - 0.1 * torch.stack(grads).sum(0) / sum(SIZES), OPS)


def test_fedavg_is_flowers_sample_weighted_average_of_client_models() -> None:
    _, w, _ = play("fedavg", 1, TRAIN, sampled=[0, 2, 5])
    local = [(SIZES[c], ref_sgd(w0(), c, 0, TRAIN)[0]) for c in (0, 2, 5)]
    close(w, tsum(n * wc for n, wc in local) / sum(n for n, _ in local), OPS)


def test_fedavg_server_lr_scales_the_averaged_change() -> None:
    _, w1, _ = play("fedavg", 1, TRAIN)
    _, w2, _ = play("fedavg:server_lr=2.5", 1, TRAIN)
    close(w2 - w0(), 2.5 * (w1 - w0()), OPS)


def test_fedprox_with_mu_zero_is_fedavg_and_with_mu_adds_the_proximal_gradient() -> None:
    _, avg, _ = play("fedavg", 2, TRAIN)
    _, prox0, _ = play("fedprox:mu=0", 2, TRAIN)
    assert torch.equal(avg, prox0)
    _, w, _ = play("fedprox:mu=0.5", 1, TRAIN)
    x0 = w0().double()
    local = [ref_sgd(x0, c, 0, TRAIN, lambda v: 0.5 * (v - x0))[0] for c in range(NUM_CLIENTS)]
    close(w, tsum(n * wc for n, wc in zip(SIZES, local)) / sum(SIZES), OPS)


def test_fednova_with_equal_local_steps_is_fedavg() -> None:
    train = LocalTraining(lr=0.1, local_epochs=2, batch_size=12)  # every client: 1 batch/epoch
    _, avg, _ = play("fedavg", 1, train)
    _, nova, _ = play("fednova", 1, train)
    close(nova, avg, OPS)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_fednova_normalizes_each_client_by_its_local_steps(momentum: float) -> None:
    train = LocalTraining(lr=0.1, local_epochs=2, batch_size=4, momentum=momentum)  # tau_i from 2 to 6
    _, w, _ = play("fednova", 1, train)
    x0, p = w0().double(), torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    runs = [ref_sgd(x0, c, 0, train) for c in range(NUM_CLIENTS)]
    # ||a_i||_1: tau without momentum; with it, sum_{k=1..tau} (1 - rho^k) / (1 - rho)
    a = [sum((1 - momentum ** k) / (1 - momentum) for k in range(1, t + 1)) for _, t in runs]
    assert len({t for _, t in runs}) > 1
    tau_eff = sum(pi * ai for pi, ai in zip(p.tolist(), a))
    close(w, x0 + tau_eff * tsum(pi * (wc - x0) / ai for pi, (wc, _), ai in zip(p.tolist(), runs, a)), OPS)


def test_scaffold_control_variates_follow_option_two() -> None:
    sampled = [0, 1, 4]
    alg, w1, states = play("scaffold:server_lr=1.0", 1, TRAIN, sampled=sampled)
    x0 = w0().double()
    runs = {c: ref_sgd(x0, c, 0, TRAIN) for c in sampled}
    ci = {c: (x0 - y) / (k * TRAIN.lr) for c, (y, k) in runs.items()}  # c_i+ = c_i - c + (x - y)/(K lr), c = c_i = 0
    for c in sampled:
        close(states[c]["c"], ci[c], OPS)
    close(alg.server_broadcast()["c"], tsum(ci.values()) / NUM_CLIENTS, OPS)
    close(w1, x0 + tsum(y - x0 for y, _ in runs.values()) / len(sampled), OPS)
    # round 2: local gradients are corrected by c - c_i; a client seen before and a new one
    c_server = tsum(ci.values()) / NUM_CLIENTS
    model, states2 = _model(), {c: {"c": states[c]["c"].clone()} for c in sampled}
    w2 = play_round(alg, model, w1, [1, 3], 1, TRAIN, states2)
    x1 = w1.double()
    y1, k1 = ref_sgd(x1, 1, 1, TRAIN, lambda v: c_server - ci[1])
    y3, _ = ref_sgd(x1, 3, 1, TRAIN, lambda v: c_server)
    close(w2, x1 + ((y1 - x1) + (y3 - x1)) / 2, OPS)
    close(states2[1]["c"], ci[1] - c_server + (x1 - y1) / (k1 * TRAIN.lr), OPS)


def test_feddyn_updates_client_gradients_and_server_h_by_the_paper() -> None:
    alpha, sampled = 0.1, [0, 2, 3]
    alg, w1, states = play(f"feddyn:alpha={alpha}", 1, TRAIN, sampled=sampled)
    x0 = w0().double()
    theta = {c: ref_sgd(x0, c, 0, TRAIN, lambda v: alpha * (v - x0))[0] for c in sampled}
    for c in sampled:
        close(states[c]["grad"], -alpha * (theta[c] - x0), OPS)
    h = -alpha * tsum(t - x0 for t in theta.values()) / NUM_CLIENTS
    close(alg.state_dict()["h"], h, OPS)
    close(w1, tsum(theta.values()) / len(sampled) - h / alpha, OPS)
    # round 2, client 0 again: its objective now has the linear term -<g_0, theta>
    model = _model()
    w2 = play_round(alg, model, w1, [0], 1, TRAIN, states)
    x1, g0 = w1.double(), -alpha * (theta[0] - x0)
    t0, _ = ref_sgd(x1, 0, 1, TRAIN, lambda v: -g0 + alpha * (v - x1))
    h2 = h - alpha * (t0 - x1) / NUM_CLIENTS
    close(w2, t0 - h2 / alpha, OPS)


@pytest.mark.parametrize("server", ["adam", "yogi", "adagrad"])
def test_fedopt_server_steps_follow_reddi_et_al(server: str) -> None:
    lr, b1, b2, tau = 0.05, 0.8, 0.9, 0.01
    alg = create_algorithm(f"fedopt:server={server},server_lr={lr},beta1={b1},beta2={b2},tau={tau}")
    alias = create_algorithm(f"fed{server}:server_lr={lr},beta1={b1},beta2={b2},tau={tau}")
    for a in (alg, alias):
        a.setup(P, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(P, generator=g, dtype=torch.float64)
    m, v = torch.zeros(P, dtype=torch.float64), torch.full((P,), tau**2, dtype=torch.float64)
    got, got_alias = w.float(), w.float()
    for rnd in range(3):
        delta = torch.randn(P, generator=g, dtype=torch.float64)
        sums = {"delta": (20 * delta).float(), "weight": torch.tensor([20.0])}  # two clients, n = 8 + 12
        m = b1 * m + (1 - b1) * delta
        sq = delta**2
        v = {"adam": b2 * v + (1 - b2) * sq, "adagrad": v + sq, "yogi": v - (1 - b2) * sq * torch.sign(v - sq)}[server]
        w = w + lr * m / (v.sqrt() + tau)
        got = alg.server_update(got, sums, round=rnd, num_sampled=2, num_clients=NUM_CLIENTS)
        got_alias = alias.server_update(got_alias, sums, round=rnd, num_sampled=2, num_clients=NUM_CLIENTS)
    close(got, w, ops=30)
    assert torch.equal(got, got_alias)


# --- registry, options, state ---------------------------------------------------------------------
BUILTIN = ["fedadagrad", "fedadam", "fedavg", "feddyn", "fednova", "fedopt", "fedprox", "fedyogi", "scaffold"]


def test_every_builtin_name_is_registered_and_plays_rounds() -> None:
    assert set(BUILTIN) <= set(algorithm_names())
    for name in BUILTIN:
        alg, w, states = play(name, 2, TRAIN, sampled=[1, 2, 5])
        assert torch.isfinite(w).all() and not torch.equal(w, w0()), name
        assert alg.stateful == bool(alg.client_state_spec(P)) == bool(states[1]), name
        assert alg.describe()["algorithm"] == name


@pytest.mark.parametrize("spec, message", [
    ("fedprx", "unknown algorithm 'fedprx' (did you mean 'fedprox'?); valid: fedadagrad, fedadam, fedavg"),
    ("", "empty algorithm name"),
    ("fedprox:lr=1", "unknown option 'lr' for algorithm 'fedprox'; valid: server_lr, mu"),
    ("fedprox:mu=-0.1", "algorithm 'fedprox': mu must be >= 0"),
    ("fedprox:mu=nan", "must be a finite number"),
    ("feddyn:alpha=0", "algorithm 'feddyn': alpha must be > 0"),
    ("fedopt:server=sgd", "valid: adam, yogi, adagrad"),
    ("fedopt:beta1=1", "beta1 must be in [0, 1)"),
    ("fedadam:server=yogi", "unknown option 'server' for algorithm 'fedadam'; valid: server_lr, beta1"),
    ("fedavg:server_lr=0", "server_lr must be > 0"),
    ("scaffold:server_lr=x", "must be a float"),
    ("fedavg:server_lr", "must look like key=value"),
])
def test_bad_specs_are_refused_naming_what_is_valid(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        check_algorithm_spec(spec)
    with pytest.raises(UsageError, match=re.escape(message)):
        create_algorithm(spec)


def test_local_training_refuses_bad_values() -> None:
    cases: list[tuple[dict[str, Any], str]] = [({"lr": 0.0}, "lr must be"), ({"local_epochs": 0}, "local_epochs"),
                                               ({"batch_size": 1.5}, "batch_size"), ({"momentum": 1.0}, "momentum")]
    for kwargs, message in cases:
        with pytest.raises(UsageError, match=message):
            LocalTraining(**{"lr": 0.1, "local_epochs": 1, "batch_size": 4, **kwargs})


@pytest.mark.parametrize("spec", ["fedadam", "fedyogi:tau=0.01", "scaffold", "feddyn:alpha=0.05"])
def test_state_dict_round_trip_continues_exactly(spec: str) -> None:
    states: dict[int, dict[str, Tensor]] = {}
    alg, w, states = play(spec, 2, TRAIN, sampled=[0, 3])
    saved: dict[str, Any] = {k: v.clone() for k, v in alg.state_dict().items()}
    assert saved, "server state must be saved"
    saved_states = {c: {k: v.clone() for k, v in s.items()} for c, s in states.items()}
    resumed = create_algorithm(spec)
    resumed.setup(P, torch.device("cpu"))
    resumed.load_state_dict(saved)
    a = play_round(alg, _model(), w, [0, 4], 2, TRAIN, states)
    b = play_round(resumed, _model(), w, [0, 4], 2, TRAIN, saved_states)
    assert torch.equal(a, b)
    for k, v in alg.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k])


# --- the user API: an algorithm written outside lowcomm ------------------------------------------
def test_the_worked_example_registers_and_applies_server_momentum() -> None:
    load_algorithm_module(str(EXAMPLE))
    load_algorithm_module(str(EXAMPLE))  # a second import (another worker start) is harmless
    assert "fedavgm" in algorithm_names()
    _, avg1, _ = play("fedavg", 1, TRAIN)
    alg, w2, _ = play("fedavgm:momentum=0.5,server_lr=1.0", 2, TRAIN)
    # round 1 is FedAvg (v = Delta_1); round 2 steps by Delta_2 + 0.5 Delta_1
    ref = create_algorithm("fedavgm:momentum=0")
    ref.setup(P, torch.device("cpu"))
    w2_plain = play_round(ref, _model(), avg1, list(range(NUM_CLIENTS)), 1, TRAIN, {})
    close(w2, w2_plain + 0.5 * (avg1 - w0()), OPS)
    with pytest.raises(UsageError, match="momentum must be in"):
        create_algorithm("fedavgm:momentum=1.5")
    with pytest.raises(UsageError, match="no such file"):
        load_algorithm_module(str(EXAMPLE.with_name("missing.py")))
    with pytest.raises(UsageError, match="'no_such_pkg.algos' not found"):
        load_algorithm_module("no_such_pkg.algos")


def test_a_taken_name_is_refused_and_a_non_algorithm_is_not_registered() -> None:
    class Impostor(FedAvg):
        """Same name as a built-in."""

        name = "fedavg"

    with pytest.raises(UsageError, match="'fedavg' is taken by lowcomm.fl.algorithms.fedavg.FedAvg"):
        register_algorithm(Impostor)
    assert algorithm_class("fedavg") is FedAvg
    with pytest.raises(TypeError):
        register_algorithm(dict)  # type: ignore[type-var]
    assert math.isfinite(FedAvg().options.server_lr)

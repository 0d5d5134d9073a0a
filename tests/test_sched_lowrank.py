"""Low-rank payloads (ACP-SGD, PowerSGD) carried in the engine's fusion groups.

The reference is a central re-computation of each method from every rank's local gradients
(per-rank error-feedback memory, the same P/Q alternation, warm start and seeded initial
factors), written independently of the engine here in the test, in float64.

Tolerances (see ``tests/tolerance.py``): the engine runs in float32, the reference in float64
(its own round-off is 1e-9 of the engine's), so the difference is the engine's float32
round-off. The step that amplifies it is the QR of an n x r factor: backward stable with a
relative backward error that grows like sqrt(n*r)*u in practice (Higham §3.6, §19.3), and
the Q factor's forward error is that times the factor's condition number kappa (Sun 1991).
Each compressed step orthogonalizes once per matrix and carries its error forward (warm
start, error-feedback memory), so the errors add over the compressed steps::

    ops = compressed steps * sqrt(n_max * r),  cond = largest kappa the reference met

(n_max = 64 rows: the 12 x 64 layer's Q factor). The engine's batched QR differs from exact
arithmetic by exactly this kind of round-off (measured: up to 139 eps at kappa 116, against
a bound of about 6,500 eps = 8e-4), while a wrong factor, memory or scale differs by more
than 2e-2 relative (checked below: the comparison is not vacuous).
"""

from __future__ import annotations

import copy
import io
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (once here, not in every forked rank)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.compress.lowrank import factor_seed, seeded_normal, should_compress
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.testing.distributed import run_distributed
from tolerance import max_rel_err, rel_err, tolerance

methods.names()
LR = 0.1
RANK = 2


def lr_model() -> nn.Module:
    """Compressible matrices at rank 2 (a conv viewed as 8x10, 12x64, two 12x12 of the same
    shape), a LayerNorm (1-D) and a 3x12 head too small to compress."""
    return nn.Sequential(
        nn.Conv1d(2, 8, 5, padding=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.LayerNorm(12),
        nn.Linear(12, 3),
    )


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 2, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def _ctx() -> MethodContext:
    return MethodContext(rank=dist.get_rank(), world_size=dist.get_world_size())


# --- the central reference --------------------------------------------------------------------
QR_ROWS = 64  # rows of the tallest factor orthogonalized in lr_model (the 12 x 64 layer's Q)


@dataclass
class Reference:
    """Averaged gradient per step (float64) and the worst-conditioned factor orthogonalized."""

    grads: list[dict[str, torch.Tensor]]
    cond: float


def lowrank_tolerance(ref: Reference, compressed_steps: int) -> float:
    """Bound on the float32 engine's relative error; the error model is in the module doc."""
    return tolerance(torch.float32, ops=max(1, compressed_steps) * math.sqrt(QR_ROWS * RANK), cond=max(1.0, ref.cond))


def central(kind: str, local: list[list[dict[str, torch.Tensor]]], names: list[str], *, start: int, rank: int, seed: int = 0,
            clip: float = 1.0) -> Reference:
    """Averaged gradient per step from ``local[r][t][name]`` (every rank's own gradient),
    computed in float64 from the float32 gradients and the same float32 seeded factors. Each
    gradient is first clipped to the norm ``clip / sqrt(world)`` (DGC's local clipping, the
    codecs' default ``clip=1.0``; on warm-up steps too)."""
    f64 = torch.float64
    world, steps = len(local), len(local[0])
    bound = clip / math.sqrt(world)

    def clipped(g: torch.Tensor) -> torch.Tensor:
        norm = float(g.norm())
        return g * min(1.0, bound / (norm + 1e-6)) if clip > 0 else g

    index = {n: i for i, n in enumerate(names)}
    mem: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    P: dict[str, torch.Tensor] = {}
    Q: dict[str, torch.Tensor] = {}
    conds = [1.0]

    def orth(x: torch.Tensor) -> torch.Tensor:
        cond = float(torch.linalg.cond(x))
        if math.isfinite(cond):  # an all-zero factor has no condition (and no round-off)
            conds.append(cond)
        return torch.linalg.qr(x, mode="reduced")[0]

    def init(shape: tuple[int, int], salt: int, name: str) -> torch.Tensor:
        return seeded_normal(shape, factor_seed(seed, index[name], salt), dtype=torch.float32, device=torch.device("cpu")).to(f64)

    out = []
    for t in range(steps):
        avg = {}
        for name in names:
            gs = [clipped(local[r][t][name].to(f64)) for r in range(world)]
            shape = gs[0].shape
            if t < start or not should_compress(shape, rank, 2.0):
                avg[name] = sum(gs) / world
                continue
            n, m = shape[0], math.prod(shape[1:])
            r_ = min(rank, n, m)
            Ms = [g.reshape(n, m) + mem[r].get(name, torch.zeros(n, m, dtype=f64)) for r, g in enumerate(gs)]
            if kind == "powersgd":
                q = Q.get(name, init((m, r_), 0, name))
                p_hat = orth(sum(M @ q for M in Ms))
                q_sum = sum(M.T @ p_hat for M in Ms)
                approx = p_hat @ q_sum.T / world
                for r in range(world):
                    mem[r][name] = Ms[r] - approx
                Q[name] = q_sum
            elif (t - start) % 2 == 0:  # ACP-SGD P-step
                q = orth(Q.get(name, init((m, r_), 0, name)))
                ps = [M @ q for M in Ms]
                for r in range(world):
                    mem[r][name] = Ms[r] - ps[r] @ q.T
                P[name] = sum(ps)
                approx = P[name] @ q.T / world
            else:  # ACP-SGD Q-step
                p = orth(P.get(name, init((n, r_), 1, name)))
                qs = [M.T @ p for M in Ms]
                for r in range(world):
                    mem[r][name] = Ms[r] - p @ qs[r].T
                Q[name] = sum(qs)
                approx = p @ Q[name].T / world
            avg[name] = approx.reshape(shape)
        out.append(avg)
    return Reference(out, max(conds))


def _run(spec: str, steps: int) -> dict[str, Any]:
    """Train with the engine (plain SGD); record each step's params, local and engine grads."""
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)  # differs per rank: the engine broadcasts rank 0's weights
    model = lr_model()
    shadow = copy.deepcopy(model)
    method = methods.create(spec)
    wrapped = method.wrap(model, _ctx())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rec: dict[str, Any] = {"before": [], "local": [], "engine": [], "after": []}
    for step in range(steps):
        x, y = batch(rank, step)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x), y).backward()
        rec["local"].append({n: p.grad.detach().clone() for n, p in shadow.named_parameters()})
        rec["before"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        rec["engine"].append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        method.optimizer_step(opt)
        method.flush()
        rec["after"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    rec["names"] = [n for n, _ in model.named_parameters()]
    rec["describe"] = method.describe()
    return rec


REF_SPECS = {
    "wfbp-acpsgd": ("acpsgd", "wfbp:compress=acpsgd,rank=2,start_iter=2"),
    # α = 1 s: per-layer for 2 profiled steps, then one group holding every matrix (incl. the
    # two same-shape ones) — the state must survive the regrouping
    "mgwfbp-acpsgd": ("acpsgd", "mgwfbp:compress=acpsgd,rank=2,start_iter=1,alpha=1.0,beta=0.0,profile_iters=1"),
    "dear-acpsgd": ("acpsgd", "dear:compress=acpsgd,rank=2,start_iter=1,threshold_mb=0.002"),
    "wfbp-powersgd": ("powersgd", "wfbp:compress=powersgd,rank=2,start_iter=1"),
}


@pytest.mark.parametrize("case", list(REF_SPECS))
def test_aggregated_gradient_equals_central_lowrank_reference_on_two_ranks(case: str) -> None:
    kind, spec = REF_SPECS[case]
    steps = 6
    recs = run_distributed(_run, 2, spec, steps, timeout=90)
    names = recs[0]["names"]
    start = int(spec.split("start_iter=")[1].split(",")[0])
    ref = central(kind, [r["local"] for r in recs], names, start=start, rank=RANK)
    tol = lowrank_tolerance(ref, steps - start)
    compressed_steps = 0
    for t in range(steps):
        for n in names:
            for r in recs:
                # the update is lr * gradient, far smaller than the weights: same bound
                expected_after = r["before"][t][n].double() - LR * ref.grads[t][n]
                assert rel_err(r["after"][t][n], expected_after) <= tol, (case, t, n)
                if n in r["engine"][t]:  # all-reduce schedules expose the gradient in p.grad
                    err = rel_err(r["engine"][t][n], ref.grads[t][n])
                    assert err <= tol, (case, t, n, err, tol)
            mean = sum(r["local"][t][n].double() for r in recs) / 2
            if t >= start and rel_err(ref.grads[t][n], mean) > 10 * tol:
                compressed_steps += 1  # the reference really is a low-rank approximation here
    assert compressed_steps >= steps - start  # the comparison is not vacuous
    if case.startswith("mgwfbp"):
        assert recs[0]["describe"]["groups"] == 1


# --- bytes ------------------------------------------------------------------------------------
def _bytes_per_step(spec: str, steps: int) -> list[dict[str, dict[str, int]]]:
    model = lr_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, _ctx())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        x, y = batch(dist.get_rank(), step)
        before = copy.deepcopy(accounting.ledger().as_dict()["by_tag"])
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
        method.flush()
        after = accounting.ledger().as_dict()["by_tag"]
        delta = {}
        for tag, c in after.items():
            b = before.get(tag, {"calls": 0, "wire_bytes": 0, "payload_bytes": 0})
            if c["calls"] != b["calls"]:
                delta[tag] = {k: c[k] - b[k] for k in ("calls", "wire_bytes", "payload_bytes")}
        out.append(delta)
    return out


def _layer_messages(p_step: bool) -> list[tuple[int, bool]]:
    """Analytic (elements, has a compressed matrix) of each layer's message."""
    out = []
    for mod in lr_model().modules():
        own = list(mod.parameters(recurse=False))
        if not own:
            continue
        k, comp = 0, False
        for p in own:
            if should_compress(p.shape, RANK, 2.0):
                n, m = p.shape[0], math.prod(p.shape[1:])
                k += (n if p_step else m) * min(RANK, n, m)
                comp = True
            else:
                k += p.numel()
        out.append((k, comp))
    return out


@pytest.mark.parametrize("name", ["wfbp", "dear"])
def test_counted_bytes_equal_the_analytic_low_rank_formula(name: str) -> None:
    spec = f"{name}:compress=acpsgd,rank={RANK},start_iter=1" + (",threshold_mb=0" if name == "dear" else "")
    world, steps = 2, 4
    per_rank = run_distributed(_bytes_per_step, world, spec, steps, timeout=60)
    for deltas in per_rank:
        for t in range(1, steps):
            p_step = (t - 1) % 2 == 0
            layers = _layer_messages(p_step)
            n_comp = sum(c for _, c in layers)
            assert 0 < n_comp < len(layers)  # the model has both kinds of layer
            which = "P" if p_step else "Q"
            got = deltas[t]
            if name == "wfbp":  # one all-reduce per group (= layer) and step
                assert got == {
                    f"wfbp.acpsgd.{which}": {
                        "calls": n_comp,
                        "payload_bytes": sum(4 * k for k, c in layers if c),
                        "wire_bytes": sum(2 * (world - 1) * 4 * k // world for k, c in layers if c),
                    },
                    "wfbp.acpsgd.unc": {
                        "calls": len(layers) - n_comp,
                        "payload_bytes": sum(4 * k for k, c in layers if not c),
                        "wire_bytes": sum(2 * (world - 1) * 4 * k // world for k, c in layers if not c),
                    },
                }, got
            else:  # reduce-scatter in backward + all-gather before the next forward, padded
                padded = [-(-k // world) * world for k, _ in layers]
                # plus one 4-byte flag per step so every rank agrees on skipping a non-finite step
                assert got.pop("dear.finite") == {"calls": 1, "payload_bytes": 4,
                                                  "wire_bytes": 2 * (world - 1) * 4 // world}, got
                rs = {k: v for k, v in got.items() if k.endswith(".rs")}
                ag = {k: v for k, v in got.items() if k.endswith(".ag")}
                assert set(rs) == {f"dear.acpsgd.{which}.rs", "dear.acpsgd.unc.rs"}, got
                assert set(rs) | set(ag) == set(got), got
                assert sum(v["calls"] for v in rs.values()) == len(layers)
                assert sum(v["calls"] for v in ag.values()) == len(layers)
                assert sum(v["wire_bytes"] for v in rs.values()) == sum((world - 1) * 4 * k // world for k in padded)
                assert sum(v["wire_bytes"] for v in ag.values()) == sum((world - 1) * 4 * (k // world) for k in padded)


# --- checkpoints ------------------------------------------------------------------------------
def _roundtrip(spec: str, drop_lowrank: bool) -> float:
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = lr_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, _ctx())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def step(w: nn.Module, m: Any, o: torch.optim.Optimizer, t: int) -> None:
        x, y = batch(rank, t)
        o.zero_grad()
        F.cross_entropy(w(x), y).backward()
        m.finish_sync()
        m.optimizer_step(o)

    for t in range(5):  # start_iter=1: 4 compressed steps, ends after a Q-step
        step(wrapped, method, opt, t)
    method.flush()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "method": method.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    if drop_lowrank:
        ckpt["method"].pop("codec")
    model2 = lr_model()
    model2.load_state_dict(ckpt["model"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=LR, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    method2 = methods.create(spec)
    method2.load_state_dict(ckpt["method"])
    wrapped2 = method2.wrap(model2, _ctx())
    for t in range(5, 7):
        step(wrapped, method, opt, t)
        step(wrapped2, method2, opt2, t)
    method.flush()
    method2.flush()
    return max_rel_err(model2.parameters(), model.parameters())


@pytest.mark.parametrize("name", ["wfbp", "dear"])
def test_state_dict_roundtrip_gives_identical_next_updates(name: str) -> None:
    spec = f"{name}:compress=acpsgd,rank={RANK},start_iter=1"
    assert max(run_distributed(_roundtrip, 2, spec, False, timeout=60)) == 0.0
    # without the low-rank state (memory, factors, step) the next updates differ
    assert min(run_distributed(_roundtrip, 2, spec, True, timeout=60)) > 1e-4


# --- training ---------------------------------------------------------------------------------
def _train(spec: str, steps: int) -> tuple[float, float]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 3, generator=g)
    x = torch.randn(64, 2, 8, generator=g)[rank * 32 : (rank + 1) * 32]
    y = (x.flatten(1) @ teacher).argmax(1)
    torch.manual_seed(1)
    model = lr_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, _ctx())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        method.finish_sync()
        method.optimizer_step(opt)
        losses.append(float(loss))
    method.flush()
    return sum(losses[:3]) / 3, sum(losses[-3:]) / 3


@pytest.mark.parametrize("spec", ["wfbp:compress=acpsgd,rank=2,start_iter=2", "dear:compress=acpsgd,rank=2,start_iter=2"])
def test_two_rank_training_with_acpsgd_decreases_loss(spec: str) -> None:
    for first, last in run_distributed(_train, 2, spec, 40, timeout=60):
        assert last < 0.6 * first, (first, last)


# --- same numbers as the DDP comm hooks ---------------------------------------------------------
def _vs_hook(spec: str, hook: str, steps: int) -> dict[str, Any]:
    """Engine with a low-rank payload vs DDP with the matching comm hook (same seeds/options).

    Also records this rank's local gradients (a shadow model at the DDP side's weights, which
    are complete at every step, unlike DeAR's before its flush), from which the float64
    reference finds the condition number of the factors both sides met."""
    import lowcomm.hooks

    rank = dist.get_rank()
    torch.manual_seed(11)
    base = lr_model()
    ref, eng, shadow = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref)
    lowcomm.hooks.register(ddp, hook, rank=RANK, start_iter=1)
    method = methods.create(spec)
    wrapped = method.wrap(eng, _ctx())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    opt_eng = torch.optim.SGD(eng.parameters(), lr=LR, momentum=0.9)
    local = []
    for t in range(steps):
        x, y = batch(rank, t)
        shadow.load_state_dict(ref.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x), y).backward()
        local.append({n: p.grad.detach().clone() for n, p in shadow.named_parameters()})
        opt_ref.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt_ref.step()
        opt_eng.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt_eng)
    method.flush()
    return {
        "err": max_rel_err(eng.parameters(), ref.parameters()),
        "local": local,
        "names": [n for n, _ in eng.named_parameters()],
    }


@pytest.mark.parametrize(
    "spec, hook",
    [
        (f"mgwfbp:compress=acpsgd,rank={RANK},start_iter=1,alpha=1.0,beta=0.0,profile_iters=1", "acpsgd"),
        (f"dear:compress=acpsgd,rank={RANK},start_iter=1", "acpsgd"),
        (f"wfbp:compress=powersgd,rank={RANK},start_iter=1", "powersgd"),
    ],
)
def test_engine_payload_matches_the_ddp_comm_hook(spec: str, hook: str) -> None:
    steps = 6
    recs = run_distributed(_vs_hook, 2, spec, hook, steps, timeout=60)
    ref = central(hook, [r["local"] for r in recs], recs[0]["names"], start=1, rank=RANK)
    # Both sides run in float32 and differ by the low-rank round-off of each step; the weights
    # move by lr * (momentum-summed gradients), less than their own size in 6 steps, so the
    # gradient bound also bounds the weights' relative difference.
    tol = lowrank_tolerance(ref, steps - 1)
    for r in recs:
        assert r["err"] <= tol, (r["err"], tol)


# --- single process and refusals ----------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["wfbp", "dear"])
def test_single_process_acpsgd_equals_central_reference(schedule: str) -> None:
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = lr_model()
    shadow = copy.deepcopy(model)
    method = methods.create(f"{schedule}:compress=acpsgd,rank={RANK},start_iter=0")
    wrapped = method.wrap(model, MethodContext())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    local, before, after = [], [], []
    for t in range(4):
        x, y = batch(0, t)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        F.cross_entropy(shadow(x), y).backward()
        local.append({n: p.grad.clone() for n, p in shadow.named_parameters()})
        before.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
        method.flush()
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    names = [n for n, _ in model.named_parameters()]
    ref = central("acpsgd", [local], names, start=0, rank=RANK)
    tol = lowrank_tolerance(ref, 4)
    for t in range(4):
        for n in names:
            assert rel_err(after[t][n], before[t][n].double() - LR * ref.grads[t][n]) <= tol, (t, n)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("lee18:compress=acpsgd", ["lee18", "slice", "dear:compress=acpsgd"]),
        ("dear:compress=powersgd", ["complete sum", "multi-round", "dear:compress=acpsgd"]),
        ("wfbp:compress=bogus", ["bogus", "valid:", "acpsgd", "powersgd"]),
        ("wfbp:compress=acpsgd,rank=0", ["rank", ">= 1"]),
    ],
)
def test_incompatible_compressors_are_refused_with_reason(spec: str, words: list[str]) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(spec)
    for w in words:
        assert w in str(e.value)


def _clip_with_dear_acpsgd() -> str:
    model = lr_model()
    method = methods.create("dear:compress=acpsgd")  # refused already in the warm-up steps
    wrapped = method.wrap(model, _ctx())
    x, y = batch(dist.get_rank(), 0)
    F.cross_entropy(wrapped(x), y).backward()
    method.finish_sync()
    try:
        method.clip_grad_norm_(1.0)
    except UsageError as e:
        return str(e)
    return "no error"


def test_gradient_clipping_with_dear_and_acpsgd_is_refused_on_every_rank() -> None:
    msgs = run_distributed(_clip_with_dear_acpsgd, 2, timeout=60)
    assert all("clipping" in m and "wfbp/mgwfbp" in m for m in msgs), msgs

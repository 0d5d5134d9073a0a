"""K-FAC on 2 gloo ranks: identical updates, placement, counted bytes, pipelined = baseline.

Each rank trains on its own data; DDP averages the gradients and K-FAC averages the factors,
so after every step all ranks must hold the same parameters bit for bit (the same sums, the
same broadcast decompositions, the same local decompositions of the same inputs).
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm.comm import accounting
from lowcomm.optim.kfac import KFAC
from lowcomm.optim.kfac.comm import factor_bytes
from lowcomm.optim.kfac.inverse import wire_numel
from lowcomm.testing import distributed, run_distributed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 4 * 4, 12)
        self.fc2 = nn.Linear(12, 5, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).unsqueeze(1)  # (B, 1, 4, 4)
        return self.fc2(torch.tanh(self.fc1(torch.relu(self.conv(h)).flatten(1))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)  # each rank its own data
    return torch.randint(0, 9, (6, 4), generator=gen), torch.randint(0, 5, (6,), generator=gen)


def _run(steps: int, ddp: bool = True, configure: Callable[[KFAC], KFAC] | None = None,
         **kw: Any) -> tuple[nn.Module, KFAC]:
    torch.manual_seed(0)
    net = Net()
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFAC(model, **{"factor_update_steps": 1, "inv_update_steps": 2, "damping": 0.01,
                          "local_inverse_below": 0, **kw})
    if configure is not None:
        kfac = configure(kfac)
    for s in range(steps):
        idx, y = _batch(s)
        opt.zero_grad()
        F.cross_entropy(model(idx), y).backward()
        kfac.step()
        opt.step()
    return net, kfac


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(out[0], o) for o in out[1:])


def _identical_updates(compute: str, pipeline: bool, **kw: Any) -> None:
    net, kfac = _run(4, compute=compute, pipeline=pipeline, **kw)
    for name, p in net.named_parameters():
        assert _same_on_all_ranks(p.detach()), name
    start = dict(Net().named_parameters())  # a different init: the run did move the weights
    assert not torch.equal(start["fc1.weight"], net.fc1.weight)
    # the broadcast path ran: with local_inverse_below=0 every full factor has an owner
    assert set(range(dist.get_world_size())) <= {owner for owner in kfac.plan.values()}


@pytest.mark.parametrize("compute", ["eigen", "inverse"])
def test_every_rank_applies_identical_updates(compute: str) -> None:
    run_distributed(_identical_updates, 2, compute, pipeline=True)


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_four_ranks_apply_identical_updates(fraction: float) -> None:
    run_distributed(_identical_updates, 4, "eigen", pipeline=True, grad_worker_fraction=fraction)


@distributed(world_size=2)
def test_identical_updates_in_the_non_pipelined_baseline() -> None:
    _identical_updates("eigen", pipeline=False)


@distributed(world_size=2)
def test_the_baselines_buckets_give_the_one_buffer_result_with_the_same_bytes() -> None:
    from lowcomm.optim.kfac import comm

    def run(bucket_bytes: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        comm.BUCKET_BYTES = bucket_bytes
        accounting.ledger().reset()
        net, _ = _run(3, pipeline=False, symmetric_comm=False)
        return [p.detach().clone() for p in net.parameters()], accounting.ledger().as_dict()["by_tag"]

    default = comm.BUCKET_BYTES
    try:
        whole, one = run(1 << 40)  # every factor of a kind in one buffer
        parts, many = run(4 * 60)  # fc1's 49x49 A (9.6 kB) alone, the small ones together
    finally:
        comm.BUCKET_BYTES = default
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))
    for tag in ("kfac.A", "kfac.G"):
        assert many[tag]["wire_bytes"] == one[tag]["wire_bytes"]
    assert one["kfac.A"]["calls"] == 3 and many["kfac.A"]["calls"] > 3  # one per factor step, then more


@distributed(world_size=2)
def test_placement_covers_every_factor_exactly_once_across_ranks() -> None:
    _, kfac = _run(1, placement="balanced", local_inverse_below=10)
    rank = dist.get_rank()
    keys = kfac._keys
    assert len(keys) == 2 * len(kfac.layers) == 8 and set(kfac.plan) == set(keys)
    owned = torch.tensor([1 if kfac.plan[k] == rank else 0 for k in keys])
    dist.all_reduce(owned)
    for key, count in zip(keys, owned.tolist()):
        local = key.diagonal or key.dim < 10
        assert count == (0 if local else 1), key  # exactly one owner, or computed everywhere
    assert _same_on_all_ranks(torch.tensor([-1 if kfac.plan[k] is None else kfac.plan[k] for k in keys]))


def _ledger(compute: str, symmetric: bool) -> None:
    accounting.ledger().reset()
    steps, inv_every = 3, 2  # factor updates at 0, 1, 2; inverse updates at 0 and 2
    _, kfac = _run(steps, ddp=False, compute=compute, symmetric_comm=symmetric, inv_update_steps=inv_every)
    led = accounting.ledger().as_dict()["by_tag"]
    layers = kfac.layers
    a = factor_bytes([(layer.a_dim, layer.a_diagonal) for layer in layers], symmetric)
    g = factor_bytes([(layer.g_dim, False) for layer in layers], symmetric)
    # P = 2: an all-reduce sends 2(P-1)/P = 1 times its payload
    assert led["kfac.A"]["wire_bytes"] == steps * a, led["kfac.A"]
    assert led["kfac.G"]["wire_bytes"] == steps * g, led["kfac.G"]
    if symmetric:  # the upper triangle: fc1's 49x49 A is 1225 numbers, not 2401
        assert a == 4 * (9 + 55 + 1225 + 78) and g == 4 * (10 + 6 + 78 + 15)
    mine = [k for k, owner in kfac.plan.items() if owner == dist.get_rank()]
    sent = 2 * 4 * sum(wire_numel(k.dim, compute, symmetric) for k in mine)  # 2 inverse steps
    assert led.get(f"kfac.{compute}", {"wire_bytes": 0})["wire_bytes"] == sent
    assert set(led) <= {"kfac.A", "kfac.G", f"kfac.{compute}"}


@pytest.mark.parametrize("compute, symmetric", [("eigen", True), ("inverse", True), ("inverse", False)])
def test_counted_bytes_equal_the_upper_triangle_formula(compute: str, symmetric: bool) -> None:
    run_distributed(_ledger, 2, compute, symmetric)


_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__", "numpy", "cpu")


class _HostReads:
    """Counts Tensor -> Python value reads (and .cpu()) in every thread while active."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> _HostReads:
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def spy(t: torch.Tensor, *a: Any, _n: str = name, _o: Any = original, **k: Any) -> Any:
                with self._lock:
                    self.calls.append(_n)
                return _o(t, *a, **k)

            setattr(torch.Tensor, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


@distributed(world_size=2)
def test_pipelined_mode_matches_the_baseline_and_hooks_never_read_the_host() -> None:
    piped, kfac = _run(3, pipeline=True, accumulation_steps=1)
    base, _ = _run(3, pipeline=False)
    for (name, p), q in zip(piped.named_parameters(), base.parameters()):
        assert torch.equal(p, q), name
    # one more factor step: the hooks launch every all-reduce before step() runs
    net = piped
    accounting.ledger().reset()
    idx, y = _batch(7)
    with _HostReads() as reads:
        loss = F.cross_entropy(net(idx), y)
        loss.backward()
    assert reads.calls == [], reads.calls
    by_tag = accounting.ledger().as_dict()["by_tag"]
    assert by_tag["kfac.A"]["calls"] == by_tag["kfac.G"]["calls"] == len(kfac.layers)
    kfac.step()
    assert accounting.ledger().as_dict()["by_tag"]["kfac.A"]["calls"] == len(kfac.layers)


# --- DP-KFAC (grad_worker_fraction = 1/world_size) ----------------------------------------------
@distributed(world_size=2)
def test_dp_kfac_gives_the_every_rank_result_and_sends_gradients_not_decompositions() -> None:
    accounting.ledger().reset()
    dp, kfac = _run(3, compute="eigen", grad_worker_fraction=0.5)
    led = accounting.ledger().as_dict()["by_tag"]
    everyone, _ = _run(3, compute="eigen", grad_worker_fraction=1.0)
    assert kfac.dp
    for (name, p), q in zip(dp.named_parameters(), everyone.parameters()):
        assert torch.equal(p, q), name
        assert _same_on_all_ranks(p.detach()), name
    rank = dist.get_rank()
    owners = {i: kfac.plan[kfac._keys[2 * i]] for i in range(len(kfac.layers))}
    assert set(owners.values()) <= {None, 0, 1} and any(o is not None for o in owners.values())
    sent = sum(4 * layer.a_dim * layer.g_dim for i, layer in enumerate(kfac.layers) if owners[i] == rank)
    assert led.get("kfac.grad", {"wire_bytes": 0})["wire_bytes"] == 3 * sent
    assert "kfac.eigen" not in led


def _train_mean_grad(net: nn.Module, opt: torch.optim.Optimizer, kfac: KFAC, steps: range) -> None:
    """Train a bare (not DDP-wrapped) model, averaging its gradients over ranks as DDP would."""
    for s in steps:
        idx, y = _batch(s)
        opt.zero_grad()
        F.cross_entropy(net(idx), y).backward()
        for p in net.parameters():
            grad = p.grad
            assert grad is not None
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        kfac.step()
        opt.step()


def _dp_kfac(model: nn.Module) -> KFAC:
    return KFAC(model, factor_update_steps=1, inv_update_steps=2, damping=0.01, local_inverse_below=0,
                compute="inverse", grad_worker_fraction=0.5)


@distributed(world_size=2)
def test_dp_kfac_state_dict_is_gathered_and_resume_is_exact() -> None:
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train_mean_grad(ref, opt, _dp_kfac(ref), range(6))
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kfac = _dp_kfac(net)
    _train_mean_grad(net, opt, kfac, range(3))  # last inverse update at step 2
    state = kfac.state_dict()  # collective: every rank gets every decomposition
    assert len(state["decompositions"]) == 2 * len(kfac.layers)
    saved = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(state))
    torch.manual_seed(5)
    resumed = Net()
    resumed.load_state_dict(saved[0])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1)
    opt2.load_state_dict(saved[1])
    kfac2 = _dp_kfac(resumed)
    kfac2.load_state_dict(saved[2])
    _train_mean_grad(resumed, opt2, kfac2, range(3, 6))
    for (name, p), q in zip(ref.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name

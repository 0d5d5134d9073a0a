"""KAISA's hybrid ``grad_worker_fraction`` (here 0.5 on 4 ranks: columns {0, 2} and {1, 3}).

What must be bit-equal, and why no tolerance is needed: the hybrid changes *who* computes,
never *what* or in which order. The factor statistics are all-reduced on the same group of all
ranks as with fraction 1; each decomposition is computed from those same bits by one rank
(eigh / Cholesky of the same matrix) and, when it travels, every user applies the received
wire form, exactly as with fraction 1; a factor decomposed locally is decomposed locally
under both; the preconditioned gradient is the same kernel on the same operands, computed by
a gradient worker and broadcast bit for bit. So parameters after several steps equal the
fraction-1 run's with ``torch.equal``, on every rank (a tolerance would only hide a
placement or group bug that sends the wrong decomposition to a layer). What is *not* bit-equal
on more than 2 ranks, and so never compared here: pipelined against non-pipelined runs (a
fused buffer puts each number in another chunk of the ring all-reduce, so its sum of 4 terms
is formed in another order); both runs of a comparison use the same ``pipeline`` setting and
stay within the α-β profiling window (no merged groups yet).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_kfac_distributed import Net, _run, _same_on_all_ranks, _train_mean_grad
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.optim.kfac import KFAC
from lowcomm.optim.kfac.comm import factor_bytes
from lowcomm.optim.kfac.inverse import wire_numel
from lowcomm.optim.kfac.placement import FactorKey, Grid, assign_grid, loads
from lowcomm.testing import distributed, run_distributed


# --- the grid and the placement (one process) --------------------------------------------------
def test_grid_columns_are_worker_groups_and_rows_hold_one_worker_of_each_column() -> None:
    grid = Grid(8, 2)  # KAISA's docstring example: 4 columns of 2, 2 rows of 4
    assert [grid.workers(c) for c in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [grid.receivers(r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank in range(8):
        assert rank in grid.workers(grid.column(rank)) and rank in grid.receivers(grid.row(rank))
        for column in range(4):  # the source is the one member of the column in rank's row
            source = grid.source(column, rank)
            assert source in grid.workers(column) and source in grid.receivers(grid.row(rank))
    assert Grid(4, 4).columns == 1 and Grid(4, 1).receivers(0) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        Grid(4, 3)


def test_hybrid_placement_keeps_each_layer_in_one_column_and_balances_the_owners() -> None:
    dims = [(300, 40), (200, 200), (120, 9), (64, 64), (5, 3)]
    keys = [FactorKey(i, kind, n) for i, (a, g) in enumerate(dims) for kind, n in (("A", a), ("G", g))]
    grid = Grid(4, 2)
    owners, columns = assign_grid(keys, grid, "balanced", local_below=10)
    assert columns[4] is None and owners[keys[8]] is None and owners[keys[9]] is None  # 5x5, 3x3
    assert owners[keys[5]] is None  # 9x9 G of a non-local layer: each worker of the column
    for key in keys:
        column = columns[key.layer]
        if owners[key] is not None:
            assert column is not None and owners[key] in grid.workers(column), key  # within its column
    per_rank = loads(owners, 4)
    # the columns split the layers by their n³ (layer 0 alone against all the others); each
    # column's members split its factors, heaviest first, each to the least-loaded member
    assert [c for c in columns.values()] == [0, 1, 1, 1, None]
    assert per_rank == [300**3, 200**3 + 120**3, 40**3, 200**3 + 2 * 64**3]


# --- on 4 ranks ------------------------------------------------------------------------------
@distributed(world_size=4)
def test_a_fraction_that_gives_no_whole_divisor_of_the_ranks_is_refused() -> None:
    for fraction in (0.3, 0.75):  # 1.2 gradient workers; 3 do not divide 4 ranks
        with pytest.raises(UsageError, match=r"valid fractions on 4 ranks: 1/4 = 0.25, 2/4 = 0.5, 4/4 = 1"):
            KFAC(Net(), grad_worker_fraction=fraction)


@distributed(world_size=4)
def test_only_the_hybrid_creates_groups_beyond_kfacs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[list[int]] = []
    new_group = dist.new_group

    def spy(ranks: list[int], *a: Any, **k: Any) -> Any:
        made.append(list(ranks))
        return new_group(ranks, *a, **k)

    monkeypatch.setattr(dist, "new_group", spy)
    for fraction in (1.0, 0.25):  # the two ends: K-FAC's own group of all ranks, nothing else
        made.clear()
        KFAC(Net(), grad_worker_fraction=fraction)
        assert made == [[0, 1, 2, 3]], (fraction, made)
    made.clear()
    KFAC(Net(), grad_worker_fraction=0.5)  # plus 2 worker columns, then 2 receiver rows
    assert made == [[0, 1, 2, 3], [0, 2], [1, 3], [0, 1], [2, 3]]


def _same_as_fraction_one(compute: str, local_inverse_below: int, **kw: Any) -> None:
    hybrid, kfac = _run(4, compute=compute, grad_worker_fraction=0.5, local_inverse_below=local_inverse_below, **kw)
    everyone, _ = _run(4, compute=compute, grad_worker_fraction=1.0, local_inverse_below=local_inverse_below, **kw)
    rank = dist.get_rank()
    assert kfac.grid == Grid(4, 2) and not kfac.dp
    for (name, p), q in zip(hybrid.named_parameters(), everyone.parameters()):
        assert torch.equal(p, q), name
        assert _same_on_all_ranks(p.detach()), name
    start = dict(Net().named_parameters())["fc1.weight"]
    assert not torch.equal(start, dict(hybrid.named_parameters())["fc1.weight"])  # the run moved it
    # both columns hold layers, and each rank keeps only its column's decompositions
    columns = {c for c in kfac.columns.values() if c is not None}
    assert columns == {0, 1}, kfac.columns
    held = {key.layer for key in kfac._decs}
    assert held == {i for i, c in kfac.columns.items() if c is None or c == rank % 2}
    if compute == "eigen":  # DP-KFAC gives the same bits too (its owner's wire form is exact)
        dp, _ = _run(4, compute=compute, grad_worker_fraction=0.25, local_inverse_below=local_inverse_below, **kw)
        for (name, p), q in zip(dp.named_parameters(), hybrid.parameters()):
            assert torch.equal(p, q), name


@pytest.mark.parametrize("compute, local_inverse_below, kw", [
    ("eigen", 0, {}),
    ("inverse", 0, {}),
    ("inverse", 11, {}),  # fc2's 5x5 G is decomposed by both workers of fc2's column
    ("eigen", 0, {"placement": "round_robin", "pipeline": False}),
])
def test_hybrid_applies_the_fraction_one_updates_bit_for_bit_on_every_rank(
        compute: str, local_inverse_below: int, kw: dict[str, Any]) -> None:
    run_distributed(_same_as_fraction_one, 4, compute, local_inverse_below, **kw)


def _eight_ranks() -> None:
    hybrid, kfac = _run(3, grad_worker_fraction=0.25)
    everyone, _ = _run(3, grad_worker_fraction=1.0)
    assert kfac.grid == Grid(8, 2)  # 4 columns of 2 workers, 2 rows of 4 receivers
    for (name, p), q in zip(hybrid.named_parameters(), everyone.parameters()):
        assert torch.equal(p, q), name
        assert _same_on_all_ranks(p.detach()), name


def test_unequal_worker_and_receiver_groups_on_eight_ranks() -> None:
    run_distributed(_eight_ranks, 8)


def _hybrid_ledger(compute: str) -> None:
    """Bytes of the hybrid on ``P`` ranks with ``g`` gradient workers per layer (ledger
    ``payload_bytes``: what a rank hands to collectives; ``wire_bytes``: what it sends):

    * factors (``kfac.A``/``kfac.G``), per factor step: all-reduced over all ranks as with
      fraction 1, payload ``F = 4·Σ packed(n)``, wire ``2(P-1)/P·F``;
    * decompositions (``kfac.eigen``/``kfac.inverse``), per inverse step: rank ``r`` sends
      ``4·Σ_{owner(k)=r} wire(k)`` and hands ``4·Σ_{k remote, layer(k) in column(r)} wire(k)``
      (it receives its column's decompositions only, not all of them as with fraction 1);
    * preconditioned gradients (``kfac.grad``), every step: rank ``r`` hands
      ``4·Σ_i g_i·a_i`` over the layers with a column and sends the part of its own column's
      layers; in all, each such layer's gradient is sent once per row, ``g`` times.
    """
    accounting.ledger().reset()
    steps, inv_steps = 3, 2  # factor updates at 0, 1, 2; inverse updates at 0 and 2
    _, kfac = _run(steps, ddp=False, compute=compute, grad_worker_fraction=0.5, inv_update_steps=2)
    led = accounting.ledger().as_dict()["by_tag"]
    rank, world, layers = dist.get_rank(), dist.get_world_size(), kfac.layers
    column = kfac.grid.column(rank)
    a = factor_bytes([(layer.a_dim, layer.a_diagonal) for layer in layers], True)
    g = factor_bytes([(layer.g_dim, False) for layer in layers], True)
    for tag, payload in (("kfac.A", a), ("kfac.G", g)):
        assert led[tag]["payload_bytes"] == steps * payload, led[tag]
        assert led[tag]["wire_bytes"] == steps * 2 * (world - 1) * payload // world, led[tag]
    remote = [k for k, owner in kfac.plan.items() if owner is not None]
    sent = inv_steps * 4 * sum(wire_numel(k.dim, compute, True) for k in remote if kfac.plan[k] == rank)
    handed = inv_steps * 4 * sum(wire_numel(k.dim, compute, True) for k in remote
                                 if kfac.columns[k.layer] == column)
    assert led[f"kfac.{compute}"]["wire_bytes"] == sent and led[f"kfac.{compute}"]["payload_bytes"] == handed
    grads = {i: 4 * layer.g_dim * layer.a_dim for i, layer in enumerate(layers) if kfac.columns[i] is not None}
    assert led["kfac.grad"]["payload_bytes"] == steps * sum(grads.values())
    assert led["kfac.grad"]["wire_bytes"] == steps * sum(b for i, b in grads.items() if kfac.columns[i] == column)
    assert set(led) == {"kfac.A", "kfac.G", f"kfac.{compute}", "kfac.grad"}
    # the totals over ranks: each decomposition sent once, each gradient once per row (g = 2)
    totals = torch.tensor([led[f"kfac.{compute}"]["wire_bytes"], led["kfac.grad"]["wire_bytes"]])
    dist.all_reduce(totals)
    assert totals[0] == inv_steps * 4 * sum(wire_numel(k.dim, compute, True) for k in remote)
    assert totals[1] == 2 * steps * sum(grads.values())


@pytest.mark.parametrize("compute", ["eigen", "inverse"])
def test_counted_bytes_equal_the_hybrid_formula(compute: str) -> None:
    run_distributed(_hybrid_ledger, 4, compute)


def _hybrid_kfac(model: nn.Module) -> KFAC:
    return KFAC(model, factor_update_steps=1, inv_update_steps=2, damping=0.01, local_inverse_below=11,
                compute="inverse", grad_worker_fraction=0.5)


@distributed(world_size=4)
def test_hybrid_state_dict_is_gathered_on_every_rank_and_resume_is_exact() -> None:
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train_mean_grad(ref, opt, _hybrid_kfac(ref), range(6))
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kfac = _hybrid_kfac(net)
    _train_mean_grad(net, opt, kfac, range(3))  # last inverse update at step 2
    state: dict[str, Any] = kfac.state_dict()  # collective: every rank gets every decomposition
    assert len(state["decompositions"]) == 2 * len(kfac.layers)
    for name, dec in sorted(state["decompositions"].items()):  # the same on every rank
        for field, t in sorted(dec.items()):
            if t is not None:
                assert _same_on_all_ranks(t), (name, field)
    saved = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(state))
    torch.manual_seed(5)
    resumed = Net()
    resumed.load_state_dict(saved[0])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1)
    opt2.load_state_dict(saved[1])
    kfac2 = _hybrid_kfac(resumed)
    kfac2.load_state_dict(saved[2])
    assert set(kfac2._decs) == set(kfac._decs)  # it keeps its own column's, as the run did
    _train_mean_grad(resumed, opt2, kfac2, range(3, 6))
    for (name, p), q in zip(ref.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name

"""Every schedule must reproduce DDP (plain all-reduce) parameter for parameter.

The engine model and a DDP reference start from different per-rank seeds (so the initial
broadcast from rank 0 is exercised), see different data on every rank, and step with the
same optimizer, LR schedule and (optionally) gradient clipping. Parameters are compared
after every step, both as seen by the next forward (deferred all-gathers completed by the
forward pre-hooks) and, in the flush variant, right after the step.

Tolerance (tests/tolerance.py): both sides do the same float32 arithmetic except the order of
each gradient's sum over the ranks (ring all-reduce vs reduce-scatter/all-gather, other
bucket boundaries): world rounding steps per step. The next gradients are taken at weights
that differ by that much and the optimizer steps are elementwise and identical, so the
differences add up over the steps: ops = world * steps, relative to the largest weight.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (DDP imports it: do it once here, not in every forked rank)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.methods.base import MethodContext
from lowcomm.testing.distributed import run_distributed
from tolerance import tolerance

methods.names()  # load the method modules before forking


def tiny_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv1d(4, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(32, 16),
        nn.Tanh(),
        nn.LayerNorm(16),
        nn.Linear(16, 8),
        nn.ReLU(),
        nn.Linear(8, 3),
    )


class SharedLayers(nn.Module):
    """One layer called twice in forward, plus tied weights (a parameter owned by two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 8)
        self.shared = nn.Linear(8, 8)
        self.enc = nn.Linear(8, 8, bias=False)
        self.dec = nn.Linear(8, 8, bias=False)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.flatten(1)))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.dec(torch.tanh(self.enc(h))))
        return self.out(h)


MODELS = {"tiny": tiny_model, "shared": SharedLayers}


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 2, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )


def rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        worst = max(worst, float((x - y).abs().max() / (y.abs().max() + 1e-12)))
    return worst


def compare_with_ddp(
    spec: str, opt_kind: str, steps: int, flush_each: bool, clip: float | None, model: str = "tiny"
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # different on every rank: the engine must broadcast rank 0's
    base = MODELS[model]()
    ref_model, eng_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref_model)
    method = methods.create(spec)
    wrapped = method.wrap(eng_model, MethodContext(rank=rank, world_size=world))
    opt_ref, opt_eng = make_optimizer(opt_kind, ref_model), make_optimizer(opt_kind, eng_model)
    lr_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=1, gamma=0.8)
    lr_eng = torch.optim.lr_scheduler.StepLR(opt_eng, step_size=1, gamma=0.8)
    errs = []
    for step in range(steps):
        x, y = batch(rank, step)
        before = [p.detach().clone() for p in ref_model.parameters()]
        opt_ref.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
        opt_ref.step()
        lr_ref.step()

        opt_eng.zero_grad()
        out = wrapped(x)  # forward pre-hooks complete last step's all-gathers
        errs.append(rel_err([p.detach() for p in eng_model.parameters()], before))
        F.cross_entropy(out, y).backward()
        method.finish_sync()
        if clip is not None:
            method.clip_grad_norm_(clip)
        method.optimizer_step(opt_eng)
        lr_eng.step()
        if flush_each:
            method.flush()
            errs.append(rel_err([p.detach() for p in eng_model.parameters()], [p.detach() for p in ref_model.parameters()]))
    method.flush()
    errs.append(rel_err([p.detach() for p in eng_model.parameters()], [p.detach() for p in ref_model.parameters()]))
    moved = rel_err([p.detach() for p in eng_model.parameters()], [p.detach() for p in base.parameters()])
    return {"errs": errs, "moved": moved, "describe": method.describe()}


SPECS = {
    "wfbp": "wfbp",
    "mgwfbp": "mgwfbp:alpha=1.0,beta=0.0,profile_iters=2",  # huge α: merges into one group mid-run
    "dear": "dear:threshold_mb=0.0004",  # ~400-byte groups: several groups
    "lee18": "lee18:threshold_mb=0,merge_below=0",  # one group per layer, as dear:threshold_mb=0
    "hier": "hier:threshold_mb=0",  # one node here: the flat fallback (2 x 2 nodes: test_hierarchical.py)
}


def schedule_tolerance(world: int, steps: int) -> float:
    """Bound on the relative weight difference after ``steps`` steps on ``world`` ranks."""
    return tolerance(torch.float32, ops=world * max(1, steps))


def check(results: list[dict[str, Any]], steps: int) -> None:
    tol = schedule_tolerance(len(results), steps)
    for r in results:
        assert len(r["errs"]) >= steps + 1
        assert max(r["errs"]) <= tol, (r["errs"], tol)
        assert r["moved"] > 1e-3  # the training actually changed the weights


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_schedule_matches_ddp_with_sgd_nesterov_and_adamw(name: str, world: int) -> None:
    steps = 6
    for opt_kind in ("sgd", "adamw"):
        results = run_distributed(compare_with_ddp, world, SPECS[name], opt_kind, steps, False, None)
        check(results, steps)


@pytest.mark.parametrize("name", ["dear", "lee18", "wfbp"])
def test_schedule_matches_ddp_with_clipping_and_flush_every_step(name: str) -> None:
    steps = 5
    results = run_distributed(compare_with_ddp, 2, SPECS[name], "adamw", steps, True, 0.05)
    check(results, steps)


def test_mgwfbp_regroups_after_profiling() -> None:
    results = run_distributed(compare_with_ddp, 2, SPECS["mgwfbp"], "sgd", 5, False, None)
    d = results[0]["describe"]
    assert d["planned"] is True
    assert d["groups"] == 1  # α = 1 s: nothing is worth sending separately
    assert [r["describe"]["group_sizes_units"] for r in results] == [d["group_sizes_units"]] * 2


def compare_with_gathers_in_pieces(spec: str, piece_bytes: int, steps: int) -> dict[str, Any]:
    """:func:`compare_with_ddp` with the deferred all-gathers split into ``piece_bytes`` pieces."""
    from lowcomm.sched import deferred

    pieces: list[int] = []
    whole, size = accounting.all_gather, deferred.AG_PIECE_BYTES

    def counted(*args: Any, **kwargs: Any) -> Any:
        pieces.append(args[1].numel())
        return whole(*args, **kwargs)

    accounting.all_gather, deferred.AG_PIECE_BYTES = counted, piece_bytes
    try:
        out = compare_with_ddp(spec, "sgd", steps, False, None)
    finally:
        accounting.all_gather, deferred.AG_PIECE_BYTES = whole, size
    return {**out, "pieces": pieces}


@pytest.mark.parametrize("name", ["dear", "lee18"])
def test_all_gathers_in_pieces_still_match_ddp(name: str) -> None:
    """On gloo a large group's all-gather travels in pieces (sched.deferred.AG_PIECE_BYTES);
    with 64-byte pieces every group here is split, and the weights are DDP's all the same."""
    steps = 4
    results = run_distributed(compare_with_gathers_in_pieces, 2, SPECS[name], 64, steps)
    check(results, steps)
    for r in results:
        assert len(r["pieces"]) > 2 * steps and max(r["pieces"]) == 64 // (2 * 4)  # 8 floats per rank

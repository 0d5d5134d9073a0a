"""Bad input, checkpoints, tuning, planning and single-process use of the scheduling engine."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (DDP imports it: once here, not in every forked rank)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm import methods
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.sched.cost import AlphaBeta, plan_mgwfbp, predict_iteration
from lowcomm.sched.groups import collect_units, fuse_by_threshold, fuse_sizes
from lowcomm.testing.distributed import run_distributed

from test_sched_correctness import (
    SPECS,
    batch,
    check,
    compare_with_ddp,
    make_optimizer,
    rel_err,
    schedule_tolerance,
    tiny_model,
)

methods.names()


# --- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, words",
    [
        ("dear:bogus=1", ["bogus", "threshold_mb"]),
        ("dear:threshold_mb=-1", ["threshold_mb", ">= 0"]),
        ("mgwfbp:alpha=0.001", ["alpha", "beta"]),
        ("mgwfbp:profile_iters=0", ["profile_iters"]),
        ("dear:compress=powersgd", ["powersgd", "multi-round", "reduce-scatter"]),
        ("lee18:compress=powersgd", ["powersgd", "slice", "wfbp:compress=powersgd"]),
        ("wfbp:compress=fp16,density=0.1", ["density", "compress, broadcast_buffers", "fp16"]),
        ("wfbp:density=0.1", ["density", "compress="]),
        ("lee18:tune_trials=0", ["lee18", "tune_trials"]),
        ("lee18:tune_min_mb=4,tune_max_mb=2", ["lee18", "tune_max_mb", ">= tune_min_mb"]),
    ],
)
def test_invalid_schedule_options_are_refused_with_reason(spec: str, words: list[str]) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(spec)
    for w in words:
        assert w in str(e.value)


# --- unused / twice-used parameters -------------------------------------------------------------
class WithUnused(nn.Module):
    def __init__(self, unused_on: tuple[int, ...]) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(8, 3)
        self.extra = nn.Linear(8, 8)
        self.unused_on = unused_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x.flatten(1)))
        if dist.get_rank() not in self.unused_on:
            h = self.extra(h)
        return self.b(h)


def _first_step_error(spec: str, unused_on: tuple[int, ...]) -> str:
    model = WithUnused(unused_on)
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=dist.get_rank(), world_size=dist.get_world_size()))
    x, y = batch(dist.get_rank(), 0)
    F.cross_entropy(wrapped(x), y).backward()
    try:
        method.finish_sync()
    except UsageError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("spec", ["wfbp", "dear", "lee18"])
def test_unused_parameter_is_refused_at_first_backward_on_every_rank(spec: str) -> None:
    msgs = run_distributed(_first_step_error, 2, spec, (0, 1), timeout=60)
    assert all("extra.weight" in m and "requires_grad_(False)" in m for m in msgs), msgs


def test_parameter_unused_on_one_rank_only_is_refused_everywhere_without_hanging() -> None:
    msgs = run_distributed(_first_step_error, 2, "dear", (1,), timeout=60)
    assert all("got no gradient" in m for m in msgs), msgs


@pytest.mark.parametrize("name", ["wfbp", "dear", "lee18"])
def test_layer_called_twice_and_tied_weights_match_ddp(name: str) -> None:
    results = run_distributed(compare_with_ddp, 2, SPECS[name], "adamw", 4, False, None, "shared")
    check(results, 4)


def _backward_twice(spec: str) -> str:
    model = tiny_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=dist.get_rank(), world_size=dist.get_world_size()))
    x, y = batch(dist.get_rank(), 0)
    F.cross_entropy(wrapped(x), y).backward()
    try:
        F.cross_entropy(wrapped(x), y).backward()
    except UsageError as e:
        return str(e)
    return "no error"


def test_two_backward_passes_in_one_step_are_refused() -> None:
    msgs = run_distributed(_backward_twice, 2, "wfbp", timeout=60)
    assert all("ready twice" in m for m in msgs), msgs


class BypassesModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 3)
        self.side = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.a(x) + F.linear(x, self.side.weight, self.side.bias)  # side() never runs


def _bypass(spec: str) -> str:
    model = BypassesModule()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=dist.get_rank(), world_size=dist.get_world_size()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(2):
            x, y = batch(dist.get_rank(), step)
            opt.zero_grad()
            F.cross_entropy(wrapped(x), y).backward()
            method.finish_sync()
            method.optimizer_step(opt)
    except UsageError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("spec", ["dear:threshold_mb=0", "lee18:threshold_mb=0,merge_below=0"])
def test_parameter_used_outside_its_module_forward_is_refused_for_deferred_schedules(spec: str) -> None:
    msgs = run_distributed(_bypass, 2, spec, timeout=60)
    assert all("'side." in m and "call the module itself" in m for m in msgs), msgs


# --- checkpoints ------------------------------------------------------------------------------
def _checkpoint_roundtrip(spec: str, path: str) -> dict[str, Any]:
    """Train 3 steps, checkpoint from rank 0 (after flush), resume with a fresh method and
    optimizer, train 3 more; DDP does the same 6 steps without interruption."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = tiny_model()
    ref_model, eng_model = copy.deepcopy(base), copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref_model)
    opt_ref, opt_eng = make_optimizer("adamw", ref_model), make_optimizer("adamw", eng_model)
    method = methods.create(spec)
    wrapped = method.wrap(eng_model, MethodContext(rank=rank, world_size=world))

    def ref_step(step: int) -> None:
        x, y = batch(rank, step)
        opt_ref.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt_ref.step()

    def eng_step(step: int) -> None:
        x, y = batch(rank, step)
        opt_eng.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt_eng)

    for step in range(3):
        ref_step(step)
        eng_step(step)
    method.flush()
    state_err = 0.0
    for p_ref, p_eng in zip(ref_model.parameters(), eng_model.parameters()):
        s_ref, s_eng = opt_ref.state[p_ref], opt_eng.state[p_eng]
        for k in ("exp_avg", "exp_avg_sq"):
            state_err = max(state_err, rel_err([s_eng[k]], [s_ref[k]]))
        assert float(s_eng["step"]) == float(s_ref["step"]) == 3.0
    if rank == 0:
        torch.save(
            {"model": eng_model.state_dict(), "opt": opt_eng.state_dict(), "method": method.state_dict()},
            path,
        )
    dist.barrier()
    ckpt = torch.load(path, weights_only=False)
    eng_model = tiny_model()
    eng_model.load_state_dict(ckpt["model"])
    opt_eng = make_optimizer("adamw", eng_model)
    opt_eng.load_state_dict(ckpt["opt"])
    saved_sizes = ckpt["method"]["group_sizes"]
    method = methods.create(spec)
    method.load_state_dict(ckpt["method"])
    wrapped = method.wrap(eng_model, MethodContext(rank=rank, world_size=world))
    resumed_sizes = list(method.engine.sizes)
    for step in range(3, 6):
        ref_step(step)
        eng_step(step)
    method.flush()
    return {
        "saved_sizes": saved_sizes,
        "resumed_sizes": resumed_sizes,
        "state_err": state_err,
        "param_err": rel_err([p.detach() for p in eng_model.parameters()], [p.detach() for p in ref_model.parameters()]),
    }


# the tuned lee18 finishes its one trial within the first 3 steps: it resumes with the grouping it chose
@pytest.mark.parametrize("name", ["lee18", "dear", "mgwfbp", "lee18:tune=true,tune_trials=1,tune_iters=1"])
def test_checkpoint_after_flush_holds_full_optimizer_state_and_resumes_exactly(name: str, tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "ckpt.pt")
    for r in run_distributed(_checkpoint_roundtrip, 2, SPECS.get(name, name), path, timeout=90):
        assert r["resumed_sizes"] == r["saved_sizes"]
        # Adam's moments after 3 steps: the gradient sums' round-off (exp_avg_sq: squared, x2);
        # the weights after 6 steps
        assert r["state_err"] <= 2 * schedule_tolerance(2, 3)
        assert r["param_err"] <= schedule_tolerance(2, 6)


# --- tuned fusion (dear, lee18) ---------------------------------------------------------------------------
# lee18 regroups its sharded optimizer between trials: its state (momentum, AdamW's moments)
# must carry over exactly
@pytest.mark.parametrize("schedule, opt_kind", [("dear", "sgd"), ("lee18", "sgd"), ("lee18", "adamw")])
def test_schedule_tunes_threshold_with_bayesian_optimization_and_stays_exact(schedule: str, opt_kind: str) -> None:
    spec = f"{schedule}:tune=true,tune_trials=3,tune_iters=2"
    steps = 3 * 4 + 2
    results = run_distributed(compare_with_ddp, 2, spec, opt_kind, steps, False, None, timeout=90)
    check(results, steps)
    tunings = [r["describe"]["tuning"] for r in results]
    assert all(t["done"] for t in tunings)
    assert len(tunings[0]["trials"]) == 3
    chosen = tunings[0]["chosen_threshold_mb"]
    assert chosen == tunings[1]["chosen_threshold_mb"]  # rank 0's choice was broadcast
    assert chosen == min(tunings[0]["trials"], key=lambda t: t["iter_time_s"])["threshold_mb"]
    assert results[0]["describe"]["group_sizes_units"] == results[1]["describe"]["group_sizes_units"]


# --- MG-WFBP ------------------------------------------------------------------------------------
def test_mgwfbp_probes_alpha_beta_and_every_rank_gets_rank0s_plan() -> None:
    results = run_distributed(compare_with_ddp, 2, "mgwfbp:profile_iters=2", "sgd", 5, False, None)
    check(results, 5)
    d0, d1 = (r["describe"] for r in results)
    assert d0["planned"] and d1["planned"]
    assert d0["alpha_s"] == d1["alpha_s"] > 0 and d0["beta_s_per_byte"] == d1["beta_s_per_byte"] >= 0
    assert d0["group_sizes_units"] == d1["group_sizes_units"]


@pytest.mark.parametrize("steps", [2, 3])
def test_mgwfbp_runs_its_plan_from_the_step_its_warmup_steps_name(steps: int) -> None:
    spec = "mgwfbp:profile_iters=2"
    warmup = methods.create(spec).warmup_steps()
    assert warmup == 3  # two profiled backwards after the first, which sends before it is profiled
    results = run_distributed(compare_with_ddp, 2, spec, "sgd", steps, False, None)
    assert [r["describe"]["planned"] for r in results] == [steps >= warmup] * 2


BIG = 100_000  # elements: above the always-merge size


def test_mgwfbp_keeps_layers_apart_when_communication_hides_behind_backward() -> None:
    # forward order; layer 2 is ready first in backward. 1 ms gaps, 0.1 ms comm each.
    ready = [0.003, 0.002, 0.001]
    cost = AlphaBeta(alpha=1e-5, beta=0.09e-3 / (4 * BIG))
    assert plan_mgwfbp(ready, [4 * BIG] * 3, [BIG] * 3, cost) == [1, 1, 1]


def test_mgwfbp_merges_when_the_link_is_still_busy_or_the_wait_is_below_alpha() -> None:
    ready = [0.003, 0.002, 0.001]
    slow_link = AlphaBeta(alpha=1e-5, beta=5e-3 / (4 * BIG))  # 5 ms per layer: link busy
    assert plan_mgwfbp(ready, [4 * BIG] * 3, [BIG] * 3, slow_link) == [2, 1]
    big_alpha = AlphaBeta(alpha=2e-3, beta=0.0)  # 1 ms wait < α
    assert plan_mgwfbp(ready, [4 * BIG] * 3, [BIG] * 3, big_alpha) == [3]
    tiny = AlphaBeta(alpha=0.0, beta=0.0)
    assert plan_mgwfbp(ready, [40] * 3, [10] * 3, tiny) == [3]  # small tensors always merge


def test_mgwfbp_plan_is_never_predicted_slower_than_per_layer_wfbp() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = 8
        gaps = (torch.rand(n, generator=g) * 2e-3).tolist()
        ready_bwd = torch.tensor(gaps).cumsum(0).tolist()
        ready = list(reversed(ready_bwd))
        nbytes = (torch.randint(1, 50, (n,), generator=g) * 40_000).tolist()
        cost = AlphaBeta(alpha=float(torch.rand(1, generator=g)) * 1e-3, beta=float(torch.rand(1, generator=g)) * 1e-8)
        plan = plan_mgwfbp(ready, nbytes, [b // 4 for b in nbytes], cost)
        assert sum(plan) == n
        assert predict_iteration(ready, nbytes, plan, cost) <= predict_iteration(ready, nbytes, [1] * n, cost) + 1e-12


def test_fusion_by_threshold_groups_consecutive_layers_in_forward_order() -> None:
    units = collect_units(tiny_model())
    assert [u.name for u in units] == ["0", "2", "4", "6", "7", "9"]
    assert fuse_by_threshold(units, 0) == [1] * 6
    assert fuse_by_threshold(units, 1e12) == [6]
    sizes = fuse_by_threshold(units, 600)
    assert sum(sizes) == 6 and 1 < len(sizes) < 6


def layers_with_norms() -> nn.Module:
    """Three Linear layers (10,100 / 10,100 / 1,010 parameters) with a LayerNorm (200) between."""
    return nn.Sequential(nn.Linear(100, 100), nn.LayerNorm(100), nn.Linear(100, 100),
                         nn.LayerNorm(100), nn.Linear(100, 10))


def test_layers_under_the_minimum_ride_with_their_neighbour_and_the_rest_keep_their_own_group() -> None:
    units = collect_units(layers_with_norms())
    assert fuse_by_threshold(units, 0, 0) == [1] * 5
    # each norm joins the next layer; the small last Linear and the norm before it close together
    assert fuse_by_threshold(units, 0, 8192) == [1, 2, 2]
    assert fuse_by_threshold(units, 0, 10**9) == [5]


def test_lee18_per_layer_merges_layers_under_mgwfbps_8192_elements_unless_merge_below_is_0() -> None:
    for spec, sizes in (("lee18:threshold_mb=0", [1, 2, 2]), ("lee18:threshold_mb=0,merge_below=0", [1] * 5)):
        method = methods.create(spec)
        method.wrap(layers_with_norms(), MethodContext())
        assert [len(g.units) for g in method.engine.groups] == sizes, spec


def test_lee18_fuses_layers_into_25_mb_groups_after_a_1_mb_first_group_by_default_as_dear() -> None:
    lee18, dear = methods.create("lee18"), methods.create("dear")
    assert lee18.options.threshold_mb == dear.options.threshold_mb == 25.0
    assert lee18.options.first_group_mb == dear.options.first_group_mb == 1.0
    lee18.wrap(layers_with_norms(), MethodContext())
    assert [len(g.units) for g in lee18.engine.groups] == [5]  # a small model: one group


def test_the_first_group_closes_at_first_bytes_and_the_rest_at_the_threshold() -> None:
    mib = [1 << 20] * 10
    assert fuse_sizes(mib, mib, 4 << 20) == [4, 4, 2]
    assert fuse_sizes(mib, mib, 4 << 20, first_bytes=1 << 20) == [1, 4, 4, 1]
    assert fuse_sizes(mib, mib, 4 << 20, first_bytes=8 << 20) == [4, 4, 2]  # never above the threshold
    assert fuse_sizes(mib, mib, 0, first_bytes=1 << 20) == [1] * 10  # per layer stays per layer
    # the elements rule still holds for the first group
    assert fuse_sizes(mib, [1] * 10, 4 << 20, min_numel=3, first_bytes=1 << 20) == [3, 4, 3]
    with pytest.raises(UsageError, match="dear: first_group_mb"):
        methods.create("dear:first_group_mb=-1")


# --- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SPECS))
def test_single_process_without_torch_distributed_equals_plain_training(name: str) -> None:
    assert not dist.is_initialized()
    torch.manual_seed(0)
    ref = tiny_model()
    eng = copy.deepcopy(ref)
    opt_ref, opt_eng = make_optimizer("sgd", ref), make_optimizer("sgd", eng)
    method = methods.create(SPECS[name])
    wrapped = method.wrap(eng, MethodContext())
    for step in range(4):
        x, y = batch(0, step)
        opt_ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt_eng.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt_eng)
    method.flush()
    # one rank: no sum to reorder, only the engine's flat-buffer copies (exact); 4 steps
    assert rel_err([p.detach() for p in eng.parameters()], [p.detach() for p in ref.parameters()]) <= schedule_tolerance(1, 4)


# --- optimizers, overrides and state --------------------------------------------------------------
def _lee18_one_step(opt_cls: type[torch.optim.Optimizer]) -> None:
    torch.manual_seed(0)
    model = tiny_model()
    method = methods.create("lee18")
    wrapped = method.wrap(model, MethodContext())
    opt = opt_cls(model.parameters(), lr=0.01)
    x, y = batch(0, 0)
    F.cross_entropy(wrapped(x), y).backward()
    method.finish_sync()
    method.optimizer_step(opt)
    method.flush()


def test_lee18_refuses_a_non_elementwise_optimizer_naming_it_and_the_valid_ones() -> None:
    """Adafactor's factored second moment over a 1/P slice is a different rule: refused."""
    with pytest.raises(UsageError) as e:
        _lee18_one_step(torch.optim.Adafactor)
    msg = str(e.value)
    assert "\n" not in msg and "Adafactor" in msg and "AdamW" in msg and "SGD" in msg


def test_lee18_accepts_an_elementwise_optimizer() -> None:
    from lowcomm.optim.sharded import is_elementwise

    assert is_elementwise(torch.optim.AdamW) and not is_elementwise(torch.optim.Adafactor)
    _lee18_one_step(torch.optim.AdamW)


@pytest.mark.parametrize("spec", ["wfbp:compress=signum", "dear:compress=signum", "lee18:compress=signum"])
def test_engine_schedule_carrying_signum_asks_for_the_same_optimizer_overrides_as_signum(spec: str) -> None:
    from lowcomm.runtime.config import TrainConfig

    cfg = TrainConfig()
    own = [(o.field, o.value) for o in methods.create("signum").optimizer_overrides(cfg)]
    assert own == [("momentum", 0.0), ("lr", pytest.approx(cfg.lr * (1 + cfg.momentum)))]
    assert [(o.field, o.value) for o in methods.create(spec).optimizer_overrides(cfg)] == own
    assert methods.create("wfbp:compress=topk,momentum_correction=false").optimizer_overrides(cfg) == []


@pytest.mark.parametrize("spec", ["wfbp", "dear", "lee18"])
def test_engine_step_count_survives_a_state_dict_round_trip(spec: str) -> None:
    torch.manual_seed(0)
    method = methods.create(spec)
    model = tiny_model()
    wrapped = method.wrap(model, MethodContext())
    opt = make_optimizer("sgd", model)
    for step in range(3):
        x, y = batch(0, step)
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
    method.flush()
    state = method.state_dict()
    assert state["steps"] == 3
    fresh = methods.create(spec)
    fresh.wrap(tiny_model(), MethodContext())
    fresh.load_state_dict(state)
    assert fresh.state_dict()["steps"] == 3
    later = methods.create(spec)  # loaded before wrapping: applied at wrap
    later.load_state_dict(state)
    later.wrap(tiny_model(), MethodContext())
    assert later.state_dict()["steps"] == 3


@pytest.mark.parametrize("spec,phases", [("dear", ("forward",)), ("lee18", ("forward", "backward"))])
def test_sharded_updates_inside_the_passes_are_reported_as_optimizer_work(spec: str, phases: tuple[str, ...]) -> None:
    """DeAR updates each group before its forward; lee18 (``update=layer``) steps each shard in
    backward and copies the gathered parameters in before each forward: on a GPU that is device
    work, so it is reported (emulated compute waits for it)."""
    from lowcomm.runtime import timing

    torch.manual_seed(0)
    model = tiny_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext())
    opt = make_optimizer("sgd", model)
    reported: dict[str, float] = {}
    for step in range(3):
        x, y = batch(0, step)
        opt.zero_grad()
        before = timing.timer().get("optimizer")
        loss = F.cross_entropy(wrapped(x), y)
        reported["forward"] = timing.timer().get("optimizer") - before
        before = timing.timer().get("optimizer")
        loss.backward()
        reported["backward"] = timing.timer().get("optimizer") - before
        method.finish_sync()
        method.optimizer_step(opt)
    method.flush()
    for phase in ("forward", "backward"):
        assert (reported[phase] > 0) == (phase in phases), (phase, reported)

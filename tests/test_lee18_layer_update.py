"""lee18's per-layer update (``update=layer``): each group's shard is stepped in backward, and
the weights stay DDP's.

Why these tests: the update moves from ``optimizer_step`` into the backward hooks, so what
could go wrong is (a) the weights (a group stepped twice, or with another group's gradient,
or with stale hyperparameters), (b) a skipped non-finite step that is not skipped any more,
(c) clipping or a GradScaler, which need the whole gradient before any update, and (d) a
checkpoint taken mid-training. DDP is the reference for (a), (b) and (d); ``update=step``
(today's path, itself checked against the codecs' central references in
tests/test_sched_codecs.py) for the codecs.

Tolerance (tests/tolerance.py): as in tests/test_sched_correctness.py, ``world * steps``
float32 roundings relative to the largest weight (the only difference to DDP is the order of
each gradient sum over the ranks). Between ``update=layer`` and ``update=step`` the arithmetic
is the same elementwise operations on the same numbers: equal bit for bit.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from compress_testlib import HOOK_CASES, make_model
from lowcomm import methods
from lowcomm.compress.codec import CODECS
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.sched.pairing import pairing_refusal
from lowcomm.testing.distributed import run_distributed
from test_sched_correctness import batch, rel_err, schedule_tolerance, tiny_model

methods.names()  # load the method modules before forking


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    if kind == "nesterov":
        return torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
        )
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
    )


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class Pair:
    """DDP and lee18 on copies of one model, stepped on the same batches."""

    def __init__(self, spec: str, opt_kind: str, base: nn.Module) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank = rank
        self.ref, self.eng = copy.deepcopy(base), copy.deepcopy(base)
        self.ddp = nn.parallel.DistributedDataParallel(self.ref)
        self.method = methods.create(spec)
        self.wrapped = self.method.wrap(self.eng, MethodContext(rank=rank, world_size=world))
        self.opt_ref, self.opt_eng = (
            make_optimizer(opt_kind, self.ref),
            make_optimizer(opt_kind, self.eng),
        )
        self.lr_ref = torch.optim.lr_scheduler.StepLR(self.opt_ref, step_size=1, gamma=0.8)
        self.lr_eng = torch.optim.lr_scheduler.StepLR(self.opt_eng, step_size=1, gamma=0.8)

    def step(self, step: int, skip: bool = False) -> dict[str, Any]:
        """One step of both; returns the weight error seen by this step's forward and how
        many groups the engine updated before ``finish_sync``."""
        x, y = batch(self.rank, step)
        before = _params(self.ref)
        self.opt_ref.zero_grad()
        F.cross_entropy(self.ddp(x), y).backward()
        if not skip:
            self.opt_ref.step()
        self.lr_ref.step()
        self.opt_eng.zero_grad()
        out = self.wrapped(x)  # the forward pre-hooks complete last step's all-gathers
        err = rel_err(_params(self.eng), before)
        F.cross_entropy(out, y).backward()
        engine = self.method.engine
        in_backward = len(engine.layer.updated)
        self.method.finish_sync()
        after_sync = len(engine.layer.updated)
        flag = self.method.nonfinite_flag()
        nonfinite = bool(flag) if flag is not None else False
        if nonfinite:
            self.method.skip_step(self.opt_eng)
        else:
            self.method.optimizer_step(self.opt_eng)
        self.lr_eng.step()
        return {
            "err": err,
            "in_backward": in_backward,
            "after_sync": after_sync,
            "nonfinite": nonfinite,
        }

    def final_err(self) -> float:
        self.method.flush()
        return rel_err(_params(self.eng), _params(self.ref))


def _against_ddp(opt_kind: str, steps: int, spec: str = "lee18:update=layer,threshold_mb=0,merge_below=0") -> dict[str, Any]:
    torch.manual_seed(100 + dist.get_rank())  # rank 0's weights must win the initial broadcast
    pair = Pair(spec, opt_kind, tiny_model())
    rows = [pair.step(s) for s in range(steps)]
    return {
        "errs": [r["err"] for r in rows] + [pair.final_err()],
        "in_backward": [r["in_backward"] for r in rows],
        "after_sync": [r["after_sync"] for r in rows],
        "groups": len(pair.method.engine.groups),
        "units": len(pair.method.engine.units),
        "layer_steps": pair.method.engine.layer.layer_steps,
    }


def test_fused_groups_update_per_group_and_still_match_ddp() -> None:
    """``threshold_mb``: layers fused into fewer groups (fewer collectives), each group's
    shard stepped as its exchange arrives; the weights stay DDP's."""
    steps = 4
    spec = "lee18:update=layer,threshold_mb=0.0004,merge_below=0"  # about 420 bytes: a few layers per group
    for r in run_distributed(_against_ddp, 2, "adamw", steps, spec, timeout=120):
        assert max(r["errs"]) <= schedule_tolerance(2, steps), r["errs"]
        assert 2 <= r["groups"] < r["units"], r
        assert r["after_sync"] == [0] + [r["groups"]] * (steps - 1)


def test_a_negative_fusion_threshold_is_refused_naming_the_option() -> None:
    with pytest.raises(UsageError, match="lee18: threshold_mb must be"):
        methods.create("lee18:threshold_mb=-1")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt_kind", ["momentum", "nesterov", "adamw"])
def test_per_layer_update_matches_ddp_after_every_step(world: int, opt_kind: str) -> None:
    steps = 5
    for r in run_distributed(_against_ddp, world, opt_kind, steps, timeout=120):
        assert max(r["errs"]) <= schedule_tolerance(world, steps), r["errs"]
        # step 0 learns the optimizer at optimizer_step; from then on every group is updated
        # group by group by the end of finish_sync (how many already in backward depends on
        # when each exchange arrived: not asserted, see the one-process test below)
        n = r["groups"]
        assert r["after_sync"] == [0] + [n] * (steps - 1)
        assert r["in_backward"][0] == 0 and all(0 <= b <= n for b in r["in_backward"])
        assert r["layer_steps"] == steps - 1 and n >= 4


# --- codecs: update=layer equals update=step bit for bit ---------------------------------------
LEE18_CODECS = [c for c in CODECS.names() if pairing_refusal("lee18", c) is None]


def _codec_spec(codec: str, update: str) -> str:
    opts = dict(HOOK_CASES).get(codec, {"start_iter": 1})
    return ",".join(
        [f"lee18:update={update},merge_below=0", f"compress={codec}"] + [f"{k}={v}" for k, v in opts.items()]
    )


def _weights_per_step(spec: str, steps: int) -> list[list[torch.Tensor]]:
    rank = dist.get_rank()
    model = make_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=dist.get_world_size()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        opt.zero_grad()
        (wrapped(x) - y).pow(2).mean().backward()
        method.finish_sync()
        method.optimizer_step(opt)
        method.flush()
        out.append(_params(model))
    assert method.engine.layer.layer_steps == (steps - 1 if "update=layer" in spec else 0), spec
    return out


def _codec_runs(steps: int) -> dict[str, Any]:
    return {
        c: {u: _weights_per_step(_codec_spec(c, u), steps) for u in ("layer", "step")}
        for c in LEE18_CODECS
    }


def test_per_layer_update_equals_end_of_step_update_with_every_codec_lee18_carries() -> None:
    assert LEE18_CODECS  # elementwise SUM codecs and every GATHER codec
    steps = 4
    for rank_runs in run_distributed(_codec_runs, 2, steps, timeout=240):
        for codec, runs in rank_runs.items():
            for step, (a, b) in enumerate(zip(runs["layer"], runs["step"])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (codec, step)
            assert any(
                not torch.equal(x, y) for x, y in zip(runs["layer"][-1], runs["layer"][0])
            ), codec


# --- non-finite steps: skipped exactly -----------------------------------------------------------
def _skip_nonfinite_first_layer(steps: int, bad: list[int]) -> dict[str, Any]:
    """At the steps ``bad`` rank 0's first-layer weight gradient is inf: every other group was
    already updated in backward; the skipped step must leave weights and state as DDP's."""
    torch.manual_seed(100 + dist.get_rank())
    pair = Pair("lee18:threshold_mb=0,merge_below=0", "adamw", tiny_model())
    first = next(pair.eng.parameters())
    rows = []
    for s in range(steps):
        hook = (
            first.register_hook(lambda g: g * float("inf")) if s in bad and pair.rank == 0 else None
        )
        rows.append(pair.step(s, skip=s in bad))
        if hook is not None:
            hook.remove()
    err = pair.final_err()
    state_err = 0.0
    for p_ref, p_eng in zip(pair.ref.parameters(), pair.eng.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            state_err = max(
                state_err, rel_err([pair.opt_eng.state[p_eng][k]], [pair.opt_ref.state[p_ref][k]])
            )
        assert float(pair.opt_eng.state[p_eng]["step"]) == float(pair.opt_ref.state[p_ref]["step"])
    return {
        "errs": [r["err"] for r in rows] + [err],
        "nonfinite": [r["nonfinite"] for r in rows],
        "after_sync": [rows[s]["after_sync"] for s in bad],
        "groups": len(pair.method.engine.groups),
        "state_err": state_err,
    }


def test_nonfinite_step_is_skipped_exactly_after_groups_were_updated_in_backward() -> None:
    steps, bad = 7, [2, 3, 5]  # skips in a row and after a normal step (snapshot buffers reused)
    for r in run_distributed(_skip_nonfinite_first_layer, 2, steps, bad, timeout=90):
        assert r["nonfinite"] == [s in bad for s in range(steps)]
        assert r["after_sync"] == [r["groups"]] * len(bad)  # every group was updated: all undone
        assert max(r["errs"]) <= schedule_tolerance(2, steps), r["errs"]
        assert r["state_err"] <= 2 * schedule_tolerance(2, steps)


# --- checkpoint mid-training ----------------------------------------------------------------------
def _resume(path: str, steps: int, stop: int) -> dict[str, Any]:
    torch.manual_seed(7)
    base = tiny_model()
    pair = Pair("lee18:update=layer,threshold_mb=0,merge_below=0", "nesterov", base)
    errs = [pair.step(s)["err"] for s in range(stop)]
    pair.method.flush()
    if pair.rank == 0:
        torch.save(
            {
                "model": pair.eng.state_dict(),
                "opt": pair.opt_eng.state_dict(),
                "sched": pair.lr_eng.state_dict(),
                "method": pair.method.state_dict(),
            },
            path,
        )
    dist.barrier()
    ckpt = torch.load(path, weights_only=False)
    pair.eng = tiny_model()
    pair.eng.load_state_dict(ckpt["model"])
    pair.opt_eng = make_optimizer("nesterov", pair.eng)
    pair.opt_eng.load_state_dict(ckpt["opt"])
    pair.lr_eng = torch.optim.lr_scheduler.StepLR(pair.opt_eng, step_size=1, gamma=0.8)
    pair.lr_eng.load_state_dict(ckpt["sched"])
    pair.method = methods.create("lee18:update=layer,threshold_mb=0,merge_below=0")
    pair.method.load_state_dict(ckpt["method"])
    pair.wrapped = pair.method.wrap(
        pair.eng, MethodContext(rank=pair.rank, world_size=dist.get_world_size())
    )
    rows = [pair.step(s) for s in range(stop, steps)]
    return {
        "errs": errs + [r["err"] for r in rows] + [pair.final_err()],
        "after_sync": [r["after_sync"] for r in rows],
        "groups": len(pair.method.engine.groups),
    }


def test_resume_from_a_mid_training_checkpoint_continues_exactly(tmp_path: Any) -> None:
    steps, stop = 6, 3
    path = os.path.join(str(tmp_path), "ckpt.pt")
    for r in run_distributed(_resume, 2, path, steps, stop, timeout=90):
        assert max(r["errs"]) <= schedule_tolerance(2, steps), r["errs"]
        # the resumed method learns the optimizer again at its first step
        assert r["after_sync"] == [0] + [r["groups"]] * (steps - stop - 1)


# --- one process: hyperparameters, fallbacks, misuse ---------------------------------------------
def _local(spec: str) -> tuple[Any, nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = tiny_model()
    method = methods.create(spec)
    return method, model, method.wrap(model, MethodContext())


def _one_step(
    method: Any,
    wrapped: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    clip: float | None = None,
) -> None:
    x, y = batch(0, step)
    opt.zero_grad()
    F.cross_entropy(wrapped(x), y).backward()
    method.finish_sync()
    if clip is not None:
        method.clip_grad_norm_(clip)
    method.optimizer_step(opt)


def test_each_group_is_updated_in_backward_as_soon_as_its_exchange_has_arrived() -> None:
    """One process: every exchange is complete at launch, so every group, the last one
    included, is updated inside ``backward()``, in launch (reverse forward) order."""
    method, model, wrapped = _local("lee18:threshold_mb=0,merge_below=0")
    opt = make_optimizer("momentum", model)
    _one_step(method, wrapped, opt, 0)
    x, y = batch(0, 1)
    opt.zero_grad()
    F.cross_entropy(wrapped(x), y).backward()
    n = len(method.engine.groups)
    assert method.engine.layer.updated == list(reversed(range(n)))
    method.finish_sync()
    assert method.engine.layer.updated == list(reversed(range(n)))  # nothing stepped twice
    method.optimizer_step(opt)
    assert method.engine.layer.updated == [] and method.engine.layer.layer_steps == 1


def test_hyperparameters_changed_between_steps_are_read_at_each_group_update() -> None:
    """lr and momentum set by hand between steps (and an LR schedule) reach the per-layer
    update exactly as they reach a plain optimizer.step()."""
    method, model, wrapped = _local("lee18:update=layer,threshold_mb=0,merge_below=0")
    plain = copy.deepcopy(model)
    opt, opt_plain = make_optimizer("nesterov", model), make_optimizer("nesterov", plain)
    for step in range(5):
        for o in (opt, opt_plain):
            o.param_groups[0]["lr"] = 0.1 / (step + 1)
            o.param_groups[0]["momentum"] = 0.5 if step == 3 else 0.9
        _one_step(method, wrapped, opt, step)
        x, y = batch(0, step)
        opt_plain.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt_plain.step()
    method.flush()
    assert method.engine.layer.layer_steps == 4
    assert rel_err(_params(model), _params(plain)) <= schedule_tolerance(1, 5)


def test_clipping_from_the_first_step_falls_back_to_the_end_of_step_update_with_a_warning() -> None:
    method, model, wrapped = _local("lee18:threshold_mb=0,merge_below=0")
    opt = make_optimizer("adamw", model)
    with pytest.warns(
        UserWarning, match="update=layer runs the end-of-step update instead: gradient clipping"
    ):
        for step in range(3):
            _one_step(method, wrapped, opt, step, clip=0.05)
    assert method.engine.layer.layer_steps == 0
    assert "gradient clipping" in method.describe()["update_fallbacks"][0]


def test_clipping_first_asked_after_a_per_layer_update_is_refused_in_one_line() -> None:
    method, model, wrapped = _local("lee18:update=layer,threshold_mb=0,merge_below=0")
    opt = make_optimizer("adamw", model)
    _one_step(method, wrapped, opt, 0)
    with pytest.raises(UsageError) as e:
        _one_step(method, wrapped, opt, 1, clip=0.05)
    assert "update=step" in str(e.value) and "\n" not in str(e.value)


def test_a_grad_scaler_makes_the_step_run_at_the_end_with_a_warning() -> None:
    method, model, wrapped = _local("lee18:update=layer,threshold_mb=0,merge_below=0")
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    method.attach_scaler(scaler)
    opt = make_optimizer("momentum", model)
    with pytest.warns(UserWarning, match="GradScaler"):
        for step in range(3):
            x, y = batch(0, step)
            opt.zero_grad()
            scaler.scale(F.cross_entropy(wrapped(x), y)).backward()
            assert method.engine.layer.updated == []
            method.finish_sync()
            method.optimizer_step(opt)
            scaler.update()
    assert method.engine.layer.layer_steps == 0


def test_forgetting_both_optimizer_step_and_skip_step_is_refused_at_the_next_backward() -> None:
    method, model, wrapped = _local("lee18:update=layer,threshold_mb=0,merge_below=0")
    opt = make_optimizer("momentum", model)
    _one_step(method, wrapped, opt, 0)
    x, y = batch(0, 1)
    F.cross_entropy(wrapped(x), y).backward()
    method.finish_sync()  # no optimizer_step / skip_step
    with pytest.raises(UsageError, match="neither optimizer_step nor skip_step"):
        F.cross_entropy(wrapped(x), y).backward()


def test_update_step_never_updates_in_backward_and_bad_values_are_refused() -> None:
    method, model, wrapped = _local("lee18:update=step,threshold_mb=0,merge_below=0")
    opt = make_optimizer("momentum", model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            _one_step(method, wrapped, opt, step)
    assert method.engine.layer.layer_steps == 0
    assert methods.create("lee18").options.update == "layer"  # the paper's behaviour by default
    with pytest.raises(UsageError, match="update='perlayer' is not valid; valid: layer, step"):
        methods.create("lee18:update=perlayer")

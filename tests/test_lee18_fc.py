"""lee18's model-parallel FC layers (``lee18:fc=...``) reproduce DDP and send what they count.

The reference is DDP on a copy of the same VGG-style model (a conv, then FC 512->1024->1024->10
on 8x8 inputs); every rank sees its own data. After every step each rank's partition must
equal DDP's rows of the same layer, and after ``flush`` the consolidated ``state_dict`` must
equal DDP's whole model. Tolerance: tests/tolerance.py's model, as in test_sched_correctness,
with the sum of one weight gradient over the global batch (world x rows terms) ordered
differently from DDP's per-rank sums plus all-reduce: ops = world * rows per step.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch._dynamo  # noqa: F401  (DDP imports it: once here, not in every forked rank)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.models import create
from lowcomm.parallel.fc import (
    ModelParallelLinear,
    choose_model_parallel,
    data_parallel_bytes,
    model_parallel_bytes,
)
from lowcomm.parallel.lee18_fc import AUTO_COST
from lowcomm.testing.distributed import run_distributed
from tolerance import tolerance

from test_sched_correctness import batch, make_optimizer, tiny_model

methods.names()
ROWS = 4  # samples per rank


def vgg_like() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(512, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def data(
    rank: int, step: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 3, 8, 8, generator=g).to(dtype), torch.randint(
        0, 10, (ROWS,), generator=g
    )


def worst(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in pairs)


def rows_of(ref: nn.Module, eng: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(engine value, DDP value) per parameter; a partition against DDP's rows of that layer."""
    out = []
    for m, ref_m in zip(eng.modules(), ref.modules()):
        for p, rp in zip(m.parameters(recurse=False), ref_m.parameters(recurse=False)):
            if isinstance(m, ModelParallelLinear):
                rp = rp[m.rank * m.rows : (m.rank + 1) * m.rows]
            out.append((p.detach(), rp.detach()))
    return out


def lockstep(
    spec: str,
    base: nn.Module,
    batch_of: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    opt_kind: str,
    steps: int,
    clip: float | None = None,
) -> tuple[list[float], Any, nn.Module, nn.Module]:
    """Train copies of ``base`` under DDP and under ``spec`` side by side on the same batches;
    return the worst row error after every step, the method, DDP's module and ours."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, eng = copy.deepcopy(base), copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref)
    method = methods.create(spec)
    wrapped = method.wrap(eng, MethodContext(rank=rank, world_size=world))
    opt_ref, opt_eng = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, eng)
    errs = []
    for step in range(steps):
        x, y = batch_of(rank, step)
        opt_ref.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt_ref.step()
        opt_eng.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        if clip is not None:
            method.clip_grad_norm_(clip)
        method.optimizer_step(opt_eng)
        method.flush()
        errs.append(worst(rows_of(ref, eng)))
    return errs, method, ref, eng


def compare(
    spec: str, opt_kind: str, steps: int, dtype: torch.dtype, clip: float | None = None
) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # different per rank: rank 0's weights must win everywhere
    base = vgg_like().to(dtype)
    errs, method, ref, eng = lockstep(
        spec, base, lambda r, step: data(r, step, dtype), opt_kind, steps, clip
    )
    full = eng.state_dict()
    errs.append(worst([(full[k], v) for k, v in ref.state_dict().items()]))
    # evaluation runs locally on the consolidated weights: the same logits as a plain model
    # holding them (the weights themselves were compared with DDP's above)
    plain = vgg_like().to(dtype)
    plain.load_state_dict(full)
    eng.eval()
    plain.eval()
    x, _ = data(rank, 99, dtype)
    with torch.no_grad():
        same_eval = torch.equal(eng(x), plain(x))
    return {
        "errs": errs,
        "same_eval": same_eval,
        "keys": sorted(full) == sorted(ref.state_dict()),
        "mp": method.describe()["fc_model_parallel"],
        "moved": worst(
            [(p.detach(), q.detach()) for p, q in zip(ref.parameters(), base.parameters())]
        ),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fc", ["model_parallel", "data_parallel"])
def test_lee18_fc_matches_ddp_every_step_with_sgd_and_adamw(world: int, fc: str) -> None:
    """SGD in float32; AdamW in float64: Adam divides each gradient element by sqrt(v) + eps,
    so an element whose sum over the batch cancels to ~eps keeps its rounding error at the
    scale of the largest term (condition number max|term| / eps ~ 1e5 here). Model
    parallelism sums each weight gradient over the global batch in one product and each input
    gradient over the ranks' partitions, another order than DDP's, so in float32 AdamW's
    first step already differs by ~1e-3 relative on such elements (measured), in float64 by
    ~1e-12: the same arithmetic, not a different update."""
    steps = 4
    for opt_kind, dtype in (("sgd", torch.float32), ("adamw", torch.float64)):
        tol = min(
            1e-6,
            tolerance(dtype, ops=world * ROWS * steps, cond=1e5 if opt_kind == "adamw" else 1.0),
        )
        results = run_distributed(compare, world, f"lee18:fc={fc}", opt_kind, steps, dtype)
        for r in results:
            assert max(r["errs"]) <= tol, (r["errs"], tol)
            assert r["keys"] and r["same_eval"] and r["moved"] > 1e-3
            # 1024-wide layers split over 2 and 4 ranks; the 10-class head only over 2
            expected = (
                [] if fc == "data_parallel" else ["4", "6"] + (["8"] if 10 % world == 0 else [])
            )
            assert r["mp"] == expected


def tiny_fc_run(spec: str, opt_kind: str, steps: int) -> float:
    """Worst per-step error of lee18 against DDP on test_sched_correctness's tiny model (the
    model every other schedule's exactness test uses), its FC layers model-parallel."""
    torch.manual_seed(100 + dist.get_rank())
    errs, method, _, _ = lockstep(spec, tiny_model(), batch, opt_kind, steps)
    assert method.describe()["fc_model_parallel"]  # some layer really is partitioned
    return max(errs)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("update", ["layer", "step"])
def test_model_parallel_fc_matches_ddp_to_1e6_in_float32_with_sgd_and_adamw(
    world: int, update: str
) -> None:
    """The issue's exactness target, float32, on the model the other schedules are held to it
    with: AdamW included, its FC layers partitioned."""
    steps = 6
    tol = min(1e-6, tolerance(torch.float32, ops=world * steps))
    for opt_kind in ("sgd", "adamw"):
        spec = f"lee18:fc=model_parallel,update={update}"
        for err in run_distributed(tiny_fc_run, world, spec, opt_kind, steps):
            assert err <= tol, (opt_kind, err, tol)


def adamw_against_exact(spec: str, steps: int) -> list[tuple[float, float]]:
    """Per step: (lee18's, DDP's) float32 distance from the exact step, a one-process float64
    AdamW on the concatenated global batch (what both promise to compute)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    base = vgg_like()
    ref, eng = copy.deepcopy(base), copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref)  # broadcasts rank 0's weights into ref
    exact = copy.deepcopy(ref).double()
    method = methods.create(spec)
    wrapped = method.wrap(eng, MethodContext(rank=rank, world_size=world))
    opts = [make_optimizer("adamw", m) for m in (ref, eng, exact)]
    out = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        x, y = data(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        opts[0].step()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opts[1])
        method.flush()
        xs, ys = zip(*(data(r, step, torch.float64) for r in range(world)))
        F.cross_entropy(exact(torch.cat(xs)), torch.cat(ys)).backward()
        opts[2].step()
        out.append((worst(rows_of(exact, eng)), worst(rows_of(exact, ref))))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_model_parallel_adamw_in_float32_is_as_close_to_the_exact_step_as_ddp(world: int) -> None:
    """On the large-FC model in float32 AdamW amplifies round-off: it divides each gradient
    element by sqrt(v) + eps, so an element whose batch sum cancels to ~eps moves by up to lr
    on a rounding difference, and a ReLU whose input rounds across 0 switches a whole row.
    DDP itself lands 2e-3 (first step) to 0.3 (fourth step, after such a switch) away from the
    exact float64 step, relative in the max-norm (measured); any other summation order,
    lee18's model-parallel one included, lands at a like distance, so 1e-6 against DDP is not a
    meaningful bar there (it holds in float64 and on the tiny model, above). The bar instead:
    at every step lee18 is no more than 10x farther from the exact step than DDP is (measured
    0.9-1.1x; a wrong update, e.g. a partition stepped twice, is far beyond it from step one)."""
    steps = 4
    for per_rank in run_distributed(adamw_against_exact, world, "lee18:fc=model_parallel", steps):
        for ours, ddps in per_rank:
            assert ours <= 10 * ddps, (ours, ddps)


def test_lee18_fc_with_the_end_of_step_update_matches_ddp_too() -> None:
    """``update=step`` (the whole shard update in the optimizer step) beside the default
    per-layer update: the model-parallel partitions are stepped the same way in both."""
    tol = min(1e-6, tolerance(torch.float32, ops=2 * ROWS * 3))
    for r in run_distributed(
        compare, 2, "lee18:fc=model_parallel,update=step", "sgd", 3, torch.float32
    ):
        assert max(r["errs"]) <= tol and r["mp"] == ["4", "6", "8"]


@pytest.mark.parametrize("world", [2, 4])
def test_clipping_by_the_global_norm_includes_the_partitions_and_matches_ddp(world: int) -> None:
    """clip 0.05 is below the gradient norm every step, so every step is clipped; a norm
    without the model-parallel rows would scale by another coefficient."""
    tol = min(1e-6, tolerance(torch.float32, ops=world * ROWS * 3))
    for r in run_distributed(
        compare, world, "lee18:fc=model_parallel", "sgd", 3, torch.float32, 0.05
    ):
        assert max(r["errs"]) <= tol and r["mp"] and r["same_eval"]


def counted_bytes(spec: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = vgg_like()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        before = accounting.ledger().as_dict()["by_tag"]
        x, y = data(rank, step)
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
        after = accounting.ledger().as_dict()["by_tag"]

    def delta(tag: str) -> int:
        return after.get(tag, {}).get("wire_bytes", 0) - before.get(tag, {}).get("wire_bytes", 0)

    return {
        "fc": delta("lee18.fc.fwd") + delta("lee18.fc.bwd"),
        "total": sum(delta(t) for t in after),
        "consolidate": delta("lee18.fc.consolidate"),
    }


def test_counted_fc_bytes_equal_the_formula_the_auto_choice_uses() -> None:
    world = 2
    mp, dp = (
        run_distributed(counted_bytes, world, f"lee18:fc={fc}")[0]
        for fc in ("model_parallel", "data_parallel")
    )
    layers = [(512, 1024), (1024, 1024), (1024, 10)]
    assert mp["fc"] == sum(model_parallel_bytes(i, o, ROWS, world) for i, o in layers)
    assert mp["consolidate"] == 0  # the full weights are never gathered during training
    saved = sum(data_parallel_bytes(i, o, world) for i, o in layers)
    assert dp["total"] - mp["total"] == saved - mp["fc"]


def test_vgg16_imagenet_fc_sends_over_5x_fewer_bytes_model_parallel() -> None:
    model = create("vgg16_imagenet")
    world, rows = 4, 8
    fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in fcs] == [
        (25088, 4096),
        (4096, 4096),
        (4096, 1000),
    ]
    mp = sum(model_parallel_bytes(m.in_features, m.out_features, rows, world) for m in fcs)
    dp = sum(data_parallel_bytes(m.in_features, m.out_features, world) for m in fcs)
    conv = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Conv2d) for p in m.parameters()
    )
    conv_bytes = data_parallel_bytes(conv, 1, world, bias=False)
    assert dp >= 5 * mp
    assert conv_bytes + dp >= 5 * (conv_bytes + mp)  # the whole iteration, too
    assert all(
        choose_model_parallel(m.in_features, m.out_features, rows, world, AUTO_COST) for m in fcs
    )


def test_auto_keeps_small_layers_data_parallel_and_refuses_bad_options() -> None:
    assert not choose_model_parallel(32, 16, 64, 2, AUTO_COST)  # activations outweigh weights
    assert not choose_model_parallel(4096, 1000, 8, 3, AUTO_COST)  # 1000 rows do not split over 3
    for bad in ("lee18:fc=tensor", "lee18:fc_batch=0"):
        with pytest.raises(UsageError, match="lee18: fc"):
            methods.create(bad)


def test_auto_follows_the_run_batch_and_keeps_fp16_loss_scaling_data_parallel() -> None:
    model = create("vgg16_imagenet")
    auto = methods.create("lee18")
    big = {name for name, _ in auto._choose(model, 4, MethodContext(batch_size=8))}
    assert big and all(name.startswith("classifier") for name in big)
    assert auto._choose(model, 4, MethodContext(batch_size=8, loss_scaling=True)) == []
    # a batch so large that moving its activations costs more than the weights: data-parallel
    assert auto._choose(model, 4, MethodContext(batch_size=1 << 20)) == []
    forced = methods.create("lee18:fc=model_parallel")
    assert forced._choose(model, 4, MethodContext(batch_size=8, loss_scaling=True))  # refused at attach_scaler


def stale_state_and_loading() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = vgg_like()
    method = methods.create("lee18:fc=model_parallel")
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(rank, 0)
    F.cross_entropy(wrapped(x), y).backward()
    method.finish_sync()
    out: dict[str, Any] = {}
    method.optimizer_step(opt)
    try:
        model.state_dict()
    except RuntimeError as e:
        out["stale"] = str(e)
    method.flush()
    full = model.state_dict()
    fresh = vgg_like()  # load the consolidated weights into a plain model and a partitioned one
    fresh.load_state_dict(full)
    again = copy.deepcopy(model)
    again.load_state_dict({k: v * 2 for k, v in full.items()})
    out["shapes"] = fresh.state_dict()["4.weight"].shape == (1024, 512)
    mp = again[4]
    out["sliced"] = torch.equal(
        mp.weight, 2 * full["4.weight"][mp.rank * mp.rows : (mp.rank + 1) * mp.rows]
    )
    return out


def test_stale_state_dict_is_refused_and_loading_slices_the_full_weight() -> None:
    for r in run_distributed(stale_state_and_loading, 2):
        assert "flush()" in r["stale"]
        assert r["shapes"] and r["sliced"]


def emulated_bytes(fc: str) -> dict[str, Any]:
    from lowcomm.runtime.emulated import emulate
    from lowcomm.sim.profile import LayerProfile, Profile
    from lowcomm.sim.profiler import parameter_layers

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = vgg_like()
    layers = [
        LayerProfile(n, 1e-4, 1e-4, [list(p.shape) for p in ps])
        for n, _, ps in parameter_layers(model)
    ]
    x, y = data(rank, 0)
    emulate(model, Profile(model="vgg_like", batch_size=ROWS, layers=layers), x, rank=rank)
    method = methods.create(f"lee18:fc={fc}")
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # the last step: its reduce-scatters and the previous step's all-gathers
        before = accounting.ledger().as_dict()["by_tag"]
        opt.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt)
        after = accounting.ledger().as_dict()["by_tag"]
    return {t: after[t]["wire_bytes"] - before.get(t, {}).get("wire_bytes", 0) for t in after}


def test_emulated_compute_keeps_the_model_parallel_exchanges_and_their_bytes() -> None:
    world = 2
    mp = run_distributed(emulated_bytes, world, "model_parallel")[0]
    layers = [(512, 1024), (1024, 1024), (1024, 10)]
    assert mp["lee18.fc.fwd"] + mp["lee18.fc.bwd"] == sum(
        model_parallel_bytes(i, o, ROWS, world) for i, o in layers
    )
    dp = run_distributed(emulated_bytes, world, "data_parallel")[0]
    assert "lee18.fc.fwd" not in dp
    saved = sum(data_parallel_bytes(i, o, world) for i, o in layers)
    assert sum(dp.values()) - sum(mp.values()) == saved - (mp["lee18.fc.fwd"] + mp["lee18.fc.bwd"])


def bf16_step() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = vgg_like()
    ref, eng = copy.deepcopy(base), copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref)
    method = methods.create("lee18:fc=model_parallel")
    wrapped = method.wrap(eng, MethodContext(rank=rank, world_size=world))
    opt_ref, opt_eng = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, eng))
    x, y = data(rank, 0)
    for model, opt in ((ddp, opt_ref), (wrapped, opt_eng)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        if model is wrapped:
            method.finish_sync()
            method.optimizer_step(opt)
        else:
            opt.step()
    method.flush()
    full = eng.state_dict()
    moved = [
        (full[k] - base.state_dict()[k], v - base.state_dict()[k])
        for k, v in ref.state_dict().items()
    ]
    return worst(moved)


def test_bf16_autocast_step_matches_ddp_to_bf16_rounding() -> None:
    """Under autocast both sides multiply in bfloat16; the updates (weights moved by one SGD
    step) agree to bfloat16's rounding of sums over the global batch (world x rows terms)."""
    for err in run_distributed(bf16_step, 2):
        assert err <= tolerance(torch.bfloat16, ops=2 * ROWS)


def test_run_summary_counts_the_whole_model_under_model_parallel_fc(tmp_path: Any) -> None:
    import json

    from lowcomm.cli import main
    from lowcomm.models import count_parameters, kwargs_for_data

    out = tmp_path / "summary.json"
    assert main(["train", "--nproc", "2", "--model", "mlp", "--data", "mnist1d", "--method",
                 "lee18:fc=model_parallel", "--steps", "2", "--no-eval", "--no-progress", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    model = create("mlp", **kwargs_for_data("mlp", input_shape=(40,)))
    assert summary["params"] == count_parameters(model)
    assert summary["grad_shapes"] == [list(p.shape) for p in model.parameters()]

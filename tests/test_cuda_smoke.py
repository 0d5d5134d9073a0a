"""GPU smoke suite (``make test-gpu``): every method family, hook, schedule and AMP on CUDA.

Tests marked ``cuda`` skip where ``torch.cuda.is_available()`` is false, so ``make test`` on a
CPU machine stays green. They check what the CPU suite cannot: that every tensor a method
creates lives on the training device and that every collective it issues is carried by the
process group's backend for that device.

* Trainer runs go through ``lowcomm train --device cuda`` in worker processes. With one GPU
  two ranks share it over gloo (``LOWCOMM_DIST_BACKEND=gloo``; NCCL refuses two ranks on one
  GPU); with two or more GPUs they use the default ``cpu:gloo,cuda:nccl``, and one test runs on
  NCCL *alone*, where any CPU collective left in a method would fail.
* Hook and engine bodies run on 2 ranks through ``@distributed(device="cuda")``, which spawns
  the ranks (a forked child cannot use CUDA once the parent has touched it).

The pytest process itself never allocates on the GPU. Results come back as plain numbers or
CPU tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from compress_testlib import HOOK_CASES as BASE_HOOK_CASES
from lowcomm import methods
from lowcomm.cli import main
from lowcomm.comm import accounting
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.sched.pairing import Mode, pairing_refusal
from lowcomm.testing import distributed, run_distributed


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpu_count()
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); `make test-gpu` on a GPU machine"
cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL needs one GPU per rank: needs 2 GPUs")
#: ranks sharing one GPU must talk over gloo; with one GPU per rank the trainer's default is used
SHARED_GPU_BACKEND = "gloo" if GPUS < 2 else None


# --- the trainer, one process and two ---------------------------------------------------------
TRAIN = ["--data", "mnist1d", "--batch-size", "128", "--lr", "0.05", "--threads", "1",
         "--device", "cuda", "--quiet", "--no-progress"]

#: small payload options, by the option's name: a codec is configured by the fields it
#: declares (compress from step 2, a small rank or density), never by its own name
SMALL = {"rank": 2, "density": 0.05, "start_iter": 2}


def _small(options_cls: type) -> str:
    """``key=value,...`` of :data:`SMALL` for the fields ``options_cls`` has."""
    fields = {f.name for f in dataclasses.fields(options_cls)}
    return ",".join(f"{k}={v}" for k, v in SMALL.items() if k in fields)


def _spec(name: str, *options: str) -> str:
    """``name:opt,opt`` without empty parts."""
    opts = ",".join(o for o in options if o)
    return f"{name}:{opts}" if opts else name


def _plainest_engine_per_mode() -> list[str]:
    """One engine schedule per :class:`~lowcomm.sched.pairing.Mode` (the one with the fewest
    options: the mode's carrier without extra machinery), read from the method registry."""
    engines = [n for n in methods.names() if isinstance(getattr(methods.method_class(n), "mode", None), Mode)]
    chosen: dict[Mode, str] = {}
    for n in sorted(engines, key=lambda n: len(dataclasses.fields(methods.method_class(n).Options))):
        chosen.setdefault(methods.method_class(n).mode, n)
    return list(chosen.values())


#: every registered codec as a DDP hook method
CODEC_FAMILIES = [_spec(n, _small(codec_class(n).Options)) for n in CODECS.names()]
#: every codec each engine mode carries (``pairing_refusal`` is None), e.g. ``wfbp:compress=X``
ENGINE_CODEC_PAIRS = [_spec(e, f"compress={n}", _small(codec_class(n).Options))
                      for e in _plainest_engine_per_mode() for n in CODECS.names() if pairing_refusal(e, n) is None]

#: one or more per family: DDP all-reduce, each compressor, each engine schedule (with the
#: control collectives: MG-WFBP plan broadcast, DeAR tuning) alone and carrying each codec it
#: can, Pufferfish (rank broadcast)
FAMILIES = [
    "ssgd",
    *CODEC_FAMILIES,
    "wfbp",
    "mgwfbp:profile_iters=2",
    "dear",
    "dear:tune=true,tune_trials=2,tune_iters=2",
    "lee18",
    *ENGINE_CODEC_PAIRS,
    "pufferfish:warmup_epochs=1",
    "pufferfish:warmup_epochs=1,auto_switch=true",
]


def test_every_gpu_family_is_a_valid_method_and_every_codec_is_covered() -> None:
    """Runs without a GPU: the derived specs parse, and each codec appears as a hook method
    and in every engine mode that carries it."""
    for spec in FAMILIES:
        methods.create(spec)
    for name in CODECS.names():
        assert any(f.split(":")[0] == name for f in CODEC_FAMILIES), name
        for engine in _plainest_engine_per_mode():
            carried = any(f.startswith(f"{engine}:compress={name}") for f in ENGINE_CODEC_PAIRS)
            assert carried == (pairing_refusal(engine, name) is None), (engine, name)
    assert {methods.method_class(e).mode for e in _plainest_engine_per_mode()} == set(Mode)


def _train(tmp_path: Path, method: str, nproc: int, *extra: str) -> dict[str, Any]:
    out = tmp_path / "summary.json"
    argv = ["train", *TRAIN, "--model", "cnn1d", "--method", method, "--nproc", str(nproc),
            "--epochs", "2", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _check_summary(s: dict[str, Any], world: int) -> None:
    """Ran on the GPU, learned something, and (with 2 ranks) sent gradients, not only eval stats."""
    assert s["world_size"] == world
    assert s["device"].startswith("cuda")
    assert all(math.isfinite(h["test_loss"]) for h in s["history"] if "test_loss" in h)
    assert s["final_test_accuracy"] > 0.15  # 10 classes: chance is 0.1
    if world > 1:
        eval_bytes = s["traffic"]["by_tag"].get("eval", {}).get("wire_bytes", 0)
        assert s["bytes_sent_per_worker"] > eval_bytes > 0


@cuda
@needs_gpu
def test_one_process_training_runs_on_cuda(tmp_path: Path) -> None:
    _check_summary(_train(tmp_path, "ssgd", 1), world=1)


@pytest.fixture
def shared_gpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on one GPU: NCCL refuses that, so such runs go over gloo."""
    if SHARED_GPU_BACKEND:
        monkeypatch.setenv("LOWCOMM_DIST_BACKEND", SHARED_GPU_BACKEND)


@cuda
@needs_gpu
@pytest.mark.parametrize("method", FAMILIES)
def test_every_method_family_trains_on_cuda_with_two_ranks(method: str, tmp_path: Path, shared_gpu_backend: None) -> None:
    _check_summary(_train(tmp_path, method, 2), world=2)


@cuda
@needs_gpu
@pytest.mark.parametrize("method", ["ssgd", "powersgd:rank=2,start_iter=2", "dear"])
def test_amp_fp16_with_grad_scaler_trains_on_cuda(method: str, tmp_path: Path, shared_gpu_backend: None) -> None:
    _check_summary(_train(tmp_path, method, 2, "--amp"), world=2)


NCCL_ONLY = [
    "ssgd",
    "gtopk:density=0.05,start_iter=2",
    "mgwfbp:profile_iters=2",
    "dear:tune=true,tune_trials=2,tune_iters=2",
    "pufferfish:warmup_epochs=1,auto_switch=true",
]


@cuda
@needs_two_gpus
@pytest.mark.parametrize("method", NCCL_ONLY)
def test_no_collective_needs_a_cpu_backend_on_nccl_alone(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "nccl" alone registers no CPU backend: evaluation statistics, the unused-parameter
    # check, the MG-WFBP plan, DeAR's tuning and Pufferfish's ranks must all stay on the GPU
    monkeypatch.setenv("LOWCOMM_DIST_BACKEND", "nccl")
    _check_summary(_train(tmp_path, method, 2), world=2)


# --- every DDP hook with CUDA tensors, 2 ranks ------------------------------------------------
HOOK_CASES = [*BASE_HOOK_CASES, ("topk", {"start_iter": 1, "density": 0.1, "fast_select": True})]


def _rank_device(kind: str) -> torch.device:
    """This rank's GPU (bound by the harness), or the CPU for a dry run of the same body."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hook_run(method: str, options: dict[str, Any], kind: str = "cuda") -> dict[str, Any]:
    """Train a small MLP under ``method``'s hook on this rank's GPU; report CPU results."""
    from lowcomm.hooks import register

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = _rank_device(kind)
    torch.manual_seed(0)
    # wide enough for the fast top-k path (more than its 65,536-element sample)
    model = nn.Sequential(
        nn.Linear(64, 1100), nn.Tanh(), nn.Linear(1100, 64), nn.Tanh(), nn.Linear(64, 4)
    ).to(dev)
    ids = [dev.index] if dev.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=0.1)
    state = register(ddp, method, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator(device="cpu").manual_seed(10 + rank)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(32, 64, generator=gen).to(dev)
        y = torch.randn(32, 4, generator=gen).to(dev)
        F.mse_loss(ddp(x), y).backward()
        for p in model.parameters():
            assert p.grad is not None and p.grad.device == dev, "gradient left the GPU"
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert bool(torch.isfinite(grads).all())
        gathered = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(gathered, grads)
        assert all(torch.equal(gathered[0], g) for g in gathered[1:]), "ranks disagree"
        opt.step()
    sd = state.state_dict()  # checkpoints hold CPU tensors
    assert all(t.device.type == "cpu" for t in _tensors(sd))
    return {"wire_bytes": accounting.ledger().wire_bytes}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@cuda
@needs_gpu
@pytest.mark.parametrize(
    "method, options", HOOK_CASES, ids=[m + ("-fast" if o.get("fast_select") else "") for m, o in HOOK_CASES]
)
def test_every_hook_carries_cuda_tensors_on_two_gloo_ranks(method: str, options: dict[str, Any]) -> None:
    results = run_distributed(
        _hook_run, 2, method, options, timeout=300, device="cuda", backend="gloo"
    )
    assert all(r["wire_bytes"] > 0 for r in results)


# --- the engine schedules against DDP, on CUDA ------------------------------------------------
def _engine_vs_ddp(spec: str, steps: int = 4, kind: str = "cuda") -> float:
    """Largest relative parameter difference between ``spec`` and DDP after each step."""
    from lowcomm import methods
    from lowcomm.methods.base import MethodContext

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = _rank_device(kind)
    torch.manual_seed(100 + rank)  # different per rank: the engine must broadcast rank 0's
    base = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 3)
    )
    ref, eng = copy.deepcopy(base).to(dev), copy.deepcopy(base).to(dev)
    ids = [dev.index] if dev.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(ref, device_ids=ids)
    method = methods.create(spec)
    ctx = MethodContext(rank=rank, world_size=world, local_rank=dev.index or 0, device=dev)
    wrapped = method.wrap(eng, ctx)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_eng = torch.optim.SGD(eng.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(6, 16, generator=g).to(dev)
        y = torch.randint(0, 3, (6,), generator=g).to(dev)
        opt_ref.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt_ref.step()
        opt_eng.zero_grad()
        F.cross_entropy(wrapped(x), y).backward()
        method.finish_sync()
        method.optimizer_step(opt_eng)
        method.flush()
        for a, b in zip(eng.parameters(), ref.parameters()):
            assert a.device == dev
            worst = max(worst, float((a - b).abs().max() / (b.abs().max() + 1e-12)))
    return worst


@cuda
@needs_gpu
@pytest.mark.parametrize("spec", ["wfbp", "mgwfbp:profile_iters=1", "dear", "lee18"])
def test_engine_schedules_match_ddp_on_cuda(spec: str) -> None:
    errs = run_distributed(_engine_vs_ddp, 2, spec, timeout=300, device="cuda", backend="gloo")
    assert max(errs) < 1e-4, errs


# --- the spawned-rank harness itself (runs on CPU too) ----------------------------------------
@distributed(world_size=2, start_method="spawn", timeout=180)
def test_spawned_ranks_import_a_decorated_test_body_by_name() -> None:
    # the path every device="cuda" test takes, checked where no GPU is needed
    t = torch.ones(2)
    accounting.all_reduce(t, tag="spawned")
    assert torch.equal(t, torch.full((2,), 2.0))

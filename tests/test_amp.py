"""fp16/bf16 AMP with a GradScaler: compression state stays in unscaled units.

Why a special model. The property under test is the *bookkeeping* of the methods: with a
GradScaler the hooks see ``S * g`` and ``S`` changes during training; error-feedback memory
and Signum's momentum must equal what a run without AMP keeps. Comparing against a no-AMP
run of an ordinary network would mix that property with autocast's own round-off, which the
discrete compressors (signs, top-k selection) amplify into O(1) differences. So the model is
two linear heads with a loss linear in their outputs, fed with small integers: the weight
gradients ``T^T x`` do not depend on the weights and are exact in fp16 and bf16 (integers of
at most 4 bits times a power-of-two scale), so the AMP run's unscaled gradients are *equal*
to the no-AMP run's (asserted), and every difference that remains is the method's.

Tolerance (``tests/tolerance.py``): one rounding of the autocast dtype at the scale of the
tensor, ``eps(dtype) * max|expected|`` -- the most any single low-precision step of the AMP
path could contribute. Dividing and multiplying by a power-of-two scale is exact in fp32, so
a correct implementation differs by 0; state kept in scaled units is off by a factor of the
scale change (>= 2x, a relative error >= 1/2), far outside the bound.

The scale is forced to change in both directions: ``growth_interval=1`` doubles it after
every clean step, and at step 3 ``scaler.update(new_scale)`` drops it 16-fold.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowcomm.hooks
from compress_testlib import test_options
from lowcomm import methods
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.methods.base import MethodContext
from lowcomm.testing.distributed import distributed
from tolerance import assert_close_eps, eps

methods.names()  # import the method modules once, before the ranks fork

STEPS = 6
DROP_AT, DROPPED_SCALE = 3, 8.0  # scaler.update(new_scale) at this step
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class TwoHeads(nn.Module):
    """Two independent linear heads (two DDP buckets / engine groups), compressible at rank 2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 12)
        self.b = nn.Linear(16, 12)

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(xa), self.b(xb)


def exact_batch(rank: int, step: int) -> tuple[torch.Tensor, ...]:
    """Inputs in {-2..2}, targets in {-1, 0, 1}, batch 4: every gradient entry is an integer
    of magnitude <= 8, exact in bf16 (8-bit mantissa) and, times any scale <= 2^12, in fp16."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    xa, xb = (torch.randint(-2, 3, (4, 16), generator=g).float() for _ in range(2))
    ta, tb = (torch.randint(-1, 2, (4, 12), generator=g).float() for _ in range(2))
    return xa, ta, xb, tb


def linear_loss(out: tuple[torch.Tensor, torch.Tensor], ta: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:
    return (out[0] * ta).sum() + (out[1] * tb).sum()


def new_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)


def update(scaler: torch.amp.GradScaler, step: int) -> None:
    scaler.update(DROPPED_SCALE if step == DROP_AT else None)


def assert_scale_moved_both_ways(scales: list[float]) -> None:
    ups = sum(b > a for a, b in zip(scales, scales[1:]))
    downs = sum(b < a for a, b in zip(scales, scales[1:]))
    assert ups >= 2 and downs >= 1, scales


def assert_same_state(amp: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], dtype: torch.dtype, what: str) -> None:
    assert amp.keys() == plain.keys(), what
    for name in plain:
        assert_close_eps(amp[name], plain[name], dtype, ops=1, msg=f"{what} {name}")


# --- DDP comm hooks ------------------------------------------------------------------------------
#: every stateful codec (state must stay in unscaled units), with its small test options
HOOK_CASES: list[tuple[str, dict[str, Any]]] = [
    (name, {k: v for k, v in test_options(name).items() if k != "start_iter"})
    for name in CODECS.names() if codec_class(name).stateful
]


def _hook_run(method: str, options: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """Train TwoHeads under DDP with ``method``'s hook; AMP (autocast + GradScaler) iff
    ``dtype``. Records per step the unscaled gradients, the hook's state and the scale."""
    rank = dist.get_rank()
    model = TwoHeads()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)  # one head per bucket
    state = lowcomm.hooks.register(ddp, method, start_iter=1, **options)
    scaler = new_scaler() if dtype is not None else None
    state.attach_scaler(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec: dict[str, list[Any]] = {"grads": [], "state": [], "scales": []}
    for t in range(STEPS):
        xa, ta, xb, tb = exact_batch(rank, t)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = linear_loss(ddp(xa, xb), ta, tb)
        if scaler is not None:
            rec["scales"].append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        rec["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        if scaler is not None:
            scaler.step(opt)
            update(scaler, t)
        else:
            opt.step()
        rec["state"].append(copy.deepcopy(state.state_dict()))
    rec["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rec


@pytest.mark.parametrize("amp", list(DTYPES))
@pytest.mark.parametrize("method, options", HOOK_CASES, ids=[c[0] for c in HOOK_CASES])
@distributed(world_size=2)
def test_hook_state_under_amp_equals_the_no_amp_run_across_scale_changes(
    method: str, options: dict[str, Any], amp: str
) -> None:
    dtype = DTYPES[amp]
    plain = _hook_run(method, options, None)
    scaled = _hook_run(method, options, dtype)
    assert_scale_moved_both_ways(scaled["scales"])
    for t in range(STEPS):
        for name, g in plain["grads"][t].items():  # the premise: identical unscaled gradients
            assert torch.equal(scaled["grads"][t][name], g), (t, name)
        for table in ("memory", "p", "q"):  # EF memory / Signum momentum, low-rank factors
            if table in plain["state"][t]:
                assert_same_state(scaled["state"][t][table], plain["state"][t][table], dtype, f"step {t} {table}")
    assert plain["state"][-1]["memory"], "the method kept no state: nothing was compared"
    assert_same_state(scaled["weights"], plain["weights"], dtype, "weights")


# --- scheduling engine (its own optimizer step under the scaler) ---------------------------------
ENGINE_SPECS = [
    "wfbp:compress=acpsgd,rank=2,start_iter=1",
    "wfbp:compress=powersgd,rank=2,start_iter=1",
    "dear:compress=acpsgd,rank=2,start_iter=1,threshold_mb=0",
    "dear:threshold_mb=0",
    "lee18",
    "dear:compress=fp16,threshold_mb=0",
    "lee18:compress=bf16",
]


def _engine_run(spec: str, dtype: torch.dtype | None, *, bad_step: int | None = None) -> dict[str, Any]:
    """Train TwoHeads with an engine method through the trainer's life cycle; AMP iff
    ``dtype``. ``bad_step``: rank 1's loss is non-finite at that step."""
    rank = dist.get_rank()
    model = TwoHeads()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=dist.get_world_size()))
    scaler = new_scaler() if dtype is not None else None
    method.attach_scaler(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec: dict[str, list[Any]] = {"weights": [], "scales": [], "memory": []}
    for t in range(STEPS):
        xa, ta, xb, tb = exact_batch(rank, t)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = linear_loss(wrapped(xa, xb), ta, tb)
        if t == bad_step and rank == 1:
            loss = loss * float("inf")
        if scaler is not None:
            rec["scales"].append(scaler.get_scale())
            scaler.scale(loss).backward()
            method.finish_sync()
            method.unscale_(opt)
            method.optimizer_step(opt)
            if bad_step is None:
                update(scaler, t)
            else:  # only the overflow changes the scale downwards here
                scaler.update()
        else:
            loss.backward()
            method.finish_sync()
            method.optimizer_step(opt)
        method.flush()
        rec["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        codec = getattr(method, "codec", None)
        rec["memory"].append(codec.state_dict().get("memory", {}) if codec is not None else {})
    return rec


@pytest.mark.parametrize("spec", ENGINE_SPECS)
@distributed(world_size=2)
def test_engine_under_fp16_amp_updates_like_the_no_amp_run(spec: str) -> None:
    dtype = torch.float16
    plain = _engine_run(spec, None)
    scaled = _engine_run(spec, dtype)
    assert_scale_moved_both_ways(scaled["scales"])
    for t in range(STEPS):
        assert_same_state(scaled["weights"][t], plain["weights"][t], dtype, f"step {t} weights")
        assert_same_state(scaled["memory"][t], plain["memory"][t], dtype, f"step {t} codec memory")
    opts = dict(kv.split("=", 1) for kv in spec.partition(":")[2].split(",") if "=" in kv)
    if "compress" in opts and codec_class(opts["compress"]).stateful:
        assert plain["memory"][-1], "the codec kept no memory: nothing was compared"


@pytest.mark.parametrize("spec", ["dear:threshold_mb=0", "lee18", "dear:compress=acpsgd,rank=2,start_iter=1"])
@distributed(world_size=2)
def test_engine_skips_the_same_overflowing_step_on_every_rank_and_backs_off(spec: str) -> None:
    bad = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scheduler-before-optimizer kind, not ours
        rec = _engine_run(spec, torch.float16, bad_step=bad)
    weights = rec["weights"]
    for name, w in weights[bad].items():  # skipped: nothing moved, on either rank
        assert torch.equal(w, weights[bad - 1][name]), name
        assert torch.isfinite(weights[-1][name]).all(), name
        assert not torch.equal(weights[-1][name], w), f"{name}: training did not go on"
    scales = rec["scales"]
    assert scales[bad + 1] == scales[bad] / 2  # GradScaler's backoff
    final = torch.cat([w.reshape(-1) for w in weights[-1].values()])
    gathered = [torch.empty_like(final) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, final)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"


# --- the trainer and the CLI ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "amp, device, dtype",
    [
        (False, "cpu", None),
        (True, "cpu", torch.bfloat16),  # plain --amp: what it always meant
        (True, "cuda", torch.float16),
        ("auto", "cuda", torch.float16),
        ("fp16", "cpu", torch.float16),
        ("bf16", "cuda", torch.bfloat16),
    ],
)
def test_amp_option_keeps_plain_amp_meaning_and_selects_fp16_or_bf16(amp: Any, device: str, dtype: torch.dtype | None) -> None:
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.trainer import amp_dtype

    assert amp_dtype(TrainConfig(amp=amp), torch.device(device)) == dtype


def test_unknown_amp_value_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    assert main(["train", "--amp", "fp8", "--nproc", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--amp" in err and "fp16" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def _train_histories(method: str) -> dict[str, list[float]]:
    """Test losses per epoch of the same 2-epoch run without AMP and with fp16 + GradScaler."""
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.trainer import Trainer

    out = {}
    for amp in (False, "fp16"):
        cfg = TrainConfig(model="mlp", data="mnist1d", method=method, nproc=2, batch_size=128, lr=0.05,
                          epochs=2, amp=amp, threads=1, progress=False)
        trainer = Trainer(cfg)
        assert (trainer.scaler is not None) == (amp == "fp16")
        out[str(amp)] = [h["test_loss"] for h in trainer.run()["history"]]
        trainer.close()
    return out


@pytest.mark.parametrize(
    "method",
    [
        "dear:compress=acpsgd,start_iter=2",  # engine: its own step under the scaler
        "pufferfish:warmup_epochs=1,warmup_method=signum:start_iter=2",  # re-wrap at the switch
    ],
)
def test_fp16_amp_with_gradscaler_on_cpu_trains_methods_that_were_refused(method: str) -> None:
    """The trainer used to refuse fp16 AMP for methods with their own optimizer step.

    Bound: the AMP run differs from the fp32 run by autocast's round-off, at most one fp16
    rounding (eps(fp16) relative) per step carried into the weights, so ``steps * eps`` of
    the loss. An update left in scaled units (x 65536 at the initial scale) or a skip that
    differs between ranks is off by orders of magnitude.
    """
    from compress_testlib import run_ranks

    steps = 32  # 2 epochs of 16 steps (4000 samples, 2 workers, batch 128)
    for hist in run_ranks(_train_histories, 2, method, timeout=300):
        plain, amp = hist["False"], hist["fp16"]
        assert len(plain) == len(amp) == 2
        for a, p in zip(amp, plain):
            assert math.isfinite(a) and abs(a - p) <= steps * eps(torch.float16) * abs(p), (amp, plain)

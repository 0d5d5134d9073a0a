"""No host synchronization inside backward; exactly one per training step, after it.

On CUDA every Python-level read of a device tensor (``bool(t)``, ``t.item()``, ``float(t)``,
``t.tolist()``) waits for the stream to drain. One such read per bucket inside a DDP comm
hook (or per group in the engine) serializes backward with communication. There is no GPU
here, so the tests count those reads instead: :class:`HostReads` wraps the Tensor methods
that convert to Python values, in every thread (gloo runs future callbacks on its own
threads), and the hot paths must not call them at all. What this cannot see: syncs inside
C++ kernels (``nonzero``, boolean-mask indexing, blocking host-to-device copies), which need
a CUDA run with ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowcomm.hooks
from compress_testlib import HOOK_CASES, TINY_BUCKET_MB, make_model
from lowcomm import methods
from lowcomm.compress.base import device_paths
from lowcomm.methods.base import MethodContext
from lowcomm.runtime.config import TrainConfig
from lowcomm.testing.distributed import distributed

methods.names()

_READS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__", "numpy")


class HostReads:
    """Context manager counting device-to-host value reads of tensors (see module doc)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._saved: dict[str, Callable[..., Any]] = {}

    def _spy(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = "".join(traceback.format_stack(limit=4)[:-1])
            with self._lock:
                self.calls.append(f"Tensor.{name}\n{where}")
            return original(tensor, *args, **kwargs)

        return spy

    def __enter__(self) -> HostReads:
        # the CPU fast paths read CPU values on the host by design (free on a CPU); the paths
        # device tensors take are what this proxy checks, so CPU tensors take them inside
        self._paths = device_paths()
        self._paths.__enter__()
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._spy(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._paths.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.calls)

    def report(self) -> str:
        return "\n".join(self.calls[:3])


def test_host_read_counter_sees_the_reads_it_must_forbid() -> None:
    t = torch.ones(3)
    with HostReads() as reads:
        if t.sum():
            pass
        t.sum().item()
        float(t[0])
    assert reads.count == 3


# --- DDP comm hooks: nothing read inside backward ------------------------------------------------
HOOKS = HOOK_CASES


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "gradscaler"])
@pytest.mark.parametrize("method, options", HOOKS, ids=[h[0] for h in HOOKS])
@distributed(world_size=2)
def test_comm_hooks_read_nothing_on_the_host_during_backward(method: str, options: dict[str, Any], scaled: bool) -> None:
    """Warm-up step, compressed steps, and a step whose gradient is NaN on rank 1 (the
    NaN-policy branch: state kept, payload poisoned) -- on many buckets."""
    rank, bad_step, steps = dist.get_rank(), 2, 4
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=TINY_BUCKET_MB)
    state = lowcomm.hooks.register(ddp, method, **options)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0) if scaled else None
    state.attach_scaler(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    finite = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (ddp(torch.randn(16, 8, generator=gen)) - torch.randn(16, 4, generator=gen)).pow(2).mean()
        if step == bad_step and rank == 1:
            loss = loss * float("nan")
        with HostReads() as reads:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        assert reads.count == 0, f"step {step}: {reads.count} host reads in backward:\n{reads.report()}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            finite.append(state.check_finite())  # the one read, after backward
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif finite[-1]:
            opt.step()
    assert finite == [s != bad_step for s in range(steps)]  # the same on both ranks


# --- scheduling engine: nothing read from backward to the end of finish_sync / unscale_ ----------
ENGINE = [
    "wfbp:compress=acpsgd,rank=2,start_iter=1",
    "wfbp:compress=powersgd,rank=2,start_iter=1",
    "dear:compress=acpsgd,rank=2,start_iter=1",
    "dear",
    "lee18",
    "lee18:threshold_mb=0,merge_below=0",  # one group per layer: every group's hooks and updates in backward
    # the engine's cast, gathered and point-to-point paths (issue 11)
    "dear:compress=fp16",
    "lee18:compress=bf16",
    "wfbp:compress=topk,density=0.1,start_iter=1",
    "dear:compress=signsgd,start_iter=1",
    "lee18:compress=qsgd,start_iter=1",
    "mgwfbp:compress=gtopk,density=0.1,start_iter=1,alpha=1.0,beta=0.0",
]


@pytest.mark.parametrize("spec", ENGINE)
@distributed(world_size=2)
def test_engine_reads_nothing_during_backward_and_one_value_for_the_scaled_step(spec: str) -> None:
    rank, steps = dist.get_rank(), 4
    model = make_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=dist.get_world_size()))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    method.attach_scaler(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (wrapped(torch.randn(16, 8, generator=gen)) - torch.randn(16, 4, generator=gen)).pow(2).mean()
        with HostReads() as reads:
            scaler.scale(loss).backward()
            method.finish_sync()
            method.unscale_(opt)
        # the first finish_sync reads one count: the refusal of unused parameters
        assert reads.count == (1 if step == 0 else 0), f"step {step}:\n{reads.report()}"
        with HostReads() as reads:
            method.optimizer_step(opt)  # GradScaler's own skip decision: its one read
            scaler.update()
        assert reads.count == 1, f"step {step}:\n{reads.report()}"
    method.flush()


# --- the trainer: one read per step, and a non-finite step is skipped everywhere -----------------
@pytest.mark.parametrize("method", ["acpsgd:start_iter=1,rank=2", "signum:start_iter=1", "dear:compress=acpsgd,start_iter=1,rank=2"])
@distributed(world_size=2)
def test_trainer_reads_one_value_per_step_and_skips_a_nonfinite_step_on_every_rank(method: str) -> None:
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(model="mlp", data="mnist1d", method=method, nproc=2, batch_size=32, steps=6,
                      eval=False, progress=False, threads=1)
    trainer = Trainer(cfg)
    rank, bad_step = dist.get_rank(), 3
    batches = trainer.train_batches.epoch(0)
    lrs = []
    for step in range(cfg.steps or 0):
        x, y = next(batches)
        if step == bad_step and rank == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        trainer.method.flush()
        before = [p.detach().clone() for p in trainer.raw.parameters()]
        with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
            warnings.simplefilter("always")
            trainer.train_step(x, y)
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        if step > 0:  # step 0: the engine's unused-parameter check reads its count once
            assert reads.count == 1, f"step {step}: {reads.count} reads\n{reads.report()}"
        trainer.method.flush()
        after = list(trainer.raw.parameters())
        moved = any(not torch.equal(a, b) for a, b in zip(after, before))
        warned = any("non-finite" in str(w.message) for w in caught)
        assert moved == (step != bad_step), f"step {step}: weights moved={moved}"
        assert warned == (step == bad_step), f"step {step}: warned={warned}"
        assert all(torch.isfinite(p).all() for p in after)
    assert len(set(lrs)) > 1  # the schedule kept advancing through the skipped step
    trainer.close()

"""Seconds PyTorch's own DDP comm hooks take on a model's gradients, measured through DDP.

Why measured and not priced: ``powerSGD_hook`` is per-tensor torch code (copies into its
buffers, a ``torch.matmul`` and a column-by-column Gram-Schmidt per matrix, the error feedback
as whole-bucket passes), and pricing its declared work with the profile's kernel constants put
the ``torch_powersgd`` rows of an emulated ResNet-50 run 23-26 % fast (docs/simulator.md 5.3).
A hook cannot be called without a ``GradBucket``, which only DDP builds, so the hook runs in a
one-process DDP over parameters of the model's gradient shapes with a loss whose backward is
one multiply per element: the time from the hook's call to its future's last callback is the
hook's work (its all-reduces, on one process, return at once). One bucket, as
:class:`lowcomm.methods.reference.TorchPowerSGD` runs on gloo.

Skipped (an empty result: the simulator then prices the hooks' work) when a process group is
already up, since a second default group cannot be started beside it.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.methods.reference import as_comm_hook

#: the rank ``powerSGD_hook`` is measured at (the method's default); another rank's hook has no
#: entry in ``Profile.compressors`` and is priced from the kernel constants
POWERSGD_RANK = 4
FP16_KEY = "torch_fp16"


def powersgd_key(rank: int) -> str:
    """The ``Profile.compressors`` key of ``powerSGD_hook`` measured at ``rank``."""
    return f"torch_powersgd.rank{rank}"


#: steps before timing: PowerSGD's dense start steps (``start_powerSGD_iter`` = 2) and one more
WARM_STEPS = 3


def measure_torch_hooks(shapes: Sequence[Sequence[int]], device: torch.device | str = "cpu", *,
                        reps: int = 3) -> dict[str, dict[str, float]]:
    """``{key: {"hook_s_per_elem": s}}`` for ``fp16_compress_hook`` and ``powerSGD_hook``
    (rank :data:`POWERSGD_RANK`, error feedback, warm start) on one bucket of ``shapes``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    numel = sum(math.prod(s) for s in shapes)
    if numel == 0 or not dist.is_available() or dist.is_initialized():
        return {}
    try:
        if device.type == "cuda":
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        else:  # one worker thread: the barrier below then drains every callback before it
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's own, untyped
            options._threads = 1
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, pg_options=options)
    except Exception as e:  # noqa: BLE001 - the hooks are then priced; say why
        warnings.warn(f"PyTorch's comm hooks not timed (no one-process group: {e}); the simulator prices them",
                      stacklevel=2)
        return {}
    group = dist.group.WORLD  # held until every other reference is gone (see below)
    try:
        def powersgd_state() -> Any:
            return ps.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                    start_powerSGD_iter=2, min_compression_rate=2.0,
                                    use_error_feedback=True, warm_start=True)

        fp16 = _hook_seconds(shapes, device, None, default_hooks.fp16_compress_hook, reps)
        low_rank = _hook_seconds(shapes, device, powersgd_state(), ps.powerSGD_hook, reps)
    finally:
        # The hooks' future callbacks (PowerSGD's hold the group) run and are freed on gloo's
        # worker thread; if it dropped the group's last reference, the group's destructor would
        # join that very thread and abort the process ("Resource deadlock avoided": seen as a
        # crash of the test suite seconds later). So one last collective drains the worker's
        # queue, the rest is collected here, and the last reference is this thread's.
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        gc.collect()
        dist.destroy_process_group()
        del group
    return {FP16_KEY: {"hook_s_per_elem": fp16 / numel},
            powersgd_key(POWERSGD_RANK): {"hook_s_per_elem": low_rank / numel}}


def _hook_seconds(shapes: Sequence[Sequence[int]], device: torch.device, hook_state: Any,
                  hook: Callable[[Any, Any], Any], reps: int) -> float:
    """Median seconds of ``hook`` on one DDP bucket holding gradients of ``shapes``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = nn.ParameterList([nn.Parameter(torch.randn(*s, generator=gen).to(device)) for s in shapes if math.prod(s)])
    weights = [torch.randn(p.shape, generator=gen).to(device) for p in params]
    model = _Weighted(params, weights)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                              bucket_cap_mb=1e5)
    spans: list[float] = []

    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            spans.append(time.perf_counter() - start)
            return fut.value()

        return hook(state, bucket).then(done)

    ddp.register_comm_hook(hook_state, as_comm_hook(timed))
    for _ in range(WARM_STEPS + reps):
        ddp().backward()
        for p in params:
            p.grad = None
    return statistics.median(spans[WARM_STEPS:])


class _Weighted(nn.Module):
    """``sum_i <w_i, p_i>``: each parameter's gradient is its fixed random weight, in one pass."""

    def __init__(self, params: nn.ParameterList, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = params
        self.weights = weights

    def forward(self) -> torch.Tensor:
        return torch.stack([(p * w).sum() for p, w in zip(self.params, self.weights)]).sum()

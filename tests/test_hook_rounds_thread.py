"""A codec's rounds (gTop-k's exchanges, PowerSGD's P) run on the hook's own thread, beside
backward, on CPU workers over gloo: the same result as in the hook's call, the run says where
they ran, and the simulator replays it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods
from lowcomm.bench.prediction import rounds_beside_of
from lowcomm.comm import transport
from lowcomm.comm.hooks import state as hook_state
from lowcomm.compress.codec import codec_class
from lowcomm.methods.base import MethodContext
from lowcomm.testing import distributed

OPTIONS = {"gtopk": "gtopk:start_iter=0,sparsity_warmup=0,density=0.1", "powersgd": "powersgd:start_iter=0,rank=2"}


def _train(spec: str, steps: int = 3) -> tuple[dict[str, Any], list[torch.Tensor], set[str]]:
    """``steps`` steps of a 3-layer model in many DDP buckets; the method's description, the
    gradients after each step and the names of the threads that ran the codec's rounds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    method = methods.create(spec)
    ctx = MethodContext(rank=dist.get_rank(), world_size=dist.get_world_size(), bucket_cap_mb=0.01)
    wrapped = method.wrap(model, ctx)
    threads: set[str] = set()
    run_rounds = transport.run_rounds

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return run_rounds(*args, **kwargs)

    transport.run_rounds = spy  # type: ignore[assignment]
    grads = []
    try:
        for step in range(steps):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
            wrapped(x).pow(2).mean().backward()
            method.finish_sync()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            model.zero_grad()
    finally:
        transport.run_rounds = run_rounds  # type: ignore[assignment]
    return method.describe(), grads, threads


@distributed(world_size=2)
@pytest.mark.parametrize("codec", ["gtopk", "powersgd"])
def test_rounds_run_on_the_hooks_thread_with_the_result_of_the_hooks_own_call(codec: str) -> None:
    beside_info, beside, beside_threads = _train(OPTIONS[codec])
    assert beside_info["codec_rounds"] == "thread" and rounds_beside_of({"method_info": beside_info})
    assert beside_threads and all(name.endswith("-rounds") for name in beside_threads)
    original = hook_state.rounds_beside
    hook_state.rounds_beside = lambda *args: False  # type: ignore[assignment]
    try:
        in_hook_info, in_hook, in_hook_threads = _train(OPTIONS[codec])
    finally:
        hook_state.rounds_beside = original  # type: ignore[assignment]
    assert in_hook_info["codec_rounds"] == "hook" and not rounds_beside_of({"method_info": in_hook_info})
    assert in_hook_threads == {threading.main_thread().name}
    for a, b in zip(beside, in_hook, strict=True):  # the same arithmetic in the same order
        assert torch.equal(a, b)


@distributed(world_size=2)
def test_codecs_without_rounds_and_emulated_compute_keep_the_hooks_call() -> None:
    info, _, threads = _train("topk:start_iter=0,sparsity_warmup=0,density=0.1", steps=2)
    assert "codec_rounds" not in info and threads == {threading.main_thread().name}  # one message
    model = nn.Linear(4, 4)
    gtopk = codec_class("gtopk")(world=2, rank=dist.get_rank())
    assert hook_state.rounds_beside(gtopk, model, None)
    assert not hook_state.rounds_beside(gtopk, model, dist.new_group([0, 1]))  # a group of its own: in the hook
    mark = "_lowcomm_emulation"  # what lowcomm.runtime.emulated.emulate sets on the model
    setattr(model, mark, object())
    assert not hook_state.rounds_beside(gtopk, model, None)  # stands for a GPU, whose rounds block

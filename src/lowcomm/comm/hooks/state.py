"""Base class of every compression comm hook: bucket layout, step counter, warm-up, state.

Ordering rule (why these hooks work with any number of buckets on gloo): DDP calls the hook
for bucket 0, 1, 2, ... in the same order on every rank, on the autograd thread. Our hooks
issue *every* collective synchronously from inside that call. Future callbacks only decode
(tensor math), never communicate. PyTorch's ``powerSGD_hook`` launches its second
all-reduce from a callback, whose timing differs across ranks, so with several buckets the
ranks' collective sequences diverge and gloo fails; here that cannot happen.

Per-step counter: advanced after the hook of the bucket DDP marks ``is_last()``, so it counts
synchronized iterations (``no_sync()`` steps never call the hook and are not counted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.runtime import timing

Future = torch.futures.Future


def done_future(t: torch.Tensor) -> Future[torch.Tensor]:
    fut: Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def poison(payload: list[torch.Tensor]) -> None:
    """Make a payload decode to non-finite values (NaN policy, see compress.feedback)."""
    for t in payload:
        if t.is_floating_point():
            t.fill_(float("nan"))


class HookState(ABC):
    """Shared plumbing; subclasses implement :meth:`compressed_hook`."""

    name: ClassVar[str] = "hook"
    Options: ClassVar[type] = object
    #: ``"all_reduce"`` or ``"all_gather"`` (or ``"p2p"`` for gtopk): the aggregation kind.
    aggregation: ClassVar[str] = "all_reduce"

    def __init__(self, ddp: nn.Module, options: Any, *, process_group: Any = None) -> None:
        self.options = options
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.step = 0
        module = getattr(ddp, "module", ddp)
        named = list(module.named_parameters())
        self._param_name = {id(p): n for n, p in named}
        self.param_index = {n: i for i, (n, _) in enumerate(named)}

    # --- the hook -------------------------------------------------------------------------
    def __call__(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        start = int(getattr(self.options, "start_iter", 0))
        if self.step < start:
            fut = self.allreduce_mean(bucket.buffer(), tag=f"{self.name}.warmup")
        else:
            fut = self.compressed_hook(bucket)
        if bucket.is_last():
            self.step += 1
        return fut

    @abstractmethod
    def compressed_hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        """One bucket once the method compresses (after ``start_iter``)."""

    def allreduce_mean(self, buf: torch.Tensor, *, tag: str) -> Future[torch.Tensor]:
        world = self.world
        work = accounting.all_reduce(buf, group=self.group, async_op=True, tag=tag)
        return work.get_future().then(lambda f: f.value()[0].div_(world))

    # --- helpers ---------------------------------------------------------------------------
    def layout(self, bucket: dist.GradBucket) -> tuple[list[str], list[int], list[torch.Size]]:
        """Parameter names, sizes and shapes of the bucket, in buffer order."""
        params = bucket.parameters()
        names = [self._param_name.get(id(p), f"?{i}") for i, p in enumerate(params)]
        sizes = [p.numel() for p in params]
        shapes = [p.shape for p in params]
        if sum(sizes) != bucket.buffer().numel():
            raise RuntimeError("bucket buffer does not match its parameters (sparse gradients?)")
        return names, sizes, shapes

    def timed(self) -> Any:
        return timing.measure("compress")

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"method": self.name, "step": self.step, "options": dataclasses.asdict(self.options)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("method", self.name) != self.name:
            raise ValueError(f"state is for method {state.get('method')!r}, not {self.name!r}")
        self.step = int(state["step"])


def run_hook(state, bucket):  # type: ignore[no-untyped-def]
    """The function handed to ``ddp.register_comm_hook(state, run_hook)``.

    Deliberately unannotated: DDP checks the ``bucket`` and return annotations against the
    real classes, and ``from __future__ import annotations`` would turn them into strings.
    """
    return state(bucket)

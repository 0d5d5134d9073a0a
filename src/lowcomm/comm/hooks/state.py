"""Base class of every compression comm hook: bucket layout, step counter, warm-up, state.

Ordering rule (why these hooks work with any number of buckets on gloo): DDP calls the hook
for bucket 0, 1, 2, ... in the same order on every rank, on the autograd thread. Our hooks
issue *every* collective synchronously from inside that call. Future callbacks only decode
(tensor math), never communicate. PyTorch's ``powerSGD_hook`` launches its second
all-reduce from a callback, whose timing differs across ranks, so with several buckets the
ranks' collective sequences diverge and gloo fails; here that cannot happen.

Per-step counter: advanced after the hook of the bucket DDP marks ``is_last()``, so it counts
synchronized iterations (``no_sync()`` steps never call the hook and are not counted).

No host synchronization inside a hook: "is this bucket finite?" is a device-side flag that
steers branch-free state updates and poisons the payload (see :mod:`lowcomm.compress.feedback`).
Each bucket's *aggregated* result notes a flag in :attr:`HookState.finite_flags`; after
backward, :attr:`HookState.nonfinite_this_step` is one device tensor for the whole step and
:meth:`HookState.check_finite` is the single host read (with the warning) that a training
loop without a GradScaler uses to skip the optimizer step. With a GradScaler nothing is read
here: the poisoned aggregate reaches ``p.grad`` and the scaler's own inf check skips the step.

AMP: :meth:`HookState.attach_scaler` gives the hook the GradScaler; stateful methods then
keep their state in unscaled units (:mod:`lowcomm.comm.amp`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.comm.amp import current_scale
from lowcomm.compress.feedback import StepFlags, finite_flag, poison_, warn_nonfinite
from lowcomm.runtime import timing

Future = torch.futures.Future


def done_future(t: torch.Tensor) -> Future[torch.Tensor]:
    fut: Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def poison(payload: list[torch.Tensor], finite: torch.Tensor) -> None:
    """Make a payload decode to non-finite values when the 0-dim flag ``finite`` is False
    (NaN policy, see compress.feedback); branch-free, no host sync."""
    for t in payload:
        poison_(t, finite)


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
        #: optional ``torch.amp.GradScaler``: stateful methods then work in unscaled units
        self.scaler: Any = None
        #: finiteness of every bucket's aggregated result in the current (or last) step
        self.finite_flags = StepFlags()
        self._flags_step = -1
        self._scale: torch.Tensor | None = None
        module = getattr(ddp, "module", ddp)
        named = list(module.named_parameters())
        self._param_name = {id(p): n for n, p in named}
        self.param_index = {n: i for i, (n, _) in enumerate(named)}

    # --- the hook -------------------------------------------------------------------------
    def __call__(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        if self._flags_step != self.step:  # first bucket of a synchronized step
            self._flags_step = self.step
            self.finite_flags.clear()
            self._scale = current_scale(self.scaler, bucket.buffer().device)
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

        def mean(fut: Future[Any]) -> torch.Tensor:
            out = fut.value()[0].div_(world)
            self.note_aggregate(out)
            return out

        return work.get_future().then(mean)

    # --- AMP and the NaN/Inf policy ---------------------------------------------------------
    def attach_scaler(self, scaler: Any) -> None:
        """Use ``scaler``'s loss scale from the next step on (None: gradients are unscaled)."""
        self.scaler = scaler

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """The current step's loss scale (0-dim device tensor), None without AMP."""
        return self._scale

    def note_aggregate(self, out: torch.Tensor) -> None:
        """Record whether a bucket's synchronized result is finite (device flag, no sync)."""
        self.finite_flags.note(finite_flag(out))

    @property
    def nonfinite_this_step(self) -> torch.Tensor | None:
        """0-dim bool device tensor: some bucket of the last synchronized step came out
        non-finite (on every rank alike: the payload of a non-finite input is poisoned).
        None before the first step. Reading it as a Python bool is a host sync."""
        return self.finite_flags.nonfinite()

    def check_finite(self) -> bool:
        """One host read for the whole step (call it after backward, not in a hook): True if
        the synchronized gradient is finite; otherwise warn and return False so the caller
        skips the optimizer step (the method's state was already left unchanged)."""
        bad = self.nonfinite_this_step
        if bad is None or not bool(bad):
            return True
        warn_nonfinite(f"{self.name} state left unchanged in step {self.step - 1}")
        return False

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

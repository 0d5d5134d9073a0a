"""Gradient-compression methods for ``--method``: fp16, bf16, signsgd, signum, topk, gtopk,
powersgd, acpsgd. Each is DDP plus one comm hook from :mod:`lowcomm.comm.hooks`; options are
the hook's options dataclass (``topk:density=0.01,start_iter=10``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from lowcomm import hooks
from lowcomm.comm.hooks import HOOKS, HookState
from lowcomm.methods import register
from lowcomm.methods.base import Method


class CompressionMethod(Method):
    """DDP + the comm hook named like the method; state is the hook's state."""

    hook_name: ClassVar[str] = ""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.hook_state: HookState | None = None
        self._pending: dict[str, Any] | None = None

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        group = self.ctx.process_group if self.ctx else None
        self.hook_state = hooks.register(ddp, self.name, process_group=group, **dataclasses.asdict(self.options))
        if self._pending is not None:
            self.hook_state.load_state_dict(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, Any]:
        if self.hook_state is not None:
            return self.hook_state.state_dict()
        return dict(self._pending or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.hook_state is not None:
            self.hook_state.load_state_dict(state)
        else:
            self._pending = state


def _make(name: str, doc: str) -> type[Method]:
    cls = type(
        f"{name.capitalize()}Method",
        (CompressionMethod,),
        # aggregation: "all_reduce", "all_gather", or "p2p" (gtopk's recursive doubling)
        {"name": name, "Options": HOOKS[name].Options, "aggregation": HOOKS[name].aggregation, "__doc__": doc},
    )
    return register(cls)


FP16 = _make("fp16", "All-reduce gradients cast to float16 (2 bytes per element).")
BF16 = _make("bf16", "All-reduce gradients cast to bfloat16 (2 bytes per element).")
SIGNSGD = _make("signsgd", "EF-SignSGD: scaled signs packed 8 per byte, all-gathered, residual memory.")
SIGNUM = _make("signum", "Signum: momentum then sign; majority vote across workers.")
TOPK = _make("topk", "Top-k sparsification with residual memory; values + int32 indices all-gathered.")
GTOPK = _make("gtopk", "Global top-k by recursive doubling (log2 P rounds of k pairs).")
POWERSGD = _make("powersgd", "PowerSGD: rank-r P/Q factors, two all-reduces, warm start, error feedback.")
ACPSGD = _make("acpsgd", "ACP-SGD: alternating P/Q factor, one all-reduce per bucket per step.")

"""Gradient-compression methods for ``--method``: fp16, bf16, signsgd, signum, topk, gtopk,
powersgd, acpsgd. Each is DDP plus one comm hook from :mod:`lowcomm.comm.hooks`; options are
the hook's options dataclass (``topk:density=0.01,start_iter=10``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm import hooks
from lowcomm.comm.hooks import HOOKS, HookState
from lowcomm.methods import register
from lowcomm.methods.base import Method, OptimizerOverride


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
        self.hook_state.attach_scaler(self.scaler)
        if self._pending is not None:
            self.hook_state.load_state_dict(self._pending)
            self._pending = None

    def attach_scaler(self, scaler: Any) -> None:
        """Stateful hooks keep memory/momentum in unscaled units (see Method.attach_scaler)."""
        super().attach_scaler(scaler)
        if self.hook_state is not None:
            self.hook_state.attach_scaler(scaler)

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The hook's device flag for the last synchronized step (no host sync)."""
        return self.hook_state.nonfinite_this_step if self.hook_state is not None else None

    # --- optimizer settings -------------------------------------------------------------------
    def optimizer_overrides(self, cfg: Any) -> list[OptimizerOverride]:
        """A hook that keeps its own momentum (Signum: ``m = beta m + (1 - beta) g``, the sign
        of ``m`` sent) needs SGD without momentum: SGD momentum on top compounds the two
        (measured on MNIST-1D: 56 % against ``ssgd``'s 92 %; docs/compression.md).

        The learning rate becomes ``lr * (1 + mu)``: plain SGD at that rate has the same
        stability limit (curvature below ``2 (1 + mu) / lr``) as the heavy-ball SGD it
        replaces, so it is as safe on any model. Keeping the full effective step
        ``lr / (1 - mu)`` gives up that margin: it was best on the 8 k-parameter cnn1d and
        lost 10 points on the 256-channel one, so it is left to the user (``--lr``).
        Error-feedback hooks ask for nothing: SGD momentum after them was worse on one model
        and better on the other (docs/compression.md), a tuning question, not a conflict.
        """
        own = getattr(self.options, "momentum", None)
        if cfg.optimizer != "sgd" or cfg.momentum == 0 or not own:
            return []
        mu = cfg.momentum
        return [
            OptimizerOverride("momentum", 0.0, f"{self.name} applies momentum {own:g} inside its hook; "
                                               f"SGD momentum {mu:g} on top would compound it", conflict=True),
            OptimizerOverride("lr", float(f"{cfg.lr * (1.0 + mu):.12g}"),
                              f"lr * (1 + {mu:g}) keeps SGD's stability margin without momentum; up to "
                              f"lr / (1 - {mu:g}) = {cfg.lr / (1.0 - mu):.3g} keeps its full step where stable",
                              requires=("momentum",)),
        ]

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

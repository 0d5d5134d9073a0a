"""Gradient-compression methods for ``--method``: one per registered codec, generated.

Each is DDP plus the comm hook of :mod:`lowcomm.comm.hooks` driving the codec named like the
method; options are the codec's ``Options`` (``topk:density=0.01,start_iter=10``). The list
is read from :data:`~lowcomm.compress.codec.CODECS`, so a new compressor module appears here
without an edit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from lowcomm import hooks
from lowcomm.comm.hooks import CodecHook
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.methods import register
from lowcomm.methods.base import Method, OptimizerOverride


class HookMethod(Method):
    """DDP + the comm hook named like the method; state is the hook's state."""

    #: the hook registered (``ssgd`` or a codec name); defaults to the method's name
    hook_name: ClassVar[str] = ""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.hook_state: CodecHook | None = None
        self._pending: dict[str, Any] | None = None

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Register the hook (restoring state loaded before the model was wrapped)."""
        group = self.ctx.process_group if self.ctx else None
        self.hook_state = hooks.register(ddp, self.hook_name or self.name, process_group=group,
                                         **dataclasses.asdict(self.options))
        self.hook_state.attach_scaler(self.scaler)
        if self._pending is not None:
            self.hook_state.load_state_dict(self._pending)
            self._pending = None

    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Stateful codecs keep memory/momentum in unscaled units (see Method.attach_scaler)."""
        super().attach_scaler(scaler)
        if self.hook_state is not None:
            self.hook_state.attach_scaler(scaler)

    def state_dict(self) -> dict[str, Any]:
        """The hook's state (codec memory and factors), or what was loaded before wrapping."""
        if self.hook_state is not None:
            return self.hook_state.state_dict()
        return dict(self._pending or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the hook's state now, or when the hook is registered."""
        if not state:
            return
        if self.hook_state is not None:
            self.hook_state.load_state_dict(state)
        else:
            self._pending = state


class CompressionMethod(HookMethod):
    """A codec's method: also reports the step's finite flag and the optimizer it needs."""

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The hook's device flag for the last synchronized step (no host sync)."""
        return self.hook_state.nonfinite_this_step if self.hook_state is not None else None

    def optimizer_overrides(self, cfg: Any) -> list[OptimizerOverride]:
        """What the codec's options ask of the optimizer (:func:`codec_optimizer_overrides`)."""
        return codec_optimizer_overrides(self.name, self.options, cfg)


def codec_optimizer_overrides(name: str, codec_options: Any, cfg: Any, *,
                              inside: str = "hook") -> list[OptimizerOverride]:
    """The optimizer overrides a codec's options ask for, whoever carries the codec (its own
    DDP method here, or an engine schedule's ``compress=``; ``name`` is what the notice calls
    it; ``inside``: where the codec runs). One rule for both, so ``wfbp:compress=signum``
    trains like ``signum``.

    A codec that keeps its own momentum (an option ``momentum``; Signum:
    ``m = beta m + (1 - beta) g``, the sign of ``m`` sent) needs SGD without momentum:
    SGD momentum on top compounds the two (measured on MNIST-1D: 56 % against ``ssgd``'s
    92 %; docs/compression.md).

    The learning rate becomes ``lr * (1 + mu)``: plain SGD at that rate has the same
    stability limit (curvature below ``2 (1 + mu) / lr``) as the heavy-ball SGD it
    replaces, so it is as safe on any model. Keeping the full effective step
    ``lr / (1 - mu)`` gives up that margin: it was best on the 8 k-parameter cnn1d and
    lost 10 points on the 256-channel one, so it is left to the user (``--lr``).
    Error-feedback codecs ask for nothing: SGD momentum after them was worse on one model
    and better on the other (docs/compression.md), a tuning question, not a conflict.
    """
    own = getattr(codec_options, "momentum", None)
    if cfg.optimizer != "sgd" or cfg.momentum == 0 or not own:
        return []
    mu = cfg.momentum
    return [
        OptimizerOverride("momentum", 0.0, f"{name} applies momentum {own:g} inside its {inside}; "
                                           f"SGD momentum {mu:g} on top would compound it", conflict=True),
        OptimizerOverride("lr", float(f"{cfg.lr * (1.0 + mu):.12g}"),
                          f"lr * (1 + {mu:g}) keeps SGD's stability margin without momentum; up to "
                          f"lr / (1 - {mu:g}) = {cfg.lr / (1.0 - mu):.3g} keeps its full step where stable",
                          requires=("momentum",)),
    ]


def _method_for(name: str) -> type[Method]:
    """The generated ``--method`` class of codec ``name``."""
    codec = codec_class(name)
    cls = type(f"{name.capitalize()}Method", (CompressionMethod,),
               {"name": name, "Options": codec.Options, "__doc__": codec.summary or codec.__doc__})
    return register(cls)


METHODS: dict[str, type[Method]] = {name: _method_for(name) for name in CODECS.names()}

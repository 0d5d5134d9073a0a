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
import torch.distributed as dist
from torch import nn

from lowcomm import hooks
from lowcomm.comm.hooks import CodecHook
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.compress.warm import compile_kernels
from lowcomm.errors import UsageError
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext, OptimizerOverride


class HookMethod(Method):
    """DDP + the comm hook named like the method; state is the hook's state."""

    #: the hook registered (``ssgd`` or a codec name); defaults to the method's name
    hook_name: ClassVar[str] = ""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.hook_state: CodecHook | None = None
        self._pending: dict[str, Any] | None = None

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Register the hook (restoring state loaded before the model was wrapped); the codec
        gets the momentum the trainer moved into it and the run's length (durations)."""
        ctx = self.ctx or MethodContext()
        self.hook_state = hooks.register(ddp, self.hook_name or self.name, process_group=ctx.process_group,
                                         steps_per_epoch=ctx.steps_per_epoch, total_steps=ctx.total_steps,
                                         compile_now=False, **dataclasses.asdict(self.options))
        if self.hook_state.codec is not None:  # (not as momentum=: signum has its own option of that name)
            self.hook_state.codec.set_momentum(ctx.codec_momentum)
            compile_kernels(self.hook_state.codec, getattr(ddp, "module", ddp).parameters())  # not in step 1
        self.hook_state.attach_scaler(self.scaler)
        if self._pending is not None:
            self.hook_state.load_state_dict(self._pending)
            self._pending = None

    def describe(self) -> dict[str, Any]:
        """:meth:`Method.describe`; for a codec with rounds, where they ran (``codec_rounds``:
        ``thread``, beside backward, or ``hook``, in the hook's call): the simulator replays it."""
        out = super().describe()
        state = self.hook_state
        if state is not None and state.codec is not None and state.codec.has_rounds:
            out["codec_rounds"] = "thread" if state.beside else "hook"
        return out

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
        """What the codec's options ask of the optimizer (:func:`codec_optimizer_overrides`).
        One process without a process group runs no hook (plain model): nothing moves."""
        return codec_optimizer_overrides(self.name, self.options, cfg, carried=dist.is_initialized())


def momentum_overrides(name: str, codec_options: Any, cfg: Any, *, inside: str) -> list[OptimizerOverride]:
    """Momentum correction (DGC; :class:`~lowcomm.compress.feedback.Velocity`): with SGD
    momentum ``mu > 0`` and the codec's ``momentum_correction`` on, the momentum moves into
    the codec (SGD momentum -> 0) and the weight decay becomes ``wd / (1 - mu)``: in heavy-ball
    SGD the decay term goes through the momentum (steady-state gain ``1 / (1 - mu)``), applied
    outside it needs that gain explicitly. Moved even when typed (the training is the same);
    ``--nesterov`` and ``--clip-grad`` are refused with the fix; AdamW: not applicable, off, with a notice."""
    if not getattr(codec_options, "momentum_correction", False):
        return []
    if cfg.optimizer == "adamw":
        return [OptimizerOverride("", None, f"momentum correction does not apply to adamw (no SGD momentum to "
                                            f"move into the {inside}): off")]
    mu = float(cfg.momentum)
    if cfg.optimizer != "sgd" or mu == 0:
        return []
    if cfg.nesterov:
        raise UsageError(f"--method {name} with --nesterov: momentum correction keeps heavy-ball momentum in the "
                         f"{inside}, which has no Nesterov form; add momentum_correction=false to the method "
                         "(or leave --nesterov out)")
    if getattr(cfg, "clip_grad", None):
        local = " or clip=NORM (DGC's local clipping, before the velocity)" if hasattr(codec_options, "clip") else ""
        raise UsageError(f"--method {name} with --clip-grad: momentum correction makes the synchronized gradient "
                         "the momentum's update, so --clip-grad would clip the update, not the gradient; add "
                         f"momentum_correction=false to the method{local}")
    keep = "add momentum_correction=false to the method to keep it in the optimizer"
    out = [OptimizerOverride("momentum", 0.0, f"momentum {mu:g} moves into the {inside} (momentum correction; {keep})",
                             moves=True)]
    if cfg.weight_decay:
        out.append(OptimizerOverride("weight_decay", float(f"{cfg.weight_decay / (1.0 - mu):.12g}"),
                                     f"= wd / (1 - {mu:g}): the decay's gain through the momentum, now applied outside it",
                                     requires=("momentum",), moves=True))
    return out


def codec_optimizer_overrides(name: str, codec_options: Any, cfg: Any, *,
                              inside: str = "hook", carried: bool = True) -> list[OptimizerOverride]:
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
    Error-feedback codecs with ``momentum_correction`` on take SGD's momentum into the codec
    (:func:`momentum_overrides`), unless ``carried`` is False (no codec will run: one
    process without a process group has no hook, so the momentum stays in the optimizer).
    """
    own = getattr(codec_options, "momentum", None)
    if not own:
        return momentum_overrides(name, codec_options, cfg, inside=inside) if carried else []
    if cfg.optimizer != "sgd" or cfg.momentum == 0:
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

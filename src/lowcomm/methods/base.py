"""What one ``--method`` choice may change in the training loop, and how options are parsed.

The trainer drives every method through the same life cycle::

    model = method.prepare(model)            # model axis (e.g. Pufferfish factorization)
    wrapped = method.wrap(model, ctx)        # DDP + comm hook, or a scheduling engine
    method.attach_scaler(scaler)             # fp16 AMP: the GradScaler (None otherwise)
    for each step:
        out = wrapped(x); loss.backward()    # (scaler.scale(loss) under AMP) hooks sync grads
        method.finish_sync()                 # timed as exposed communication wait
        if scaler:
            method.unscale_(optimizer)       # unscale + inf check in the scaler, no host sync
            method.optimizer_step(optimizer) # scaler.step: skipped on inf/NaN
            scaler.update()
        elif method.nonfinite_flag() is true: # device flag, read once per step
            method.skip_step(optimizer)
        else:
            method.optimizer_step(optimizer) # default: optimizer.step()
    method.flush()                           # before evaluation / checkpoint: weights complete
    if method.on_epoch_end(epoch): ...       # True: trainer re-prepares, re-wraps, rebuilds optim

With the compression methods and the scheduling engine, non-finite gradients never reach
the weights: a non-finite input's payload is poisoned so that the synchronized gradient is
non-finite on *every* rank, the method's state is kept unchanged, and a device flag records
it; the one host read of that flag per step happens after backward (the trainer), never
per bucket inside backward. (Plain ``ssgd`` tracks nothing: only a GradScaler skips there.)

Options are a dataclass per method; ``name:key=value,...`` strings are converted using the
field types, and unknown keys are refused with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.errors import UsageError


@dataclass
class MethodContext:
    """Where the method runs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: Any = None
    seed: int = 0
    bucket_cap_mb: float = 25.0


@dataclass
class NoOptions:
    """Methods without options."""


@dataclass(frozen=True)
class OptimizerOverride:
    """A training setting a method needs changed to train well (see
    :meth:`Method.optimizer_overrides`): ``field`` of the training config, its new value,
    why (one line, for the notice), and the fields whose override it presupposes."""

    field: str
    value: Any
    why: str
    requires: tuple[str, ...] = ()
    #: True when another value is wrong, not merely untuned (Signum's SGD momentum): a value
    #: the user typed is then refused with the fix, instead of kept with a warning.
    conflict: bool = False


class Method:
    """Base class: plain DDP with no comm hook. Subclasses override what they change."""

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    #: ``"all_reduce"`` (sum-compatible payload) or ``"all_gather"`` (decode after gathering).
    aggregation: ClassVar[str] = "all_reduce"
    #: True for methods that exist only for measurement (e.g. no communication at all).
    timing_only: ClassVar[bool] = False

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()
        self.ctx: MethodContext | None = None
        self.ddp: nn.Module | None = None
        #: ``torch.amp.GradScaler`` for fp16 AMP (see :meth:`attach_scaler`), else None
        self.scaler: Any = None

    # --- model axis -------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        return model

    # --- schedule / payload axis ------------------------------------------------------------
    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """Wrap for data parallelism. Default: DDP, then :meth:`register_hook`."""
        self.ctx = ctx
        if ctx.world_size == 1 and not dist.is_initialized():
            self.ddp = model
            return model
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=device_ids,
            process_group=ctx.process_group,
            bucket_cap_mb=ctx.bucket_cap_mb,
        )
        self.register_hook(ddp)
        self.ddp = ddp
        return ddp

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Attach a DDP comm hook. Default: none (DDP's built-in all-reduce, not counted)."""

    def finish_sync(self) -> None:
        """Wait for gradient communication still in flight after backward."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update. With a scaler attached, GradScaler's semantics: skipped when its inf
        check (see :meth:`unscale_`) found a non-finite gradient."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()

    # --- AMP and non-finite steps -----------------------------------------------------------
    def attach_scaler(self, scaler: Any) -> None:
        """Hand the trainer's ``torch.amp.GradScaler`` (or None) to the method.

        Why the method needs it: comm hooks see *scaled* gradients, and state that outlives a
        step (error-feedback memory, momentum) must be kept in unscaled units or it is off by
        the scale's change every time the scaler grows or backs off (``lowcomm.comm.amp``).
        Methods that hold the gradient themselves (scheduling engine) also run the scaler's
        unscale/skip logic on it. Called after :meth:`wrap`, again after every re-wrap.
        """
        self.scaler = scaler

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this step's synchronized gradient and record the scaler's inf check
        (no host sync). Default: ``scaler.unscale_(optimizer)`` on ``p.grad``."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def nonfinite_flag(self) -> torch.Tensor | None:
        """0-dim bool tensor on the gradients' device: this step's synchronized gradient has a
        non-finite entry, identically on every rank. None when the method does not track it
        (plain DDP). Reading it is the caller's one host sync per step."""
        return None

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called instead of :meth:`optimizer_step` for a step whose gradient is non-finite
        (no GradScaler). Default: nothing to undo."""

    def optimizer_overrides(self, cfg: Any) -> list[OptimizerOverride]:
        """Optimizer settings this method needs, given the training config ``cfg``.

        Why a method may ask: some payloads change what the optimizer should do (Signum
        carries its own momentum, so SGD momentum on top compounds it). The trainer applies
        an override only to a setting the user left at its default, printing one line on
        rank 0; a setting given explicitly is kept, with a warning
        (:func:`lowcomm.runtime.optim.apply_method_overrides`). Default: none.
        """
        return []

    def flush(self) -> None:
        """Complete anything pending so the weights are whole (before eval or checkpoint)."""

    def on_epoch_end(self, epoch: int) -> bool:
        """Return True to ask the trainer to re-prepare and re-wrap the model."""
        return False

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "options": dataclasses.asdict(self.options)}


def _convert(value: str, annotation: Any, key: str, method: str) -> Any:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    kind = kind.replace("typing.", "").replace(" ", "")
    try:
        if kind in ("bool",):
            low = value.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind in ("int",):
            return int(value)
        if kind in ("float",):
            return _finite(float(value), key, method)
        if kind in ("int|None", "Optional[int]"):
            return None if value.lower() == "none" else int(value)
        if kind in ("float|None", "Optional[float]"):
            return None if value.lower() == "none" else _finite(float(value), key, method)
    except UsageError:
        raise
    except ValueError:
        article = "an" if kind[0] in "aeiou" else "a"
        raise UsageError(f"option {key}={value!r} of method {method!r} must be {article} {kind}") from None
    return value


def _finite(value: float, key: str, method: str) -> float:
    """No method option means anything at ``nan`` or ``inf`` (``1e400`` parses as ``inf``)."""
    if not math.isfinite(value):
        raise UsageError(f"option {key}={value} of method {method!r} must be a finite number")
    return value


def parse_options(method_name: str, options_cls: type, text: str) -> Any:
    """Parse ``key=value,key=value`` into ``options_cls``; refuse unknown keys clearly."""
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise UsageError(f"method option {item!r} must look like key=value (method {method_name!r})")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            valid = ", ".join(fields) or "none"
            raise UsageError(f"unknown option {key!r} for method {method_name!r}; valid: {valid}")
        values[key] = _convert(value, fields[key].type, key, method_name)
    try:
        return options_cls(**values)
    except (TypeError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"invalid options for method {method_name!r}: {e}") from None

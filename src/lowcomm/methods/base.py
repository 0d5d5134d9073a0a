"""What one ``--method`` choice may change in the training loop, and how options are parsed.

The trainer drives every method through the same life cycle::

    model = method.prepare(model)            # model axis (e.g. Pufferfish factorization)
    wrapped = method.wrap(model, ctx)        # DDP + comm hook, or a scheduling engine
    for each step:
        out = wrapped(x); loss.backward()    # gradients synchronized by hooks during backward
        method.finish_sync()                 # timed as exposed communication wait
        method.optimizer_step(optimizer)     # default: optimizer.step()
    method.flush()                           # before evaluation / checkpoint: weights complete
    if method.on_epoch_end(epoch): ...       # True: trainer re-prepares, re-wraps, rebuilds optim

Options are a dataclass per method; ``name:key=value,...`` strings are converted using the
field types, and unknown keys are refused with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
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
        optimizer.step()

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
            return float(value)
        if kind in ("int|None", "Optional[int]"):
            return None if value.lower() == "none" else int(value)
        if kind in ("float|None", "Optional[float]"):
            return None if value.lower() == "none" else float(value)
    except ValueError:
        raise UsageError(f"option {key}={value!r} of method {method!r} must be a {kind}") from None
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

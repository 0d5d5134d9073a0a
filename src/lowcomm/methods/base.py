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
field types, and unknown keys are refused with the list of valid ones. A value may itself be
a method spec in parentheses (``pufferfish:then=(acpsgd:rank=4,start_iter=5)``): options are
split on commas outside parentheses only (:func:`split_top_level`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.errors import UsageError

if TYPE_CHECKING:
    from lowcomm.runtime.config import TrainConfig

MIB = 1024 * 1024
#: DDP's default bucket caps in MiB (``DistributedDataParallel`` without ``bucket_cap_mb``): its
#: buckets, and its first bucket in backward order
DDP_BUCKET_MB = 25.0
DDP_FIRST_BUCKET_MB = 1.0


@dataclass
class MethodContext:
    """Where the method runs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    process_group: dist.ProcessGroup | None = None
    seed: int = 0
    #: DDP's bucket cap in MiB; None: DDP's own defaults (25 MiB buckets after a first bucket,
    #: in backward order, that closes at 1 MiB). torch 2.13's DDP closes the first bucket at
    #: the cap as soon as a cap is given, so passing 25 is not the same as passing nothing.
    bucket_cap_mb: float | None = None
    #: the optimizer's momentum moved into the codec (momentum correction, see
    #: :class:`OptimizerOverride` ``moves``); 0.0: none moved, the codec keeps no velocity
    codec_momentum: float = 0.0
    #: the run's length, for options given as durations (``start_iter="2ep"``, ``"5%"``);
    #: None: unknown (a relative default then falls back to a fixed step count)
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    #: samples per worker per step (None: unknown), for choices that depend on it (lee18's fc=auto)
    batch_size: int | None = None
    #: fp16 loss scaling (a GradScaler) will be attached, for methods that cannot carry it
    loss_scaling: bool = False


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
    #: True when the setting is *moved* rather than overridden (momentum correction: the
    #: momentum moves into the codec, the weight decay is rescaled to match): applied even to
    #: a value the user typed, since the training it describes is unchanged. ``field`` ""
    #: is a notice only (nothing changes; ``why`` is printed).
    moves: bool = False


class Method:
    """Base class: plain DDP with no comm hook. Subclasses override what they change."""

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    #: True for methods that exist only for measurement (e.g. no communication at all).
    timing_only: ClassVar[bool] = False
    #: why ``--compute emulated`` cannot run this method (empty: it can), said before any worker starts
    emulated_compute_refusal: ClassVar[str] = ""

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()
        self.ctx: MethodContext | None = None
        self.ddp: nn.Module | None = None
        #: ``torch.amp.GradScaler`` for fp16 AMP (see :meth:`attach_scaler`), else None
        self.scaler: torch.amp.GradScaler | None = None

    # --- model axis -------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        """Change the model before it is wrapped (model axis). Default: unchanged."""
        return model

    def compute_reference(self) -> str:
        """The method spec whose run measures this method's computation alone (the bench's
        lower bound). ``nocomm`` trains the model unchanged; a model-axis method names a run of
        the model it really trains with no communication (its compute differs)."""
        return "nocomm"

    def warmup_steps(self) -> int:
        """Steps before this method runs as it will for the rest of training: a method that
        measures itself online (a fusion plan, a tuned threshold) behaves differently until it
        has. A timing run (``lowcomm bench``) leaves at least these steps out of its medians."""
        return 0

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
            bucket_cap_mb=ctx.bucket_cap_mb,  # None: DDP's defaults
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
    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
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

    def optimizer_overrides(self, cfg: TrainConfig) -> list[OptimizerOverride]:
        """Optimizer settings this method needs, given the training config ``cfg``.

        Why a method may ask: some payloads change what the optimizer should do (Signum
        carries its own momentum, so SGD momentum on top compounds it). The trainer applies
        an override only to a setting the user left at its default, printing one line on
        rank 0; a setting given explicitly is kept, with a warning
        (:func:`lowcomm.optim.apply_method_overrides`). Default: none.
        """
        return []

    def lr_multiplier(self, step: int) -> float:
        """Factor on the scheduled LR of global optimizer step ``step`` (0-based).

        Why a method may ask: a method that changes the model mid-run and resets the
        optimizer (Pufferfish's switch) re-warms the LR up (:class:`lowcomm.optim.Rewarmup`).
        The trainer's scheduler multiplies this in, so it must be a pure function of
        ``step`` given the method's state: a rebuilt or resumed scheduler replays it.
        Default: 1.
        """
        return 1.0

    def flush(self) -> None:
        """Complete anything pending so the weights are whole (before eval or checkpoint)."""

    def on_epoch_end(self, epoch: int) -> bool:
        """Return True to ask the trainer to re-prepare and re-wrap the model."""
        return False

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """State that outlives a step (error feedback, switch decisions), for checkpoints:
        without it a resumed run diverges from an uninterrupted one. Default: none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; called before :meth:`prepare` and :meth:`wrap`."""

    def describe(self) -> dict[str, Any]:
        """The method and its options, for the training summary (``method_info``); with DDP,
        the bucket caps it ran with (a simulator replaying the run needs the same buckets)."""
        out: dict[str, Any] = {"method": self.name, "options": dataclasses.asdict(self.options)}
        if isinstance(self.ddp, nn.parallel.DistributedDataParallel):
            out["bucket_cap_mb"], out["first_bucket_mb"] = ddp_bucket_caps_mb(self.ddp)
        return out


def ddp_bucket_caps_mb(ddp: nn.parallel.DistributedDataParallel) -> tuple[float, float]:
    """(bucket cap, first bucket's cap) in MiB, as this DDP instance fills its buckets.

    Read from the instance, not inferred from the arguments: torch 2.13 closes the first
    bucket (backward order) at 1 MiB only when no cap was given, and at the cap otherwise;
    earlier releases always closed it at 1 MiB.
    """
    cap = int(ddp.bucket_bytes_cap)
    config = getattr(ddp, "_bucket_config", None)
    first = int(getattr(config, "first_bucket_bytes_cap", 0) or DDP_FIRST_BUCKET_MB * MIB)  # before 2.13: always that
    return cap / MIB, min(first, cap) / MIB


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


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split ``text`` on ``sep`` outside parentheses; parts are stripped, empty ones dropped.

    Why: method specs nest (``pufferfish:then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.25``),
    and a nested spec's own commas must not end the outer option. Unbalanced parentheses
    are a :class:`UsageError` naming the text.
    """
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise UsageError(f"unbalanced parentheses in {text!r}: ')' at position {i} closes nothing")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth > 0:
        raise UsageError(f"unbalanced parentheses in {text!r}: {depth} '(' not closed")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def strip_parens(value: str) -> str:
    """``'(acpsgd:rank=4)'`` -> ``'acpsgd:rank=4'``: one outer pair enclosing the whole value
    is removed (``'(a)(b)'`` is left as it is); anything else is returned stripped."""
    value = value.strip()
    if len(value) >= 2 and value[0] == "(" and value[-1] == ")":
        depth = 0
        for i, ch in enumerate(value):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(value) - 1:
                return value  # the first "(" closes before the end: not one enclosing pair
        return value[1:-1].strip()
    return value


def options_spec(options: Any, **replace: str) -> str:
    """``key=value,...`` that :func:`parse_options` reads back into ``options``: the fields that
    differ from their defaults, then ``replace`` (booleans lower-case, text with a comma in
    parentheses, as nested specs are written)."""
    def text(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        return f"({value})" if "," in str(value) else str(value)

    items = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
             if f.name not in replace and getattr(options, f.name) != f.default}
    return ",".join(f"{k}={text(v)}" for k, v in {**items, **replace}.items())


def parse_options(method_name: str, options_cls: type, text: str) -> Any:
    """Parse ``key=value,key=value`` into ``options_cls``; refuse unknown keys clearly.

    A value may be a nested method spec in parentheses, ``then=(acpsgd:rank=4,start_iter=5)``
    (see :func:`split_top_level`); one outer pair is removed before conversion. A nested spec
    with at most one option needs none (``then=acpsgd:rank=4``).
    """
    fields = {f.name: f for f in dataclasses.fields(options_cls)}
    values: dict[str, Any] = {}
    nested_bare: str | None = None  # "key=value" whose value was an unparenthesized nested spec
    for item in split_top_level(text):
        if "=" not in item:
            raise UsageError(f"method option {item!r} must look like key=value (method {method_name!r})")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            valid = ", ".join(fields) or "none"
            hint = ""
            if nested_bare is not None:
                hint = f" (a nested method's options go in parentheses: {nested_bare},{key}=...))"
            raise UsageError(f"unknown option {key!r} for method {method_name!r}; valid: {valid}{hint}")
        if ":" in value and not value.startswith("("):
            nested_bare = f"{key}=({value}"
        values[key] = _convert(strip_parens(value), fields[key].type, key, method_name)
    try:
        return options_cls(**values)
    except (TypeError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"invalid options for method {method_name!r}: {e}") from None

"""The ``pufferfish`` method: vanilla warm-up, then train the low-rank factorized model
(docs/pufferfish.md).

``pufferfish:warmup_epochs=E`` trains the dense model for ``E`` epochs with ``warmup_method``
(default ``ssgd``), then :meth:`on_epoch_end` returns True: the trainer calls :meth:`prepare`
(every rank factorizes its identical weights by a deterministic CPU SVD), re-wraps with the
``then`` method (default ``ssgd``: the factors' gradients are small) and rebuilds optimizer
(state reset, as in the paper) and LR scheduler (continuing where it was). ``rewarmup_epochs``
ramps the LR back up after the reset (:class:`lowcomm.optim.Rewarmup`, :meth:`lr_multiplier`);
``frob_decay``: :func:`lowcomm.optim.frobenius_decay_`.

Why any method on both sides of the switch: the model axis (what is trained) and the
payload/schedule axes (how gradients travel) are independent, so the inner methods are any
registry methods; nested specs go in parentheses, ``then=(acpsgd:rank=4,start_iter=5)``.

``auto_rank``/``auto_switch`` (Cuttlefish-style) are decided on rank 0 and broadcast. Checkpoints
hold the switch, every layer's rank and the inner method's state; on resume :meth:`prepare`
rebuilds the factorized structure before the weights are loaded, :meth:`wrap` restores the state.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lowcomm import methods as method_registry
from lowcomm.errors import UsageError, check_fraction, check_positive
from lowcomm.lowrank.factorize import Candidate, candidates, factorize, plan, resolve_full_rank
from lowcomm.lowrank.rank import auto_slot_ranks, broadcast_ints, ranks_stable, slot_stable_ranks
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext, OptimizerOverride, options_spec
from lowcomm.optim.decay import frobenius_decay_
from lowcomm.optim.schedules import Rewarmup
from lowcomm.sched.pairing import Mode

if TYPE_CHECKING:
    from lowcomm.runtime.config import TrainConfig


def _device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s parameters (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@dataclass
class PufferfishOptions:
    """``--method pufferfish:...`` options (docs/pufferfish.md has the table)."""

    rank_ratio: float = 0.25
    warmup_epochs: int = 0
    warmup_method: str = "ssgd"  # any method spec: the full-rank warm-up's gradient method
    then: str = "ssgd"  # any method spec: the method after the switch
    rewarmup_epochs: float = 0.0
    full_rank: str = ""  # regex of dense layers; "" = the model's hybrid preset; "none" = no layer
    extra_bn: bool = False
    frob_decay: float = 0.0
    auto_rank: bool = False
    auto_switch: bool = False

    def __post_init__(self) -> None:
        check_fraction("pufferfish rank_ratio", self.rank_ratio)
        if self.warmup_epochs < 0:
            raise UsageError(f"pufferfish warmup_epochs must be >= 0, got {self.warmup_epochs}")
        # check_positive also refuses nan/inf, which a plain "< 0" test lets through
        check_positive("pufferfish rewarmup_epochs", self.rewarmup_epochs, allow_zero=True)
        check_positive("pufferfish frob_decay", self.frob_decay, allow_zero=True)
        if self.full_rank and self.full_rank.lower() != "none":
            try:  # refused here, before any worker starts, not at factorization time
                re.compile(self.full_rank)
            except re.error as e:
                raise UsageError(f"pufferfish full_rank {self.full_rank!r} is not a valid regex: {e}") from None
        for key in ("warmup_method", "then"):
            _make_inner(key, getattr(self, key))  # refused here, before any worker starts
        if self.frob_decay > 0:
            _check_decay_reaches_gradients(self.then)
        name, _ = method_registry.split_spec(_nested(self.warmup_method))
        if name != "ssgd" and self.warmup_epochs == 0 and not self.auto_switch:
            raise UsageError(f"pufferfish warmup_method={self.warmup_method} has no effect without a "
                             "warm-up: give warmup_epochs=E (E > 0) or auto_switch=true")
        if (self.auto_rank or False) and self.warmup_epochs == 0 and not self.auto_switch:
            raise UsageError("pufferfish auto_rank needs a full-rank warm-up (warmup_epochs > 0 or "
                             "auto_switch=true): stable ranks of untrained weights are all full")

    def full_rank_spec(self) -> str | list[str] | None:
        """``full_rank`` for :func:`~lowcomm.lowrank.factorize`: None = the preset, [] = none."""
        if self.full_rank == "":
            return None
        if self.full_rank.lower() == "none":
            return []
        return self.full_rank


def _nested(spec: str) -> str:
    """A nested spec as the registry reads it: ``;`` was the separator of its options before
    parentheses existed (deprecated alias, read only where no parenthesis is used)."""
    return spec if "(" in spec else spec.replace(";", ",")


def _make_inner(key: str, spec: str) -> Method:
    """The method that option ``key`` (``warmup_method`` or ``then``) names, with its options."""
    spec = _nested(spec)
    if method_registry.split_spec(spec)[0] == "pufferfish":
        raise UsageError(f"pufferfish {key} cannot be pufferfish itself")
    return method_registry.create(spec)


def _check_decay_reaches_gradients(then: str) -> None:
    """Refuse ``frob_decay`` with a sharding ``then`` engine (dear/lee18 hold gradient shards,
    ``p.grad`` is None: the decay would silently do nothing; the factors exist only after the switch)."""
    name = method_registry.split_spec(_nested(then))[0]
    mode = getattr(method_registry.method_class(name), "mode", None)
    if isinstance(mode, Mode) and mode is not Mode.ALLREDUCE:
        full = [n for n in method_registry.names()
                if getattr(method_registry.method_class(n), "mode", None) is Mode.ALLREDUCE]
        raise UsageError(f"pufferfish frob_decay would do nothing with then={then}: {name} ({mode.value} mode) "
                         f"holds gradient shards, not the factors' full gradients; for then= use a DDP method "
                         f"or {'/'.join(full)}, or set frob_decay=0")


@register
class Pufferfish(Method):
    """Low-rank pre-factorized training with a vanilla full-rank warm-up (Wang et al., 2021)."""

    name = "pufferfish"
    Options = PufferfishOptions

    def __init__(self, options: PufferfishOptions | None = None) -> None:
        super().__init__(options)
        o: PufferfishOptions = self.options
        self.switched = False
        self.switch_epoch: int | None = None
        self.switch_step = 0  # global optimizer step at which the factorized model starts
        self.ranks: dict[str, Any] | None = None
        self.epochs_done = 0
        self.steps = 0  # optimizer steps seen by this method (all epochs)
        self.steps_per_epoch: int | None = None
        self.srank_init: dict[str, float] | None = None
        self.rank_history: list[dict[str, int]] = []
        self.example_shape: tuple[tuple[int, ...], torch.dtype] | None = None
        self._model: nn.Module | None = None
        self._pending_inner_state: dict[str, Any] | None = None
        if o.warmup_epochs == 0 and not o.auto_switch:
            self.switched, self.switch_epoch = True, 0
        self.inner: Method = self._current_inner()

    def _current_inner(self) -> Method:
        """A fresh instance of the method for the current phase (warm-up or after the switch)."""
        o: PufferfishOptions = self.options
        return _make_inner("then", o.then) if self.switched else _make_inner("warmup_method", o.warmup_method)

    def optimizer_overrides(self, cfg: TrainConfig) -> list[OptimizerOverride]:
        """What the warm-up method (if one runs) and ``then`` need (``signum``: SGD momentum
        off), for the whole run: one optimizer configuration, announced once, not settings that
        silently change at the switch. Two values for a defaulted setting: refused."""
        o: PufferfishOptions = self.options
        phases = [("then", o.then)]
        if o.warmup_epochs > 0 or o.auto_switch:
            phases.insert(0, ("warmup_method", o.warmup_method))
        asked = [(key, _make_inner(key, spec).optimizer_overrides(cfg)) for key, spec in phases]
        # a setting moved into a codec moves only if every phase moves it (else the warm-up
        # would lose its momentum); not moved, the codec keeps no velocity
        moved_by_all = set.intersection(*({(o.field, o.value) for o in ovs if o.moves} for _, ovs in asked))
        chosen: dict[str, tuple[str, OptimizerOverride]] = {}
        for key, ovs in asked:
            for ov in ovs:
                if ov.moves and (ov.field, ov.value) not in moved_by_all:
                    continue
                if ov.field not in chosen:
                    chosen[ov.field] = (key, ov)
                    continue
                first_key, first = chosen[ov.field]
                if first.value != ov.value and ov.field not in cfg.explicit_flags:
                    raise UsageError(
                        f"pufferfish: {first_key} needs {ov.field}={first.value} but then needs "
                        f"{ov.field}={ov.value}; give --{ov.field.replace('_', '-')} explicitly"
                    )
        return [ov for _, ov in chosen.values()]

    # --- model axis -------------------------------------------------------------------------
    def compute_reference(self) -> str:
        """Its options without communication: the factorized model's compute (nocomm overstates it)."""
        warm = {"warmup_method": "nocomm"} if self.options.warmup_epochs > 0 or self.options.auto_switch else {}
        return "pufferfish:" + options_spec(self.options, then="nocomm", **warm)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Before the switch: the dense model (stable ranks recorded for auto options);
        after it (or on resume after it): the model factorized in place at the chosen ranks."""
        o: PufferfishOptions = self.options
        self._record_input_shape(model)
        if not self.switched:
            if o.auto_rank or o.auto_switch:
                if self.srank_init is None:
                    self.srank_init = self._stable_ranks(model)
            self._model = model
            return model
        if self.ranks is None:  # first factorization (not a resume)
            self.ranks = self._choose_ranks(model)
        if not self.ranks:
            raise UsageError(
                "pufferfish: nothing to factorize in this model at rank_ratio="
                f"{o.rank_ratio} (no layer outside the full-rank set gets smaller)"
            )
        # the trainer hands the model over and uses only the result: no copy of the weights
        model = factorize(model, o.rank_ratio, o.full_rank_spec(), ranks=self.ranks, extra_bn=o.extra_bn, inplace=True)
        self._model = model
        return model

    def _candidates(self, model: nn.Module) -> list[Candidate]:
        full_rank, preset = resolve_full_rank(model, self.options.full_rank_spec(), None)
        return candidates(model, full_rank=full_rank, preset=preset)

    def _stable_ranks(self, model: nn.Module) -> dict[str, float]:
        return slot_stable_ranks(self._candidates(model))

    def _auto_slot_ranks(self, model: nn.Module) -> dict[str, int]:
        assert self.srank_init is not None
        return auto_slot_ranks(self._candidates(model), self.srank_init)

    def _choose_ranks(self, model: nn.Module) -> dict[str, Any]:
        o: PufferfishOptions = self.options
        chosen = plan(model, o.rank_ratio, o.full_rank_spec())
        if not o.auto_rank:
            return {c.name: spec for c, spec in chosen}
        slot_ranks = self._broadcast_ints(self._auto_slot_ranks(model), _device_of(model))
        out: dict[str, Any] = {}
        for c in self._candidates(model):
            spec = c.spec_from_slots({s: slot_ranks[f"{c.name}|{s}"] for s in c.matrices()})
            spec = c.prune(spec)  # layers whose stable rank is too high stay dense
            if spec is not None:
                out[c.name] = spec
        return out

    def _broadcast_ints(self, values: dict[str, int], device: torch.device) -> dict[str, int]:
        return broadcast_ints(values, device, tag="pufferfish.ranks")

    def _record_input_shape(self, model: nn.Module) -> None:
        """Remember one batch's input shape (for the MAC count in :meth:`describe`)."""

        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], torch.Tensor) and self.example_shape is None:
                self.example_shape = (tuple(args[0].shape[1:]), args[0].dtype)
            handle.remove()

        handle = model.register_forward_pre_hook(hook)

    # --- schedule axis: delegate to the current inner method -------------------------------
    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """Wrap with the current inner method (restoring its checkpointed state first)."""
        self.ctx = ctx
        if self._pending_inner_state is not None:
            self.inner.load_state_dict(self._pending_inner_state)
            self._pending_inner_state = None
        self.inner.attach_scaler(self.scaler)  # the inner method may be new (the switch)
        wrapped = self.inner.wrap(model, ctx)
        self.ddp = self.inner.ddp
        return wrapped

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """The inner method's hook."""
        self.inner.register_hook(ddp)

    def finish_sync(self) -> None:
        """The inner method's wait."""
        self.inner.finish_sync()

    # --- AMP and non-finite steps: the inner method synchronizes the gradient -------------
    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Keep the scaler for a later inner method, and hand it to the current one."""
        super().attach_scaler(scaler)
        self.inner.attach_scaler(scaler)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner method unscales (it knows where its synchronized gradient is)."""
        # before optimizer_step: Frobenius decay is then added to unscaled gradients
        self.inner.unscale_(optimizer)

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The inner method's flag."""
        return self.inner.nonfinite_flag()

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A skipped step still counts (as under a GradScaler, whose skip happens inside
        :meth:`optimizer_step`): the re-warm-up follows the LR schedule, which advances."""
        self.steps += 1
        self.inner.skip_step(optimizer)

    def flush(self) -> None:
        """Complete the inner method's pending work."""
        self.inner.flush()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Frobenius decay on the factors' (unscaled) gradients, then the inner method's step."""
        o: PufferfishOptions = self.options
        self.steps += 1
        if self.switched and o.frob_decay > 0 and self._model is not None:
            frobenius_decay_(self._model, o.frob_decay)
        self.inner.optimizer_step(optimizer)

    def rewarmup(self) -> Rewarmup | None:
        """The LR ramp after the switch (None: no ramp, or factorized from the start)."""
        o: PufferfishOptions = self.options
        if not self.switched or self.switch_epoch in (None, 0):
            return None
        return Rewarmup.epochs(self.switch_step, o.rewarmup_epochs, self.steps_per_epoch or 1)

    def lr_multiplier(self, step: int) -> float:
        """The re-warm-up's factor (a pure function of ``step`` given the switch) times the
        inner method's own."""
        ramp = self.rewarmup()
        return (ramp.factor(step) if ramp is not None else 1.0) * self.inner.lr_multiplier(step)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip as the inner method does (an engine holds gradient shards), else on the model."""
        inner = getattr(self.inner, "clip_grad_norm_", None)
        if inner is not None:
            return inner(max_norm)
        assert self._model is not None
        return nn.utils.clip_grad_norm_(self._model.parameters(), max_norm)

    # --- the switch -------------------------------------------------------------------------
    def on_epoch_end(self, epoch: int) -> bool:
        """Switch (True: the trainer re-prepares and re-wraps) at ``warmup_epochs`` or, with
        ``auto_switch``, once the stable ranks settle; the ``then`` method takes over."""
        o: PufferfishOptions = self.options
        self.epochs_done = epoch
        if self.steps_per_epoch is None and epoch > 0 and self.steps:
            self.steps_per_epoch = max(1, self.steps // epoch)
        if self.switched:
            return False
        switch = o.warmup_epochs > 0 and epoch >= o.warmup_epochs
        if o.auto_switch and self._model is not None and self.srank_init is not None:
            ranks = self._broadcast_ints(self._auto_slot_ranks(self._model), _device_of(self._model))
            self.rank_history.append(ranks)
            switch = switch or ranks_stable(self.rank_history)
        if not switch:
            return False
        self.inner.flush()
        self.switched, self.switch_epoch, self.switch_step = True, epoch, self.steps
        self.inner = self._current_inner()  # default ssgd: the factors' gradients are small
        return True

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Switch decision, ranks, step counters, and the current inner method's state."""
        return {
            "switched": self.switched,
            "switch_epoch": self.switch_epoch,
            "ranks": self.ranks,
            "epochs_done": self.epochs_done,
            "steps": self.steps,
            "steps_per_epoch": self.steps_per_epoch,
            "switch_step": self.switch_step,
            "srank_init": self.srank_init,
            "rank_history": self.rank_history,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the inner method's own state is loaded at :meth:`wrap`."""
        if not state:
            return
        self.switched = bool(state["switched"])
        self.switch_epoch = state.get("switch_epoch")
        self.ranks = state.get("ranks")
        self.epochs_done = int(state.get("epochs_done", 0))
        self.steps = int(state.get("steps", 0))
        self.steps_per_epoch = state.get("steps_per_epoch")
        # checkpoints written before switch_step was recorded kept steps since the switch
        self.switch_step = int(state.get("switch_step", self.steps - int(state.get("steps_since_switch", 0))))
        self.srank_init = state.get("srank_init")
        self.rank_history = list(state.get("rank_history", []))
        self.inner = self._current_inner()
        self._pending_inner_state = state.get("inner") or None

    def describe(self) -> dict[str, Any]:
        """Options, switch, the current inner method and the low-rank report (params, MACs)."""
        info: dict[str, Any] = {
            "method": self.name,
            "options": dataclasses.asdict(self.options),
            "switched": self.switched,
            "switch_epoch": self.switch_epoch,
            "current_method": self.inner.describe(),
        }
        if self._model is not None:
            from lowcomm.lowrank.summary import summary

            example = None
            if self.example_shape is not None:
                shape, dtype = self.example_shape
                p = next(self._model.parameters())
                example = torch.zeros(1, *shape, dtype=dtype, device=p.device)
            try:
                info["lowrank"] = summary(self._model, example=example, macs=example is not None)
            except Exception as e:  # a report must never fail a finished run
                info["lowrank"] = {"error": f"{type(e).__name__}: {e}"}
        return info

"""The ``pufferfish`` method: vanilla warm-up, then train the low-rank factorized model.

``--method pufferfish:rank_ratio=0.25,warmup_epochs=E`` trains the dense model for ``E``
epochs (with ``warmup_method``'s gradient communication: plain all-reduce by default, or a
compressor such as ``powersgd`` / ``acpsgd:rank=4``), then at the end of epoch ``E`` returns
True from :meth:`on_epoch_end`. The trainer then calls :meth:`prepare` — every rank
factorizes its (identical) weights by a deterministic CPU SVD — re-wraps with :meth:`wrap`
(plain all-reduce ``ssgd`` from now on: the gradients are already small) and rebuilds the
optimizer and LR scheduler (the schedule continues where it was).

Optimizer state: as in the paper, momentum (and Adam moments) are **reset** at the switch;
the new factor parameters have no counterpart in the old state. ``rewarmup_epochs`` ramps the
LR linearly from 0 back to the schedule's value over that many epochs after the switch, which
tames the jump that the reset causes.

Options beyond the paper: ``auto_rank`` picks each layer's rank from its scaled stable rank
(Cuttlefish); ``auto_switch`` switches at the first epoch after which no layer's stable-rank
estimate moved by more than 5% over two epochs (``warmup_epochs`` then caps the warm-up, 0 =
no cap). Decisions are broadcast from rank 0, so every rank builds the same architecture.
``frob_decay`` adds Frobenius decay ``λ/2·‖U·V‖²`` of each factorized weight to the
gradients (on top of the optimizer's weight decay). Inner-method options in
``warmup_method`` are separated with ``;`` (``warmup_method=powersgd:rank=4;start_iter=10``).

Checkpoints: :meth:`state_dict` records whether the switch happened and every layer's rank;
on resume the trainer calls :meth:`load_state_dict` and then :meth:`prepare`, which rebuilds
the factorized structure *before* the saved weights are loaded into it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods as method_registry
from lowcomm.comm import accounting
from lowcomm.errors import UsageError, check_fraction, check_positive
from lowcomm.lowrank.decay import frobenius_decay_
from lowcomm.lowrank.factorize import Candidate, candidates, factorize, plan, resolve_full_rank
from lowcomm.lowrank.rank import ranks_stable, scaled_stable_rank, stable_rank
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext, OptimizerOverride


def _device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s parameters (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@dataclass
class PufferfishOptions:
    rank_ratio: float = 0.25
    warmup_epochs: int = 0
    warmup_method: str = "ssgd"
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
        name, _ = method_registry.split_spec(self.warmup_method)
        if name == "pufferfish":
            raise UsageError("pufferfish warmup_method cannot be pufferfish itself")
        method_registry.METHODS.get(name)  # an unknown name is the first thing to report
        if name != "ssgd" and self.warmup_epochs == 0 and not self.auto_switch:
            raise UsageError(
                f"pufferfish warmup_method={self.warmup_method} has no effect without a warm-up: "
                "give warmup_epochs=E (E > 0) or auto_switch=true"
            )
        if (self.auto_rank or False) and self.warmup_epochs == 0 and not self.auto_switch:
            raise UsageError(
                "pufferfish auto_rank needs a full-rank warm-up (warmup_epochs > 0 or auto_switch=true): "
                "stable ranks of untrained weights are all full"
            )

    def full_rank_spec(self) -> str | list[str] | None:
        if self.full_rank == "":
            return None
        if self.full_rank.lower() == "none":
            return []
        return self.full_rank


def _make_inner(spec: str) -> Method:
    return method_registry.create(spec.replace(";", ","))


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
        self.ranks: dict[str, Any] | None = None
        self.epochs_done = 0
        self.steps = 0  # optimizer steps seen by this method (all epochs)
        self.steps_per_epoch: int | None = None
        self.steps_since_switch = 0
        self.srank_init: dict[str, float] | None = None
        self.rank_history: list[dict[str, int]] = []
        self.example_shape: tuple[tuple[int, ...], torch.dtype] | None = None
        self._model: nn.Module | None = None
        self._pending_inner_state: dict[str, Any] | None = None
        self.inner: Method = self._initial_inner()
        if o.warmup_epochs == 0 and not o.auto_switch:
            self.switched, self.switch_epoch = True, 0
            self.inner = method_registry.create("ssgd")

    def _initial_inner(self) -> Method:
        return _make_inner(self.options.warmup_method)

    def optimizer_overrides(self, cfg: Any) -> list[OptimizerOverride]:
        """The warm-up method's optimizer needs (e.g. ``warmup_method=signum``: SGD momentum
        off), applied for the whole run: one optimizer configuration, announced once, rather
        than settings that silently change at the switch."""
        o: PufferfishOptions = self.options
        if o.warmup_epochs == 0 and not o.auto_switch:
            return []  # no warm-up: the warm-up method never runs
        return _make_inner(o.warmup_method).optimizer_overrides(cfg)

    # --- model axis -------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
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

    def _full_rank(self, model: nn.Module) -> Any:
        return resolve_full_rank(model, self.options.full_rank_spec(), None)

    def _candidates(self, model: nn.Module) -> list[Candidate]:
        full_rank, preset = self._full_rank(model)
        return candidates(model, full_rank=full_rank, preset=preset)

    def _stable_ranks(self, model: nn.Module) -> dict[str, float]:
        """Stable rank of every rank slot (max over the blocks sharing one rank)."""
        out: dict[str, float] = {}
        for c in self._candidates(model):
            for slot, mats in c.matrices().items():
                out[f"{c.name}|{slot}"] = max(stable_rank(m) for m in mats)
        return out

    def _auto_slot_ranks(self, model: nn.Module) -> dict[str, int]:
        assert self.srank_init is not None
        now = self._stable_ranks(model)
        ranks: dict[str, int] = {}
        for c in self._candidates(model):
            for slot in c.matrices():
                key = f"{c.name}|{slot}"
                ranks[key] = scaled_stable_rank(now[key], self.srank_init.get(key, 0.0), min(c.slot_shape(slot)))
        return ranks

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
        """Rank 0's values on every rank (keys are in the same order everywhere).

        ``device`` is the model's: a process group on NCCL alone has no CPU backend.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return values
        keys = list(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.int64, device=device)
        accounting.broadcast(t, src=0, tag="pufferfish.ranks")
        return dict(zip(keys, (int(v) for v in t.tolist())))

    def _record_input_shape(self, model: nn.Module) -> None:
        """Remember one batch's input shape (for the MAC count in :meth:`describe`)."""

        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], torch.Tensor) and self.example_shape is None:
                self.example_shape = (tuple(args[0].shape[1:]), args[0].dtype)
            handle.remove()

        handle = model.register_forward_pre_hook(hook)

    # --- schedule axis: delegate to the current inner method -------------------------------
    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        self.ctx = ctx
        if self._pending_inner_state is not None:
            self.inner.load_state_dict(self._pending_inner_state)
            self._pending_inner_state = None
        self.inner.attach_scaler(self.scaler)  # the inner method may be new (the switch)
        wrapped = self.inner.wrap(model, ctx)
        self.ddp = self.inner.ddp
        return wrapped

    def register_hook(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.inner.register_hook(ddp)

    def finish_sync(self) -> None:
        self.inner.finish_sync()

    # --- AMP and non-finite steps: the inner method synchronizes the gradient -------------
    def attach_scaler(self, scaler: Any) -> None:
        super().attach_scaler(scaler)
        self.inner.attach_scaler(scaler)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        # before optimizer_step: Frobenius decay is then added to unscaled gradients
        self.inner.unscale_(optimizer)

    def nonfinite_flag(self) -> torch.Tensor | None:
        return self.inner.nonfinite_flag()

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A skipped step still counts (as under a GradScaler, whose skip happens inside
        :meth:`optimizer_step`): the re-warm-up follows the LR schedule, which advances."""
        self.steps += 1
        if self.switched:
            self.steps_since_switch += 1
        self.inner.skip_step(optimizer)

    def flush(self) -> None:
        self.inner.flush()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        o: PufferfishOptions = self.options
        self.steps += 1
        if self.switched and o.frob_decay > 0 and self._model is not None:
            frobenius_decay_(self._model, o.frob_decay)
        scale = self._rewarmup_scale()
        if scale < 1.0:
            saved = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * scale
            try:
                self.inner.optimizer_step(optimizer)
            finally:
                for g, lr in zip(optimizer.param_groups, saved):
                    g["lr"] = lr
        else:
            self.inner.optimizer_step(optimizer)
        if self.switched:
            self.steps_since_switch += 1

    def _rewarmup_scale(self) -> float:
        o: PufferfishOptions = self.options
        if not self.switched or o.rewarmup_epochs <= 0 or self.switch_epoch in (None, 0):
            return 1.0
        total = max(1, int(round(o.rewarmup_epochs * (self.steps_per_epoch or 1))))
        if self.steps_since_switch >= total:
            return 1.0
        return (self.steps_since_switch + 1) / total

    def clip_grad_norm_(self, max_norm: float) -> Any:
        inner = getattr(self.inner, "clip_grad_norm_", None)
        if inner is not None:
            return inner(max_norm)
        assert self._model is not None
        return nn.utils.clip_grad_norm_(self._model.parameters(), max_norm)

    # --- the switch -------------------------------------------------------------------------
    def on_epoch_end(self, epoch: int) -> bool:
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
        self.switched, self.switch_epoch = True, epoch
        self.inner = method_registry.create("ssgd")  # factors are small: plain all-reduce
        return True

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "switched": self.switched,
            "switch_epoch": self.switch_epoch,
            "ranks": self.ranks,
            "epochs_done": self.epochs_done,
            "steps": self.steps,
            "steps_per_epoch": self.steps_per_epoch,
            "steps_since_switch": self.steps_since_switch,
            "srank_init": self.srank_init,
            "rank_history": self.rank_history,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.switched = bool(state["switched"])
        self.switch_epoch = state.get("switch_epoch")
        self.ranks = state.get("ranks")
        self.epochs_done = int(state.get("epochs_done", 0))
        self.steps = int(state.get("steps", 0))
        self.steps_per_epoch = state.get("steps_per_epoch")
        self.steps_since_switch = int(state.get("steps_since_switch", 0))
        self.srank_init = state.get("srank_init")
        self.rank_history = list(state.get("rank_history", []))
        self.inner = method_registry.create("ssgd") if self.switched else self._initial_inner()
        self._pending_inner_state = state.get("inner") or None

    def describe(self) -> dict[str, Any]:
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

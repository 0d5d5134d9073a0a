"""A data-parallel engine that owns gradient synchronization through autograd hooks.

Instead of DDP's reducer, every trainable parameter gets a gradient-ready hook
(``register_post_accumulate_grad_hook``) that copies its gradient into the flat buffer of its
fusion group (:mod:`lowcomm.sched.groups`). When a group is complete its collective starts
at once, asynchronously, so communication overlaps the rest of backward. Groups are launched
strictly in reverse forward order (the "next group" pointer waits for stragglers) so the
sequence of collectives is identical on every rank — the property that keeps gloo/NCCL from
pairing the wrong operations.

Three modes (:class:`~lowcomm.sched.pairing.Mode`): ``allreduce`` (WFBP, MG-WFBP) all-reduces
each group and ``finish_sync`` writes the averaged gradient into ``p.grad`` for the user's
optimizer; ``dear`` (DeAR) and ``shard`` (Lee et al. 2018) reduce-scatter each group in
backward and defer the all-gather and the update to the next forward
(:mod:`lowcomm.sched.deferred`, :mod:`lowcomm.optim.sharded`; :mod:`lowcomm.sched.layer_update`
for lee18's ``update=layer``). Any codec can replace the gradient by its message
(:mod:`lowcomm.sched.payload`; the pairs that work: :mod:`lowcomm.sched.pairing`).

``flush()`` completes every pending all-gather (and update) so the weights are whole; call it
before evaluation, a checkpoint or a regrouping (lee18 also consolidates its sharded optimizer
state into the user's optimizer: ``optimizer.state_dict()`` is an ordinary checkpoint).

NaN/Inf and fp16 AMP (:meth:`Engine.attach_scaler`): ``allreduce`` mode leaves the averaged
(scaled) gradient in ``p.grad`` for the user's GradScaler, as DDP does; the sharded modes give
the scaler a view of their shards (:mod:`lowcomm.sched.shardview`). A group non-finite on one
rank is poisoned before its reduce-scatter (a codec poisons its message), and a sum that
overflows in one shard is caught by one all-reduced flag per step
(:func:`~lowcomm.sched.shardview.agree_nonfinite`), so every rank skips the same step.
Without a scaler, :meth:`Engine.nonfinite_this_step` is a device flag for the trainer's
single check.

``reducer`` (``hier``, :class:`lowcomm.comm.hierarchical.HierarchicalReducer`): sums groups and
codec all-reduces instead of the plain all-reduce (``start(buf, tag=)`` -> ``wait()``).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.compress.codec import Codec
from lowcomm.compress.feedback import StepFlags, finite_flag, poison_
from lowcomm.errors import UsageError
from lowcomm.sched.deferred import Deferred
from lowcomm.sched.groups import Group, Unit, build_groups, check_unused, collect_units, name_list
from lowcomm.sched.layer_update import LayerUpdate
from lowcomm.sched.pairing import Mode
from lowcomm.sched.payload import Carrier, world_and_rank
from lowcomm.sched.replicas import broadcast_buffers, broadcast_initial
from lowcomm.sched.shardview import ShardView, agree_nonfinite, clip_sharded_

__all__ = ["Engine", "Mode"]


class Engine:
    """Hooks, fused buffers and the collective schedule for one model (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: Mode | str,
        process_group: dist.ProcessGroup | None = None,
        tag: str = "sched",
        sizes: list[int] | None = None,
        broadcast_buffers: bool = True,
        codec: Codec | None = None,
        reducer: Any = None,
    ) -> None:
        self.model = model
        self.mode = Mode(mode)
        self.pg = process_group
        self.tag = tag
        self.broadcast_buffers = broadcast_buffers
        self.distributed, self.world, self.rank = world_and_rank(process_group)
        self.codec = codec
        self.reducer = reducer if self.distributed and self.world > 1 and self.mode is Mode.ALLREDUCE else None
        index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        self.carrier = (Carrier(codec, mode=self.mode, group=process_group, world=self.world, rank=self.rank,
                                distributed=self.distributed, tag=tag, param_index=index, reducer=self.reducer)
                        if codec is not None else None)
        self.units: list[Unit] = collect_units(model)
        self.groups: list[Group] = []
        self._loc: dict[int, tuple[int, int]] = {}
        self._module_group: dict[int, int] = {}
        self._unit_of: dict[int, int] = {id(p): u.index for u in self.units for p in u.params}
        self.sizes: list[int] = []
        self.deferred = Deferred(self)
        self.layer = LayerUpdate(self)  # lee18 update=layer: shards stepped in backward
        self.set_grouping(sizes or [1] * len(self.units))
        self.steps = 0  # completed synchronizations
        self._launch_ptr = 0
        self._defer_launch = True  # first backward: check for unused parameters before sending
        self._warned_missing = False
        # profiling of gradient-ready times (MG-WFBP)
        self.profiling = False
        self.ready_profile: list[list[float]] = []
        self._unit_ready = [0.0] * len(self.units)
        self._fwd_end = time.perf_counter()
        self.on_synced: list[Callable[[Engine], None]] = []
        self._handles: list[Any] = []
        #: optional ``torch.amp.GradScaler`` (fp16 AMP), see :meth:`attach_scaler`
        self.scaler: torch.amp.GradScaler | None = None
        self._shard_view = ShardView(lambda: self.groups, self._step, lambda: self.finite_flags.nonfinite())
        self.finite_flags = StepFlags()  # finiteness of each group's synchronized gradient
        self._broadcast_initial()
        self._register_hooks()

    # --- set-up ----------------------------------------------------------------------------
    def _src(self) -> int:
        return dist.get_global_rank(self.pg, 0) if self.pg is not None else 0

    def _broadcast_initial(self) -> None:
        """Start from rank 0's parameters and buffers, like DDP."""
        if self.distributed and self.world > 1:
            broadcast_initial(self.model, self._src(), self.pg, self.tag)

    def _register_hooks(self) -> None:
        for u in self.units:
            for p in u.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            if self.mode is not Mode.ALLREDUCE:
                self._handles.append(u.module.register_forward_pre_hook(self._on_forward_pre))

    def remove_hooks(self) -> None:
        """Detach from the model (before a re-wrap builds a new engine on it)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.reducer is not None and hasattr(self.reducer, "close"):
            self.reducer.close()

    def set_grouping(self, sizes: list[int]) -> None:
        """Re-fuse the units (forward-order unit counts per group). Nothing may be pending."""
        if any(g.pending or g.launched or g.ready for g in self.groups):
            raise RuntimeError("cannot regroup while communication is pending; flush() first")
        if any(g.msg is not None or g.full for g in self.groups):
            raise RuntimeError("cannot regroup while a compressed payload is pending; flush() first")
        if self.deferred.sharded is not None and self.deferred.sharded.dirty:  # lee18's shards
            raise RuntimeError("cannot regroup lee18 shards before flush() consolidates the optimizer state")
        self.deferred.sharded = None  # rebuilt over the new groups at the next step, from that state
        self.groups = build_groups(self.units, list(sizes), self.world)
        self.sizes = list(sizes)
        self._loc = {id(p): (g.index, i) for g in self.groups for i, p in enumerate(g.params)}
        self._module_group = {id(u.module): g.index for g in self.groups for u in g.units}

    # --- backward ---------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        gi, i = self._loc[id(p)]
        g = self.groups[gi]
        name = g.names[i]
        if g.pending:
            raise UsageError(
                f"parameter {name!r} was used in forward without its module's forward running "
                f"first, so {self.tag!r} could not bring it up to date in time; call the module "
                "itself (or use method ssgd/wfbp/mgwfbp)"
            )
        if i in g.ready:
            raise UsageError(
                f"gradient of {name!r} became ready twice in one step (several backward passes "
                "or reentrant checkpointing before the optimizer step); the scheduling engine "
                "needs exactly one backward per step"
            )
        if p.grad is None:
            return
        g.slice_of(i).copy_(p.grad.reshape(-1))
        if self.mode is not Mode.ALLREDUCE:
            p.grad = None  # the averaged gradient lives in the group's shard from now on
        g.ready.add(i)
        if self.profiling:
            u = self._unit_of[id(p)]
            self._unit_ready[u] = max(self._unit_ready[u], time.perf_counter() - self._fwd_end)
        if not self._defer_launch and len(g.ready) == len(g.params):
            self._try_launch()

    def _try_launch(self) -> None:
        n = len(self.groups)
        while self._launch_ptr < n:
            g = self.groups[n - 1 - self._launch_ptr]
            if len(g.ready) < len(g.params):
                return
            self._launch(g)
            self._launch_ptr += 1
            self.layer.launched(g)

    def _launch(self, g: Group) -> None:
        if g.padded > g.numel:
            g.flat[g.numel :].zero_()
        g.launched = True
        if self.carrier is not None and self.carrier.codec.active:
            self.carrier.launch(g)
            return
        if self.carrier is not None and self.carrier.codec.accumulates:
            self.carrier.accumulate(g)  # momentum correction: the warm-up averages the velocity
        if not self.distributed:
            if self.mode is not Mode.ALLREDUCE:
                g.shard.copy_(g.flat)
            return
        if self.mode is Mode.ALLREDUCE and self.reducer is not None:
            g.work = self.reducer.start(g.flat, tag=self.tag)
        elif self.mode is Mode.ALLREDUCE:
            g.work = accounting.all_reduce(g.flat, group=self.pg, async_op=True, tag=self.tag)
        else:
            # a reduce-scatter spreads a NaN only into one rank's shard: poison the whole
            # group so that every rank sees it and skips the same step (no host sync)
            poison_(g.flat, finite_flag(g.flat))
            g.work = accounting.reduce_scatter_tensor(
                g.shard, g.flat, group=self.pg, async_op=True, tag=f"{self.tag}.rs"
            )

    def _missing(self) -> list[tuple[Group, int]]:
        return [(g, i) for g in self.groups for i in range(len(g.params)) if i not in g.ready]

    def finish_sync(self) -> None:
        """Wait for this step's gradient collectives (the exposed communication wait)."""
        missing = self._missing()
        if self._defer_launch:
            self._check_unused(missing)
            self._defer_launch = False
        elif missing:
            if not self._warned_missing:
                warnings.warn(
                    f"{len(missing)} parameters got no gradient this step (e.g. "
                    f"{name_list([g.names[i] for g, i in missing])}); sending zeros for them",
                    stacklevel=2,
                )
                self._warned_missing = True
            for g, i in missing:
                g.slice_of(i).zero_()
                g.ready.add(i)
        self._try_launch()
        self.finite_flags.clear()
        for g in reversed(self.groups):
            self.finite_flags.note(self.layer.finite(g))
            g.ready.clear()
            g.launched = False
        if self.mode is not Mode.ALLREDUCE:  # shards: make every rank's skip decision the same
            agree_nonfinite(self.finite_flags, self._reduce(dist.ReduceOp.MAX, "finite"))
        self.layer.finish()
        self._launch_ptr = 0
        self.steps += 1
        if self.codec is not None:
            self.codec.end_step()
        if self.profiling:
            self.ready_profile.append(list(self._unit_ready))
            self._unit_ready = [0.0] * len(self.units)
        for cb in list(self.on_synced):
            cb(self)

    def _settle(self, g: Group) -> torch.Tensor:
        """Complete group ``g``'s backward exchange; return what carries its finiteness."""
        if g.work is not None:
            g.work.wait()  # type: ignore[attr-defined]
            g.work = None
        if g.msg is not None:
            assert self.carrier is not None
            synced = self.carrier.settle(g)
        elif self.mode is Mode.ALLREDUCE:
            g.flat.div_(self.world)
            synced = g.flat[: g.numel]
        else:
            g.shard.div_(self.world)
            synced = g.shard
        if self.mode is Mode.ALLREDUCE:
            for i, p in enumerate(g.params):
                avg = g.slice_of(i).view_as(p)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
        return synced

    def _reduce(self, op: Any, what: str) -> Callable[[torch.Tensor], None] | None:
        """An all-reduce with ``op`` counted under ``<tag>.<what>`` (None: one process)."""
        if not (self.distributed and self.world > 1):
            return None
        return lambda t: accounting.all_reduce(t, op=op, group=self.pg, tag=f"{self.tag}.{what}")

    def _check_unused(self, missing: list[tuple[Group, int]]) -> None:
        check_unused(self.groups, missing, self._reduce(dist.ReduceOp.SUM, "check") or (lambda t: None))

    # --- AMP and non-finite steps ---------------------------------------------------------
    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Use ``scaler`` (a ``torch.amp.GradScaler`` or None) from the next step on: the
        codec keeps its state in unscaled units, :meth:`unscale_` and :meth:`optimizer_step`
        follow GradScaler's semantics (unscale, skip the step on inf/NaN, ``update`` after)."""
        self.scaler = scaler
        if self.carrier is not None:
            self.carrier.scaler = scaler

    def _active_scaler(self) -> Any:
        s = self.scaler
        return s if s is not None and s.is_enabled() else None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this step's synchronized gradient by the loss scale and record the inf
        check in the scaler (no host sync); call after :meth:`finish_sync`, before clipping."""
        scaler = self._active_scaler()
        if scaler is None:
            return
        scaler.unscale_(optimizer if self.mode is Mode.ALLREDUCE else self._shard_view)

    def nonfinite_this_step(self) -> torch.Tensor | None:
        """0-dim bool device tensor: this step's synchronized gradient has a non-finite
        entry (the same on every rank). None before the first step. No host sync."""
        return self.finite_flags.nonfinite()

    def skip_step(self) -> None:
        """Skip this step's update: drop the summed message shards DeAR would decode at the
        next forward and any decoded gradient (the codec kept its state unless it was finite)."""
        for g in self.groups:
            g.msg = None
            g.full = False
        self.layer.undo()  # lee18 update=layer: restore the slices updated in backward

    # --- update -----------------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update; with a scaler attached, only if the scaler's inf check passes."""
        scaler = self._active_scaler()
        if self.mode is Mode.ALLREDUCE:
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
            return
        if scaler is None:
            self._step(optimizer)
            return
        self._shard_view.optimizer = optimizer
        try:
            stepped = scaler.step(self._shard_view)  # unscales first unless unscale_ ran
        finally:
            self._shard_view.optimizer = None
        if stepped is None:
            self.skip_step()

    def _step(self, optimizer: torch.optim.Optimizer) -> None:
        self.deferred.step(optimizer)

    def _on_forward_pre(self, module: nn.Module, _args: Any) -> None:
        gi = self._module_group.get(id(module))
        if gi is not None:
            self.deferred.ensure_ready(gi)

    def ensure_ready(self, gi: int) -> None:
        """Make group ``gi``'s parameters current (sharded modes; see :mod:`lowcomm.sched.deferred`)."""
        self.deferred.ensure_ready(gi)

    def flush(self) -> None:
        """Complete all pending all-gathers/updates so the weights are whole."""
        self.deferred.flush()

    # --- gradient clipping ------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm (call between ``finish_sync`` and the step)."""
        if self.mode is Mode.ALLREDUCE:
            params = [p for u in self.units for p in u.params]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if self.carrier is not None and self.carrier.scatters and self.mode is Mode.DEAR:
            # refused from step 0, not only once compression starts
            raise UsageError(
                f"{self.tag}: gradient clipping is not available with compress={self.carrier.codec.name}: "
                "between backward and the step this schedule holds only shards of the summed "
                "compressed message, not the gradient (use wfbp/mgwfbp with compression, or dear "
                "without it)"
            )
        if float(norm_type) != 2.0:
            raise UsageError(f"{self.tag}: only norm_type=2 clipping is supported, got {norm_type}")
        self.layer.before_clip()

        return clip_sharded_(self.groups, self.rank, self._reduce(dist.ReduceOp.SUM, "clip") or (lambda t: None),
                             max_norm)

    # --- forward helpers --------------------------------------------------------------------
    def before_forward(self) -> None:
        """Broadcast rank 0's buffers (BatchNorm statistics), like DDP, before a training forward."""
        if self.broadcast_buffers and self.distributed and self.world > 1 and self.model.training:
            broadcast_buffers(self.model, self._src(), self.pg, self.tag)

    def after_forward(self) -> None:
        """Note when forward ended (MG-WFBP measures gradient-ready times from here)."""
        self._fwd_end = time.perf_counter()

    def describe(self) -> dict[str, Any]:
        """Mode, grouping and codec, for the run summary."""
        d = {
            "mode": self.mode.value,
            "groups": len(self.groups),
            "group_sizes_units": list(self.sizes),
            "group_bytes": [g.numel * g.flat.element_size() for g in self.groups],
        }
        if self.codec is not None:
            d.update(self.codec.describe())
        return d

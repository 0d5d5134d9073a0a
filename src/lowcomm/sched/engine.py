"""A data-parallel engine that owns gradient synchronization through autograd hooks.

Instead of DDP's reducer, every trainable parameter gets a gradient-ready hook
(``register_post_accumulate_grad_hook``) that copies its gradient into the flat buffer of its
fusion group (:mod:`lowcomm.sched.groups`). When a group is complete its collective starts
at once, asynchronously, so communication overlaps the rest of backward. Groups are launched
strictly in reverse forward order (the "next group" pointer waits for stragglers) so the
sequence of collectives is identical on every rank — the property that keeps gloo/NCCL from
pairing the wrong operations.

Three modes (:class:`Mode`):

* ``allreduce`` (WFBP, MG-WFBP): all-reduce each group; ``finish_sync`` waits and writes the
  averaged gradient into ``p.grad``; the user's optimizer steps as usual.
* ``dear`` (DeAR): reduce-scatter each group during backward; ``optimizer_step`` only records
  the optimizer and its hyperparameters and starts the all-gather of group 0. A forward
  pre-hook on each layer waits for its group's all-gather, starts the next group's (one group
  ahead), writes the averaged gradient into ``p.grad`` and runs the user's optimizer on that
  group's parameters only, with the hyperparameters recorded at ``optimizer_step`` (so an LR
  scheduler stepped in between does not leak in). Elementwise optimizers (SGD with momentum,
  Nesterov, weight decay; Adam/AdamW) give exactly DDP's update.
* ``shard`` (Lee et al. 2018): reduce-scatter during backward; ``optimizer_step`` updates only
  this rank's 1/P shard with a sharded copy of the optimizer (same class and hyperparameters,
  state only for the shard); the forward pre-hooks all-gather the updated parameters one
  group ahead of the forward.

Low-rank payloads (``codec``, :mod:`lowcomm.sched.lowrank`): once the codec is active, a
complete group is encoded (ACP-SGD: one fused buffer of uncompressed tensors and P *or* Q
factors; PowerSGD: ``[unc, P]`` all-reduced synchronously at launch, then ``Q``) and that
buffer travels instead of the gradient — all-reduced in ``allreduce`` mode, reduce-scattered
in backward and all-gathered before the next forward in ``dear`` mode (ACP-SGD only: its
message is a plain sum). The decode writes the averaged gradient into the group's buffer,
from where it reaches ``p.grad`` exactly as an uncompressed one would.

``flush()`` completes every pending all-gather (and, for ``dear``, update) so the weights are
whole; call it before evaluation or a checkpoint. For ``shard`` it also gathers the sharded
optimizer state into the user's optimizer, so ``optimizer.state_dict()`` on rank 0 is a full,
ordinary checkpoint (loadable by any method); the next step re-shards it.

NaN/Inf and fp16 AMP (:meth:`Engine.attach_scaler`): ``allreduce`` mode leaves the averaged
(scaled) gradient in ``p.grad`` and the user's GradScaler works as with DDP. The sharded
modes hold the gradient only as shards between backward and the step, so the engine gives the
scaler an optimizer-shaped view of those shards (:class:`_ShardView`): ``scaler.unscale_``
unscales them and records the inf check, ``scaler.step`` decides (its one host sync) and
calls back into the engine's own step, ``scaler.update`` backs off as usual. A group whose
gradient is non-finite on one rank is filled with NaN before its reduce-scatter, so every
rank's shards are non-finite and every rank skips the same step. The low-rank codec works in
unscaled units (its factor shards need no unscaling). Without a scaler,
:meth:`Engine.nonfinite_this_step` is a device flag for the trainer's single check.
"""

from __future__ import annotations

import inspect
import time
import warnings
from enum import Enum
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.compress.feedback import StepFlags, finite_flag, poison_
from lowcomm.runtime import timing
from lowcomm.errors import UsageError
from lowcomm.sched.groups import Group, Unit, build_groups, collect_units
from lowcomm.sched.lowrank import LowRankCodec, Message


class Mode(str, Enum):
    ALLREDUCE = "allreduce"
    DEAR = "dear"
    SHARD = "shard"


def _names(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _ShardView:
    """What ``torch.amp.GradScaler`` needs of an optimizer, over the engine's gradient shards.

    ``param_groups`` exposes each uncompressed shard as the ``.grad`` of an alias tensor (so
    ``unscale_`` unscales the shards in place and checks them) plus one sentinel element that
    is NaN when a pending low-rank factor shard is non-finite (those are already unscaled
    and must not be divided again). ``step`` runs the engine's real update; GradScaler only
    calls it when the check found nothing, and returns its ``True``.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        shards, factors = [], []
        for g in self.engine.groups:
            msg = g.msg
            if msg is None:
                shards.append(g.shard)
            else:
                factors.append(msg.shard if msg.shard is not None else msg.buf)  # type: ignore[union-attr]
        device = self.engine.groups[0].flat.device
        ok = torch.stack([finite_flag(f) for f in factors]).all() if factors else torch.ones((), dtype=torch.bool, device=device)
        sentinel = torch.where(ok, 0.0, float("nan")).to(torch.float32).reshape(1)
        params = []
        for grad in [*shards, sentinel]:
            alias = grad.detach()
            alias.grad = grad
            params.append(alias)
        return [{"params": params}]

    def step(self) -> bool:
        assert self.optimizer is not None
        self.engine._step(self.optimizer)
        return True


class Engine:
    """Hooks, fused buffers and the collective schedule for one model (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        mode: Mode | str,
        process_group: Any = None,
        tag: str = "sched",
        sizes: list[int] | None = None,
        broadcast_buffers: bool = True,
        codec: LowRankCodec | None = None,
    ) -> None:
        self.model = model
        self.codec = codec
        self.mode = Mode(mode)
        self.pg = process_group
        self.tag = tag
        self.broadcast_buffers = broadcast_buffers
        self.distributed = dist.is_initialized()
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.units: list[Unit] = collect_units(model)
        self.groups: list[Group] = []
        self._loc: dict[int, tuple[int, int]] = {}
        self._module_group: dict[int, int] = {}
        self._unit_of: dict[int, int] = {id(p): u.index for u in self.units for p in u.params}
        self.sizes: list[int] = []
        self.shard_opt: torch.optim.Optimizer | None = None
        self.set_grouping(sizes or [1] * len(self.units))
        self.steps = 0  # completed synchronizations
        self._launch_ptr = 0
        self._defer_launch = True  # first backward: check for unused parameters before sending
        self._warned_missing = False
        self.optimizer: torch.optim.Optimizer | None = None
        self._hyper: list[dict[str, Any]] = []
        self._pieces: list[tuple[nn.Parameter, int, int, int, int, nn.Parameter]] = []
        self._state_dirty = False
        # profiling of gradient-ready times (MG-WFBP)
        self.profiling = False
        self.ready_profile: list[list[float]] = []
        self._unit_ready = [0.0] * len(self.units)
        self._fwd_end = time.perf_counter()
        self.on_synced: list[Callable[[Engine], None]] = []
        self._handles: list[Any] = []
        #: optional ``torch.amp.GradScaler`` (fp16 AMP), see :meth:`attach_scaler`
        self.scaler: Any = None
        self._shard_view = _ShardView(self)
        self.finite_flags = StepFlags()  # finiteness of each group's synchronized gradient
        self._broadcast_initial()
        self._register_hooks()

    # --- set-up ----------------------------------------------------------------------------
    def _broadcast_initial(self) -> None:
        """Start from rank 0's parameters and buffers, like DDP."""
        if not self.distributed or self.world == 1:
            return
        src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                accounting.broadcast(t.data, src, group=self.pg, tag=f"{self.tag}.init")


    def _register_hooks(self) -> None:
        for u in self.units:
            for p in u.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            if self.mode is not Mode.ALLREDUCE:
                self._handles.append(u.module.register_forward_pre_hook(self._on_forward_pre))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def set_grouping(self, sizes: list[int]) -> None:
        """Re-fuse the units (forward-order unit counts per group). Nothing may be pending."""
        if any(g.pending or g.launched or g.ready for g in self.groups):
            raise RuntimeError("cannot regroup while communication is pending; flush() first")
        if any(g.msg is not None for g in self.groups):
            raise RuntimeError("cannot regroup while a low-rank payload is pending; flush() first")
        if self.mode is Mode.SHARD and self.shard_opt is not None:
            raise RuntimeError("lee18 shards cannot be regrouped after the first step")
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

    def _launch(self, g: Group) -> None:
        if g.padded > g.numel:
            g.flat[g.numel :].zero_()
        g.launched = True
        if self.codec is not None and self.codec.active:
            self._launch_compressed(g)
            return
        if not self.distributed:
            if self.mode is not Mode.ALLREDUCE:
                g.shard.copy_(g.flat)
            return
        if self.mode is Mode.ALLREDUCE:
            g.work = accounting.all_reduce(g.flat, group=self.pg, async_op=True, tag=self.tag)
        else:
            # a reduce-scatter spreads a NaN only into one rank's shard: poison the whole
            # group so that every rank sees it and skips the same step (no host sync)
            poison_(g.flat, finite_flag(g.flat))
            g.work = accounting.reduce_scatter_tensor(
                g.shard, g.flat, group=self.pg, async_op=True, tag=f"{self.tag}.rs"
            )

    def _launch_compressed(self, g: Group) -> None:
        assert self.codec is not None
        codec, ctag = self.codec, f"{self.tag}.{self.codec.kind}"
        # DeAR applies the decoded gradient itself: it stays in unscaled units (see _ShardView)
        rescale = self.mode is Mode.ALLREDUCE
        msg = codec.begin(g, pad_to=self.world if self.mode is Mode.DEAR else 1, rescale=rescale)
        while not msg.final:  # PowerSGD's P: needed before Q can be computed
            if self.distributed:
                accounting.all_reduce(msg.buf, group=self.pg, tag=f"{ctag}.{msg.name}")
            msg = codec.advance(msg)
        g.msg = msg
        if not self.distributed:
            return
        if self.mode is Mode.ALLREDUCE:
            g.work = accounting.all_reduce(msg.buf, group=self.pg, async_op=True, tag=f"{ctag}.{msg.name}")
        else:
            msg.shard = msg.buf.new_empty(msg.buf.numel() // self.world)
            g.work = accounting.reduce_scatter_tensor(
                msg.shard, msg.buf, group=self.pg, async_op=True, tag=f"{ctag}.{msg.name}.rs"
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
                    f"{_names([g.names[i] for g, i in missing])}); sending zeros for them"
                )
                self._warned_missing = True
            for g, i in missing:
                g.slice_of(i).zero_()
                g.ready.add(i)
        self._try_launch()
        self.finite_flags.clear()
        for k in range(len(self.groups) - 1, -1, -1):
            g = self.groups[k]
            if g.work is not None:
                g.work.wait()  # type: ignore[attr-defined]
                g.work = None
            msg = g.msg
            if msg is not None and self.mode is Mode.DEAR:
                # summed factor shard: all-gathered and decoded before the next forward
                self.finite_flags.note(finite_flag(msg.shard if msg.shard is not None else msg.buf))
            elif self.mode is Mode.ALLREDUCE:
                if msg is not None:
                    assert self.codec is not None
                    self.codec.finish(msg)  # type: ignore[arg-type]
                    g.msg = None
                else:
                    g.flat.div_(self.world)
                self.finite_flags.note(finite_flag(g.flat[: g.numel]))
                for i, p in enumerate(g.params):
                    avg = g.slice_of(i).view_as(p)
                    if p.grad is None:
                        p.grad = avg.clone()
                    else:
                        p.grad.copy_(avg)
            else:
                g.shard.div_(self.world)
                self.finite_flags.note(finite_flag(g.shard))
            g.ready.clear()
            g.launched = False
        self._launch_ptr = 0
        self.steps += 1
        if self.codec is not None:
            self.codec.step += 1
        if self.profiling:
            self.ready_profile.append(list(self._unit_ready))
            self._unit_ready = [0.0] * len(self.units)
        for cb in list(self.on_synced):
            cb(self)

    def _check_unused(self, missing: list[tuple[Group, int]]) -> None:
        """First backward: refuse parameters that received no gradient, on every rank at once.

        The count lives on the gradients' device (a process group on NCCL alone has no CPU
        backend). Reading it back is one host sync, on the first backward only: whether to
        raise has to be decided on the host, identically on every rank.
        """
        device = self.groups[0].flat.device if self.groups else torch.device("cpu")
        count = torch.tensor([float(len(missing))], device=device)
        if self.distributed and self.world > 1:
            accounting.all_reduce(count, group=self.pg, tag=f"{self.tag}.check")
        total = int(count.item())
        if total > 0:
            local = _names([g.names[i] for g, i in missing]) if missing else "none on this rank"
            raise UsageError(
                f"{total} trainable parameters (summed over ranks) got no gradient in "
                f"the first backward ({local}); the scheduling engine needs every trainable "
                "parameter used in each step: freeze unused ones with requires_grad_(False)"
            )

    # --- AMP and non-finite steps ---------------------------------------------------------
    def attach_scaler(self, scaler: Any) -> None:
        """Use ``scaler`` (a ``torch.amp.GradScaler`` or None) from the next step on: the
        codec keeps its state in unscaled units, :meth:`unscale_` and :meth:`optimizer_step`
        follow GradScaler's semantics (unscale, skip the step on inf/NaN, ``update`` after)."""
        self.scaler = scaler
        if self.codec is not None:
            self.codec.attach_scaler(scaler)

    def _active_scaler(self) -> Any:
        s = self.scaler
        return s if s is not None and s.is_enabled() else None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this step's synchronized gradient by the loss scale and record the inf
        check in the scaler (no host sync); call after :meth:`finish_sync`, before clipping."""
        scaler = self._active_scaler()
        if scaler is None:
            return
        if self.mode is Mode.ALLREDUCE:
            scaler.unscale_(optimizer)
        else:
            scaler.unscale_(self._shard_view)

    def nonfinite_this_step(self) -> torch.Tensor | None:
        """0-dim bool device tensor: this step's synchronized gradient has a non-finite
        entry (the same on every rank). None before the first step. No host sync."""
        return self.finite_flags.nonfinite()

    def skip_step(self) -> None:
        """Skip this step's update: drop the summed factor shards DeAR would decode at the
        next forward (the codec keeps its factors unless the aggregate was finite)."""
        for g in self.groups:
            g.msg = None

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
        """Sharded modes: record (DeAR) or run (lee18) the update, start the all-gathers."""
        self.optimizer = optimizer
        if self.mode is Mode.DEAR:
            self._hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer.param_groups]
        else:
            self._shard_step(optimizer)
        for g in self.groups:
            g.pending = True
        self._launch_ag(self.groups[0])

    def _launch_ag(self, g: Group) -> None:
        if not g.pending or g.ag_work is not None:
            return
        msg: Message | None = g.msg  # type: ignore[assignment]
        if msg is not None:  # DeAR + ACP-SGD: gather the summed factor shards
            if self.distributed:
                assert self.codec is not None
                tag = f"{self.tag}.{self.codec.kind}.{msg.name}.ag"
                g.ag_work = accounting.all_gather_into_tensor(
                    msg.buf, msg.shard, group=self.pg, async_op=True, tag=tag
                )
            else:
                g.ag_work = True
            return
        src = g.shard if self.mode is Mode.DEAR else g.param_shard  # type: ignore[attr-defined]
        if not self.distributed:
            g.flat.copy_(src)
            g.ag_work = True
            return
        g.ag_work = accounting.all_gather_into_tensor(
            g.flat, src, group=self.pg, async_op=True, tag=f"{self.tag}.ag"
        )

    def _on_forward_pre(self, module: nn.Module, _args: Any) -> None:
        gi = self._module_group.get(id(module))
        if gi is not None:
            self.ensure_ready(gi)

    def ensure_ready(self, gi: int) -> None:
        """Make group ``gi``'s parameters current; start the next pending group's all-gather."""
        g = self.groups[gi]
        if not g.pending:
            return
        self._launch_ag(g)
        if g.ag_work is not True:
            with timing.measure("comm_wait"):  # exposed all-gather wait inside forward
                g.ag_work.wait()  # type: ignore[union-attr]
        g.ag_work = None
        g.pending = False
        for nxt in self.groups[gi + 1 :]:
            if nxt.pending:
                self._launch_ag(nxt)
                break
        if g.msg is not None:
            assert self.codec is not None
            self.codec.finish(g.msg)  # type: ignore[arg-type]  # averaged gradient -> g.flat
            g.msg = None
        if self.mode is Mode.DEAR:
            self._apply_dear_update(g)
        else:
            with torch.no_grad():
                for i, p in enumerate(g.params):
                    p.copy_(g.slice_of(i).view_as(p))

    def _apply_dear_update(self, g: Group) -> None:
        opt = self.optimizer
        assert opt is not None
        members = {id(p) for p in g.params}
        for i, p in enumerate(g.params):
            p.grad = g.slice_of(i).view_as(p)
        original = opt.param_groups
        subset = []
        for pg, hyper in zip(original, self._hyper):
            params = [p for p in pg["params"] if id(p) in members]
            if params:
                subset.append({**pg, **hyper, "params": params})
        try:
            opt.param_groups = subset
            opt.step()
        finally:
            opt.param_groups = original
            for p in g.params:
                p.grad = None

    def flush(self) -> None:
        """Complete all pending all-gathers/updates so the weights are whole."""
        for g in self.groups:
            self.ensure_ready(g.index)
        if self.mode is Mode.SHARD and self._state_dirty and self.optimizer is not None:
            self._consolidate_state(self.optimizer)

    # --- lee18: sharded optimizer -----------------------------------------------------------
    def _shard_range(self, g: Group) -> tuple[int, int]:
        s = g.shard.numel()
        return self.rank * s, (self.rank + 1) * s

    def _build_shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        pieces_of: dict[int, nn.Parameter] = {}
        self._pieces = []
        for g in self.groups:
            lo, hi = self._shard_range(g)
            g.param_shard = torch.zeros_like(g.shard)  # type: ignore[attr-defined]
            for i, p in enumerate(g.params):
                o = g.offsets[i]
                a, b = max(lo, o), min(hi, o + p.numel())
                if b <= a:
                    # empty piece: keeps per-parameter state (e.g. AdamW's step) on every rank
                    piece = nn.Parameter(g.param_shard[0:0])  # type: ignore[attr-defined]
                    piece.grad = g.shard[0:0]
                    pieces_of[id(p)] = piece
                    self._pieces.append((p, g.index, i, 0, 0, piece))
                    continue
                view = g.param_shard[a - lo : b - lo]  # type: ignore[attr-defined]
                with torch.no_grad():
                    view.copy_(p.detach().reshape(-1)[a - o : b - o])
                piece = nn.Parameter(view)
                piece.grad = g.shard[a - lo : b - lo]
                pieces_of[id(p)] = piece
                self._pieces.append((p, g.index, i, a - o, b - o, piece))
        groups = []
        for pg in optimizer.param_groups:
            ps = [pieces_of[id(p)] for p in pg["params"] if id(p) in pieces_of]
            groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": ps})
        groups = [g for g in groups if g["params"]]
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            self.shard_opt = cls(groups, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise UsageError(
                f"lee18 could not build a sharded copy of {cls.__name__} ({e}); it needs an "
                "elementwise torch optimizer such as SGD, Adam or AdamW"
            ) from None
        self._user_groups = [
            [id(p) for p in pg["params"] if id(p) in pieces_of] for pg in optimizer.param_groups
        ]

    def _import_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Take this rank's slice of any full optimizer state (checkpoint or consolidation)."""
        assert self.shard_opt is not None
        for p, _gi, _i, a, b, piece in self._pieces:
            full = optimizer.state.pop(p, None)
            if not full:
                continue
            st = {}
            for k, v in full.items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    st[k] = v.detach().reshape(-1)[a:b].clone()
                else:
                    st[k] = v.clone() if torch.is_tensor(v) else v
            self.shard_opt.state[piece] = st

    def _shard_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.shard_opt is None:
            self._build_shard_optimizer(optimizer)
        assert self.shard_opt is not None
        self._import_state(optimizer)
        live = [pg for pg, ids in zip(optimizer.param_groups, self._user_groups) if ids]
        for upg, spg in zip(live, self.shard_opt.param_groups):
            for k, v in upg.items():
                if k != "params":
                    spg[k] = v
        for _p, gi, _i, a, b, piece in self._pieces:
            g = self.groups[gi]
            lo = self._shard_range(g)[0]
            off = g.offsets[_i]
            piece.grad = g.shard[off + a - lo : off + b - lo] if b > a else g.shard[0:0]
        self.shard_opt.step()
        self._state_dirty = True

    def _consolidate_state(self, optimizer: torch.optim.Optimizer) -> None:
        """All-gather the shard optimizer state into ``optimizer.state`` as full tensors."""
        assert self.shard_opt is not None
        by_group: dict[int, list[tuple[nn.Parameter, int, int, int, nn.Parameter]]] = {}
        for p, gi, i, a, b, piece in self._pieces:
            by_group.setdefault(gi, []).append((p, i, a, b, piece))
        for gi, items in by_group.items():
            g = self.groups[gi]
            lo = self._shard_range(g)[0]
            keys = sorted(
                {
                    k
                    for _p, _i, _a, _b, piece in items
                    for k, v in self.shard_opt.state.get(piece, {}).items()
                    if torch.is_tensor(v) and v.shape == piece.shape
                }
            )
            full_by_key = {}
            for k in keys:
                local = torch.zeros_like(g.shard)
                for _p, i, a, b, piece in items:
                    v = self.shard_opt.state.get(piece, {}).get(k)
                    if v is not None and b > a:
                        start = g.offsets[i] + a - lo
                        local[start : start + (b - a)] = v
                full = torch.empty_like(g.flat)
                if self.distributed:
                    accounting.all_gather_into_tensor(full, local, group=self.pg, tag=f"{self.tag}.state")
                else:
                    full.copy_(local)
                full_by_key[k] = full
            for p, i, _a, _b, piece in items:
                st: dict[str, Any] = {}
                for k, v in self.shard_opt.state.get(piece, {}).items():
                    if k in full_by_key:
                        o = g.offsets[i]
                        st[k] = full_by_key[k][o : o + p.numel()].view_as(p).clone()
                    else:
                        st[k] = v.clone() if torch.is_tensor(v) else v
                if st:
                    optimizer.state[p] = st
        self._state_dirty = False

    # --- gradient clipping ------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm (call between ``finish_sync`` and the step)."""
        if self.mode is Mode.ALLREDUCE:
            params = [p for u in self.units for p in u.params]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if self.codec is not None:  # refused from step 0, not only once compression starts
            raise UsageError(
                f"{self.tag}: gradient clipping is not available with compress="
                f"{self.codec.kind if self.codec else '?'}: between backward and the step this "
                "schedule holds only shards of the summed low-rank factors, not the gradient "
                "(use wfbp/mgwfbp with compression, or dear without it)"
            )
        if float(norm_type) != 2.0:
            raise UsageError(f"{self.tag}: only norm_type=2 clipping is supported, got {norm_type}")
        sq = torch.zeros(1, dtype=torch.float64, device=self.groups[0].shard.device)
        for g in self.groups:
            sq += g.shard.double().pow(2).sum()
        if self.distributed and self.world > 1:
            accounting.all_reduce(sq, group=self.pg, tag=f"{self.tag}.clip")
        total = sq.sqrt().to(self.groups[0].shard.dtype)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in self.groups:
                g.shard.mul_(coef)
        return total.squeeze(0)

    # --- forward helpers --------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.broadcast_buffers and self.distributed and self.world > 1 and self.model.training:
            bufs = [b for b in self.model.buffers() if b.numel()]
            if bufs:
                flat = torch._utils._flatten_dense_tensors([b.data for b in bufs])
                src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
                accounting.broadcast(flat, src, group=self.pg, tag=f"{self.tag}.buffers")
                for b, v in zip(bufs, torch._utils._unflatten_dense_tensors(flat, bufs)):
                    b.data.copy_(v)

    def after_forward(self) -> None:
        self._fwd_end = time.perf_counter()

    def describe(self) -> dict[str, Any]:
        d = {
            "mode": self.mode.value,
            "groups": len(self.groups),
            "group_sizes_units": list(self.sizes),
            "group_bytes": [g.numel * g.flat.element_size() for g in self.groups],
        }
        if self.codec is not None:
            d.update(self.codec.describe())
        return d


class ScheduledModule(nn.Module):
    """What ``method.wrap`` returns: calls the model; the engine's hooks do the rest.

    Like DDP, the model is available as ``.module`` (state-dict keys get a ``module.`` prefix).
    """

    def __init__(self, module: nn.Module, engine: Engine) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "engine", engine)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.before_forward()
        out = self.module(*args, **kwargs)
        self.engine.after_forward()
        return out


"""The shard-aware update used by the ``dear`` and ``lee18`` schedules, for any torch optimizer.

Why it is here and not in the engine: *when* gradients travel is the schedule's business
(:mod:`lowcomm.sched.engine`), *how* they become new weights is the update axis. Both sharded
schedules change only the second in one of two ways, and neither needs its own optimizer:

* **per-group step** (DeAR, :func:`step_subset`): the averaged gradient of one fusion group
  arrives just before that group's forward, so the user's optimizer runs on that group's
  parameters only, with the hyperparameters recorded when the user called the step
  (:func:`hyperparameters`: an LR scheduler stepped in between must not leak in). For an
  elementwise optimizer (SGD with momentum/Nesterov/weight decay, Adam, AdamW) the union of
  the per-group steps is exactly one ordinary step.
* **sharded optimizer** (Lee et al. 2018, :class:`ShardedOptimizer`): each rank updates only
  its 1/P slice of every fused buffer with a copy of the user's optimizer (same class and
  hyperparameters) whose state covers just that slice; only an optimizer in
  :data:`ELEMENTWISE_OPTIMIZERS` is accepted, since a per-tensor rule (Adafactor's factors,
  LARS/LAMB trust ratios) applied to a slice is a different rule. A full optimizer state (a checkpoint,
  or the consolidation after a flush) is imported slice-wise, and :meth:`ShardedOptimizer.consolidate`
  writes the full state back into the user's optimizer, so ``optimizer.state_dict()`` stays an
  ordinary checkpoint any method can load.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lowcomm.errors import UsageError


#: Torch optimizers whose update of one parameter element reads only that element's gradient,
#: state and the step count (no per-tensor norm, no factored second moment), with any of their
#: options. Why a list and not a check of the class: lee18 updates each rank's 1/P slice of a
#: parameter with its own optimizer copy, so anything that looks across a tensor (Adafactor's
#: row/column factors, LARS/LAMB trust ratios) silently computes something else. A new
#: elementwise optimizer joins here (or via :func:`register_elementwise`) once that is checked.
ELEMENTWISE_OPTIMIZERS: set[type[torch.optim.Optimizer]] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adamax, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
    torch.optim.Rprop, torch.optim.ASGD,
}


def register_elementwise(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Class decorator: declare an optimizer elementwise (safe to shard, see
    :data:`ELEMENTWISE_OPTIMIZERS`)."""
    ELEMENTWISE_OPTIMIZERS.add(cls)
    return cls


def is_elementwise(optimizer: torch.optim.Optimizer | type[torch.optim.Optimizer]) -> bool:
    """True when ``optimizer`` (or its class) is exactly an allowlisted class: a subclass may
    override ``step`` with a per-tensor rule, so it must be registered itself."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return cls in ELEMENTWISE_OPTIMIZERS


def check_elementwise(optimizer: torch.optim.Optimizer, owner: str = "lee18") -> None:
    """Refuse, in one line, an optimizer that sharding would silently change."""
    if not is_elementwise(optimizer):
        valid = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
        raise UsageError(
            f"{owner} updates 1/P slices of each parameter, so it needs an elementwise optimizer; "
            f"{type(optimizer).__name__} is not one (valid: {valid})"
        )


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (everything but ``params``), as they are now."""
    return [{k: v for k, v in pg.items() if k != "params"} for pg in optimizer.param_groups]


def step_subset(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                grads: Sequence[torch.Tensor], hyper: Sequence[dict[str, Any]]) -> None:
    """Run ``optimizer.step()`` on ``params`` only, with gradients ``grads`` and the recorded
    hyperparameters ``hyper`` (one dict per param group, from :func:`hyperparameters`).

    The optimizer's state (momentum, Adam moments, step counts) is keyed by parameter, so
    stepping a subset updates exactly that subset's state. The ``.grad`` of ``params`` is
    cleared afterwards: the gradient lives in the caller's buffer.
    """
    members = {id(p) for p in params}
    for p, g in zip(params, grads):
        p.grad = g
    original = optimizer.param_groups
    subset = []
    for pg, h in zip(original, hyper):
        ps = [p for p in pg["params"] if id(p) in members]
        if ps:
            subset.append({**pg, **h, "params": ps})
    try:
        optimizer.param_groups = subset
        optimizer.step()
    finally:
        optimizer.param_groups = original
        for p in params:
            p.grad = None


@dataclass
class FlatShard:
    """One fused buffer as one rank sees it: its parameters at ``offsets`` in the flat buffer
    of ``numel`` elements, and ``grad``, this rank's slice of the averaged gradient, which
    starts at ``lo``."""

    params: list[nn.Parameter]
    offsets: list[int]
    grad: torch.Tensor
    lo: int


@dataclass
class _Piece:
    """The part ``[a, b)`` of parameter ``param`` (buffer ``k``, position ``i``) this rank owns."""

    param: nn.Parameter
    k: int
    i: int
    a: int
    b: int
    piece: nn.Parameter


def _copy_into(src: Any, dst: Any) -> Any:
    """``src`` copied into ``dst`` when ``dst`` is a tensor of the same kind, else a new copy.

    Why reuse: a fresh copy of the whole shard every step costs its allocation (page faults
    on CPU) more than the copy itself; the buffers of the last snapshot are free again."""
    if not torch.is_tensor(src):
        return copy.deepcopy(src)
    if torch.is_tensor(dst) and dst.shape == src.shape and dst.dtype == src.dtype and dst.device == src.device:
        return dst.copy_(src)
    return src.clone()


def _copy_state(state: dict[str, Any] | None, into: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of one parameter's optimizer state, reusing ``into``'s tensors (None: no state)."""
    if state is None:
        return None
    return {k: _copy_into(v, (into or {}).get(k)) for k, v in state.items()}


@dataclass
class Snapshot:
    """Buffer ``k``'s slice before one :meth:`ShardedOptimizer.step_buffer`: its weights and
    the state of each of its pieces (by ``id``)."""

    k: int
    weights: torch.Tensor
    state: dict[int, dict[str, Any] | None]


class ShardedOptimizer:
    """A copy of the user's optimizer over this rank's slice of every buffer (lee18).

    :attr:`param_shards` hold this rank's slice of each buffer's parameters; the schedule
    all-gathers them into the full weights after :meth:`step`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: Sequence[FlatShard], *, owner: str = "lee18") -> None:
        check_elementwise(optimizer, owner)
        self.buffers = list(buffers)
        self.param_shards: list[torch.Tensor] = []
        self.pieces: list[_Piece] = []
        self.dirty = False  # stepped since the last consolidation
        pieces_of: dict[int, nn.Parameter] = {}
        for k, buf in enumerate(self.buffers):
            shard = torch.zeros_like(buf.grad)
            self.param_shards.append(shard)
            lo, hi = buf.lo, buf.lo + buf.grad.numel()
            for i, p in enumerate(buf.params):
                o = buf.offsets[i]
                a, b = max(lo, o), min(hi, o + p.numel())
                if b <= a:  # empty piece: keeps per-parameter state (AdamW's step) on every rank
                    piece = nn.Parameter(shard[0:0])
                    a = b = 0
                else:
                    view = shard[a - lo : b - lo]
                    with torch.no_grad():
                        view.copy_(p.detach().reshape(-1)[a - o : b - o])
                    piece = nn.Parameter(view)
                    a, b = a - o, b - o
                pieces_of[id(p)] = piece
                self.pieces.append(_Piece(p, k, i, a, b, piece))
        self._set_grads()
        self._pieces_of = [[pc.piece for pc in self.pieces if pc.k == k] for k in range(len(self.buffers))]
        self._snapshots: dict[int, Snapshot] = {}  # the last one per buffer (its buffers are reused)
        groups = [{**{k: v for k, v in pg.items() if k != "params"},
                   "params": [pieces_of[id(p)] for p in pg["params"] if id(p) in pieces_of]}
                  for pg in optimizer.param_groups]
        self._live = [bool(g["params"]) for g in groups]
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        except Exception as e:  # noqa: BLE001
            raise UsageError(
                f"{owner} could not build a sharded copy of {cls.__name__} ({e}); it needs an "
                "elementwise torch optimizer such as SGD, Adam or AdamW"
            ) from None

    def _set_grads(self, only: int | None = None) -> None:
        for pc in self.pieces:
            if only is not None and pc.k != only:
                continue
            buf = self.buffers[pc.k]
            start = buf.offsets[pc.i] + pc.a - buf.lo
            pc.piece.grad = buf.grad[start : start + (pc.b - pc.a)] if pc.b > pc.a else buf.grad[0:0]

    def import_state(self, optimizer: torch.optim.Optimizer, only: int | None = None) -> None:
        """Take this rank's slice of any full state in ``optimizer`` (a loaded checkpoint or a
        consolidation) and drop it there: from now on the slice is the state (``only``: only
        buffer ``only``'s parameters)."""
        for pc in self.pieces:
            if only is not None and pc.k != only:
                continue
            full = optimizer.state.pop(pc.param, None)
            if not full:
                continue
            st = {}
            for k, v in full.items():
                if torch.is_tensor(v) and v.shape == pc.param.shape:
                    st[k] = v.detach().reshape(-1)[pc.a : pc.b].clone()
                else:
                    st[k] = v.clone() if torch.is_tensor(v) else v
            self.optimizer.state[pc.piece] = st

    def _take_hyperparameters(self, optimizer: torch.optim.Optimizer) -> None:
        """lr, momentum, ... as the user's optimizer holds them now (an LR scheduler's or the
        user's own changes between steps are honoured)."""
        live = [pg for pg, ok in zip(optimizer.param_groups, self._live) if ok]
        for upg, spg in zip(live, self.optimizer.param_groups):
            for k, v in upg.items():
                if k != "params":
                    spg[k] = v

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update of this rank's slices with ``optimizer``'s current hyperparameters."""
        self.import_state(optimizer)
        self._take_hyperparameters(optimizer)
        self._set_grads()
        self.optimizer.step()
        self.dirty = True

    def step_buffer(self, optimizer: torch.optim.Optimizer, k: int) -> Snapshot:
        """Update buffer ``k``'s slice only (lee18's per-layer update), with ``optimizer``'s
        hyperparameters as they are now; returns what :meth:`restore` needs to undo it.

        Why a subset step is the same update: the allowlisted optimizers are elementwise and
        keep their state per parameter (per piece here), so stepping the pieces of each buffer
        once, in any order, is one ordinary step. The snapshot (this slice's weights and
        state, 1/P of the buffer) is what lets a step found non-finite only later, in another
        group, be skipped exactly."""
        self.import_state(optimizer, k)
        self._take_hyperparameters(optimizer)
        mine = self._pieces_of[k]
        last = self._snapshots.get(k)  # confirmed or undone by now: its buffers are free
        snap = Snapshot(k, _copy_into(self.param_shards[k], last.weights if last else None),
                        {id(p): _copy_state(self.optimizer.state.get(p), last.state.get(id(p)) if last else None)
                         for p in mine})
        self._snapshots[k] = snap
        members = {id(p) for p in mine}
        original = self.optimizer.param_groups
        subset = [{**pg, "params": ps} for pg in original if (ps := [p for p in pg["params"] if id(p) in members])]
        self._set_grads(k)
        try:
            self.optimizer.param_groups = subset
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = original
        self.dirty = True
        return snap

    def restore(self, snap: Snapshot) -> None:
        """Undo one :meth:`step_buffer` (weights and optimizer state of that slice)."""
        with torch.no_grad():
            self.param_shards[snap.k].copy_(snap.weights)
        for p in self._pieces_of[snap.k]:
            saved = snap.state[id(p)]
            if saved is None:
                self.optimizer.state.pop(p, None)
                continue
            now = self.optimizer.state.get(p) or {}
            # into the live tensors (the snapshot's own buffers are reused by the next one)
            self.optimizer.state[p] = {key: _copy_into(v, now.get(key)) for key, v in saved.items()}

    def consolidate(self, optimizer: torch.optim.Optimizer,
                    gather: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """Write the full state into ``optimizer.state``; ``gather(k, local)`` returns buffer
        ``k``'s full flat tensor from every rank's ``local`` slice (an all-gather)."""
        state = self.optimizer.state
        for k, buf in enumerate(self.buffers):
            items = [pc for pc in self.pieces if pc.k == k]
            keys = sorted({key for pc in items for key, v in state.get(pc.piece, {}).items()
                           if torch.is_tensor(v) and v.shape == pc.piece.shape})
            full_by_key = {}
            for key in keys:
                local = torch.zeros_like(buf.grad)
                for pc in items:
                    v = state.get(pc.piece, {}).get(key)
                    if v is not None and pc.b > pc.a:
                        start = buf.offsets[pc.i] + pc.a - buf.lo
                        local[start : start + (pc.b - pc.a)] = v
                full_by_key[key] = gather(k, local)
            for pc in items:
                st: dict[str, Any] = {}
                for key, v in state.get(pc.piece, {}).items():
                    if key in full_by_key:
                        o = buf.offsets[pc.i]
                        st[key] = full_by_key[key][o : o + pc.param.numel()].view_as(pc.param).clone()
                    else:
                        st[key] = v.clone() if torch.is_tensor(v) else v
                if st:
                    optimizer.state[pc.param] = st
        self.dirty = False

"""lee18's per-layer update (``lee18:update=layer``): each fused group's shard is stepped as
soon as that group's reduce-scatter completes, during backward.

Why: in Lee et al. 2018 a rank updates its own 1/P slice of a layer right after the layer's
reduce-scatter, so the update of group ``g`` overlaps the backward of the groups after it
instead of sitting, whole, between backward and the next forward (``update=step``).

How: the engine calls :meth:`LayerUpdate.launched` after each reduce-scatter it starts
(strictly in reverse forward order). Each launch then looks at the groups launched before,
in launch order: every one whose exchange has completed (the work handle's
``is_completed()``, which neither blocks nor syncs) is settled
(:meth:`~lowcomm.sched.engine.Engine._settle`: divide by P, a codec decodes this rank's
slice), its finiteness noted, and its slice stepped with
:meth:`~lowcomm.optim.sharded.ShardedOptimizer.step_buffer`, which reads lr, momentum, ...
from the user's optimizer at that moment. ``finish_sync`` then waits for the remaining
groups one at a time, in launch order, and steps each as soon as it has arrived, while the
later ones are still in flight (:meth:`LayerUpdate.finite`); ``optimizer_step`` only starts
the all-gathers, as with ``update=step``. The weights are the same as ``update=step``'s and
DDP's whichever groups arrived early: an elementwise optimizer stepped piece by piece, in any
order, is one ordinary step.

Why backward polls instead of waiting for group ``g`` when ``g+1`` is launched: a wait
stalls backward (the host thread on gloo, the compute stream on NCCL) until ``g``'s
reduce-scatter is done. When one early exchange is long (VGG's fully-connected weights come
first in backward) the backward of every layer behind it would start only after it, and
their exchanges with it, so the step could end later than with ``update=step``. Updating
only what has arrived never delays backward by more than the update work it moves into it,
and the updates after backward overlap the exchanges still in flight, so the step is never
slower than ``update=step`` by more than the snapshot copies below; comm-bound, every update
but the last is hidden (:class:`lowcomm.sim.schedules.lee18.Lee18` models this).

When it runs, and when it falls back to the end-of-step update instead (a warning, once per
reason; exactness first):

* from the second step on: the user's optimizer is first seen at ``optimizer_step`` (a
  resumed run likewise starts with one end-of-step update);
* a ``GradScaler`` attached and enabled: it decides to skip from the inf check of the whole
  gradient, which must precede every update; steps under it run the end-of-step update;
* gradient clipping (:meth:`LayerUpdate.before_clip`): the global norm must be known before
  any group is updated, so the first ``clip_grad_norm_`` switches to the end-of-step update
  for good. It must come in a step whose update has not run yet (the trainer clips from the
  first step): a first call after a per-layer update is refused in one line;
* a non-finite gradient without a scaler: the step is agreed non-finite only in
  ``finish_sync``, after some groups were updated, so every per-layer update keeps a snapshot
  (its slice's weights and optimizer state: 1/P of the group) and ``skip_step`` restores them,
  leaving weights and state unchanged as DDP's skipped step does;
* after ``finish_sync`` exactly one of ``optimizer_step`` or ``skip_step`` must follow (the
  trainer's loop does): otherwise the next backward refuses, since the update already ran.

Hyperparameters are read when each group is updated, i.e. during backward: an LR scheduler
stepped after ``optimizer_step`` (the usual place) and any change made to
``optimizer.param_groups`` between steps are honoured; a change made between ``backward`` and
``optimizer_step`` takes effect one step later than under DDP.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING

import torch

from lowcomm.compress.feedback import finite_flag
from lowcomm.errors import UsageError
from lowcomm.optim.sharded import ShardedOptimizer, Snapshot
from lowcomm.runtime import timing
from lowcomm.sched.groups import Group
from lowcomm.sched.payload import InFlight

if TYPE_CHECKING:
    from lowcomm.sched.engine import Engine


def _completed(g: Group) -> bool:
    """Whether group ``g``'s backward exchange has arrived (no blocking, no host sync)."""
    f = g.msg
    if isinstance(f, InFlight):
        work = f.work if f.work is not None else f.pending.work if f.pending is not None else None
    else:
        work = g.work
    return work is None or bool(work.is_completed())


class LayerUpdate:
    """Per-group shard updates during backward for one ``shard``-mode engine (see module doc)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        #: ``update=layer`` asked for (set by the lee18 method); False: end-of-step update
        self.requested = False
        #: the user's optimizer, bound at every ``optimizer_step``
        self.optimizer: torch.optim.Optimizer | None = None
        #: gradient clipping was asked for: end-of-step update from then on
        self.clipping = False
        #: the reasons the end-of-step update ran instead (for the run summary)
        self.fallbacks: list[str] = []
        self._on: bool | None = None  # this step's decision (None: no launch yet this step)
        self._inflight: list[Group] = []  # launched, not yet settled, in launch order
        self._flags: dict[int, torch.Tensor] = {}  # finiteness of groups settled early
        self._snaps: list[Snapshot] = []
        self._unconfirmed = False  # updated in backward, neither optimizer_step nor skip_step yet
        self.layer_steps = 0  # steps whose update ran per layer

    @property
    def updated(self) -> list[int]:
        """Indices of the groups updated so far this step, in update order (until the step
        is confirmed or undone)."""
        return [s.k for s in self._snaps]

    @property
    def _sharded(self) -> ShardedOptimizer:
        s = self.engine.deferred.sharded
        assert s is not None
        return s

    def _fall_back(self, reason: str) -> None:
        if reason not in self.fallbacks:
            self.fallbacks.append(reason)
            warnings.warn(
                f"{self.engine.tag}: update=layer runs the end-of-step update instead: {reason}",
                stacklevel=4,
            )

    def _decide(self) -> bool:
        if self._unconfirmed:
            raise UsageError(
                f"{self.engine.tag}: update=layer applied the last step's update in backward, but neither "
                "optimizer_step nor skip_step followed finish_sync; call one of them every step (or use "
                "update=step)"
            )
        if not self.requested or self.optimizer is None or self.engine.deferred.sharded is None:
            return False
        if self.clipping:
            return False
        if self.engine._active_scaler() is not None:
            self._fall_back(
                "a GradScaler skips a step from the inf check of the whole gradient, "
                "which must come before any group is updated"
            )
            return False
        return True

    # --- called by the engine -------------------------------------------------------------
    def launched(self, g: Group) -> None:
        """Group ``g``'s reduce-scatter was started: update every group launched so far
        (``g`` included) whose exchange has arrived, in launch order."""
        if self._on is None:
            self._on = self._decide()
        if not self._on:
            return
        self._inflight.append(g)
        while self._inflight and _completed(self._inflight[0]):
            self._update(self._inflight.pop(0), in_backward=True)

    def _update(self, g: Group, *, in_backward: bool = False) -> None:
        """Settle and step group ``g``; in backward the step is reported as ``optimizer`` work
        (device work on a GPU, which emulated compute waits for: :mod:`lowcomm.runtime.timing`;
        in ``finish_sync`` the trainer times it as exposed communication already)."""
        self._flags[g.index] = finite_flag(self.engine._settle(g))
        assert self.optimizer is not None
        with timing.measure("optimizer") if in_backward else contextlib.nullcontext():
            self._snaps.append(self._sharded.step_buffer(self.optimizer, g.index))

    def finite(self, g: Group) -> torch.Tensor:
        """``finish_sync`` (groups in launch order): group ``g``'s finiteness flag. A group
        backward did not update is settled (waiting for it) and, with ``update=layer``,
        updated at once, so its update overlaps the exchanges of the groups after it."""
        f = self._flags.pop(g.index, None)
        if f is not None:
            return f
        if self._on and self._inflight and self._inflight[0] is g:
            self._update(self._inflight.pop(0))
            return self._flags.pop(g.index)
        return finite_flag(self.engine._settle(g))

    def finish(self) -> None:
        """``finish_sync``, after every group is settled: update the groups backward did not."""
        on, self._on = self._on, None
        self._inflight.clear()
        if not on:
            return
        done = {s.k for s in self._snaps}
        assert self.optimizer is not None
        for g in reversed(self.engine.groups):  # launch order
            if g.index not in done:
                self._snaps.append(self._sharded.step_buffer(self.optimizer, g.index))
        self._unconfirmed = True
        self.layer_steps += 1

    def confirm(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer_step``: bind ``optimizer``; True when this step's update already ran."""
        self.optimizer = optimizer
        ran, self._unconfirmed = self._unconfirmed, False
        self._snaps.clear()
        return ran

    def undo(self) -> None:
        """``skip_step``: restore every slice updated this step (weights and state)."""
        for snap in reversed(self._snaps):
            self._sharded.restore(snap)
        self._snaps.clear()
        self._unconfirmed = False

    def before_clip(self) -> None:
        """Clipping asked for: end-of-step update from now on (refused once an update ran)."""
        if not self.requested:
            return
        if self._unconfirmed:
            raise UsageError(
                f"{self.engine.tag}: update=layer already updated this step's shards in backward, too "
                "early for clipping by the global norm; clip from the first step on (it then switches to "
                "the end-of-step update) or use update=step"
            )
        if not self.clipping:
            self.clipping = True
            self._fall_back(
                "gradient clipping needs the norm of the whole gradient before any group is updated"
            )

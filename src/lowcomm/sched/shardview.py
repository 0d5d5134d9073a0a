"""What ``torch.amp.GradScaler`` needs of an optimizer, over the sharded engine's gradients.

Why: between backward and the step, ``dear`` and ``lee18`` hold the averaged gradient as
per-group shards (or, for a gathered payload under dear, as the full decoded mean), not in
``p.grad``, so the user's GradScaler cannot find it. :class:`ShardView` is an
optimizer-shaped object over exactly those tensors: ``scaler.unscale_(view)`` unscales them
in place and records the inf check, ``scaler.step(view)`` decides (its one host sync) and
calls back into the engine's own step, ``scaler.update`` backs off as usual.

Every rank must take the same decision, but a shard is one rank's: a sum that overflows (or
an inf a codec failed to poison) sits in one rank's shard only. :func:`agree_nonfinite`
all-reduces one flag per step in ``finish_sync`` and the sentinel element below carries it,
so the scaler skips (and ``nonfinite_this_step`` reads True) on every rank or on none.

A DeAR group whose compressed ``SUM`` message is still undecoded contributes its summed
message shard to one sentinel element instead: NaN when any such shard is non-finite. Those
shards are not divided by the scale here (the decode before the forward does that, or the
codec worked in unscaled units already).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowcomm.compress.feedback import StepFlags, finite_flag
from lowcomm.sched.groups import Group
from lowcomm.sched.payload import InFlight


def synced_gradient(g: Group) -> torch.Tensor | None:
    """Where group ``g``'s averaged gradient is between ``finish_sync`` and the step of a
    sharded mode: the full decoded mean (``g.full``), this rank's shard, or None while a
    summed message shard is still undecoded (``g.msg``)."""
    if g.msg is not None:
        return None
    if g.full:
        return g.flat[: g.numel]
    return g.shard


def message_shard(g: Group) -> torch.Tensor:
    """The summed message shard a DeAR group holds until its forward."""
    f = g.msg
    assert isinstance(f, InFlight)
    return f.shard if f.shard is not None else f.msg.buf


class ShardView:
    """Optimizer-shaped view of a sharded engine's gradients for GradScaler (see module doc)."""

    def __init__(self, groups: Callable[[], Sequence[Group]], step: Callable[[torch.optim.Optimizer], None],
                 nonfinite: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        self._groups = groups
        self._step = step
        self._nonfinite = nonfinite  # the step's flag agreed by every rank (None: not yet)
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """One param group: an alias per gradient tensor, plus the sentinel."""
        groups = list(self._groups())
        grads, pending = [], []
        for g in groups:
            t = synced_gradient(g)
            if t is None:
                pending.append(message_shard(g))
            else:
                grads.append(t)
        device = groups[0].flat.device
        ok = (torch.stack([finite_flag(f) for f in pending]).all() if pending
              else torch.ones((), dtype=torch.bool, device=device))
        agreed = self._nonfinite()
        if agreed is not None:
            ok = ok & agreed.to(device).logical_not()
        sentinel = torch.where(ok, 0.0, float("nan")).to(torch.float32).reshape(1)
        params = []
        for grad in [*grads, sentinel]:
            alias = grad.detach()
            alias.grad = grad
            params.append(alias)
        return [{"params": params}]

    def step(self) -> bool:
        """The engine's real update; GradScaler calls it only when its check passed."""
        assert self.optimizer is not None
        self._step(self.optimizer)
        return True


def agree_nonfinite(flags: StepFlags, reduce_max: Callable[[torch.Tensor], None] | None) -> None:
    """Replace this step's ``flags`` by one flag all ranks share: non-finite anywhere.

    ``reduce_max`` takes the MAX of a one-element float tensor over ranks (None: one
    process). One tiny collective per step, on the device, no host sync: the price of every
    rank skipping the same step (otherwise their collectives stop pairing up and hang)."""
    nonfinite = flags.nonfinite()
    if nonfinite is None or reduce_max is None:
        return
    flag = nonfinite.to(torch.float32).reshape(1)
    reduce_max(flag)
    flags.clear()
    flags.note(flag[0] == 0)


def clip_sharded_(groups: Sequence[Group], rank: int, reduce: Callable[[torch.Tensor], None],
                  max_norm: float) -> torch.Tensor:
    """Clip the sharded gradient by its global 2-norm; ``reduce`` sums a tensor over ranks.

    Each rank adds the squares of its own slices (of a full decoded mean: the slice it would
    own), so one all-reduce of one number gives the norm of the whole gradient.
    """
    sq = torch.zeros(1, dtype=torch.float64, device=groups[0].shard.device)
    grads = [synced_gradient(g) for g in groups]
    for g, t in zip(groups, grads):
        assert t is not None
        n = g.shard.numel()
        own = t[rank * n : (rank + 1) * n] if g.full else t
        sq += own.double().pow(2).sum()
    reduce(sq)
    total = sq.sqrt().to(groups[0].shard.dtype)
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for t in grads:
            assert t is not None
            t.mul_(coef)
    return total.squeeze(0)

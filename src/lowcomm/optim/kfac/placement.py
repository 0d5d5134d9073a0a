"""Which rank decomposes which factor.

Why: an ``n x n`` eigendecomposition costs ``~n³``; done by every rank, the largest factors
dominate the step. SPD-KFAC's balanced placement sorts the factors by cost and gives each to
the least-loaded rank, which then broadcasts the result. Small factors (dimension under
``local_inverse_below``) and diagonal ones are decomposed by every rank: sending the result
would cost more than computing it. ``round_robin`` (factor ``i`` to rank ``i mod P``, in
layer order) is the simple baseline. The plan depends only on the factor sizes, so every
rank computes the same plan with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: placement strategies :func:`assign` accepts
STRATEGIES = ("balanced", "round_robin")


@dataclass(frozen=True)
class FactorKey:
    """One factor: the layer's index in the preconditioner, ``"A"`` or ``"G"``, its size."""

    layer: int
    kind: str
    dim: int
    diagonal: bool = False

    def cost(self) -> int:
        """Decomposition cost in the model ``n³`` (a diagonal one is ``n``)."""
        return self.dim if self.diagonal else self.dim**3


def assign(
    factors: Sequence[FactorKey], world_size: int, strategy: str, local_below: int
) -> dict[FactorKey, int | None]:
    """The owner rank of every factor, or None for one decomposed locally on every rank.

    Every factor appears exactly once. ``balanced``: the remote factors in decreasing cost
    (ties: layer order), each to the rank with the least cost so far (ties: lowest rank).
    With one rank everything is local.
    """
    local = [world_size <= 1 or f.diagonal or f.dim < local_below for f in factors]
    owners = _place([f.cost() for f in factors], local, world_size, strategy)
    return dict(zip(factors, owners))


def assign_layers(
    factors: Sequence[FactorKey], world_size: int, strategy: str, local_below: int
) -> dict[FactorKey, int | None]:
    """Like :func:`assign`, but both factors of a layer get one owner (DP-KFAC: the owner
    preconditions the layer's gradient). A layer is local when both its factors would be;
    its cost is the sum of theirs."""
    layers = sorted({f.layer for f in factors})
    costs = {i: 0 for i in layers}
    local = {i: True for i in layers}
    for f in factors:
        costs[f.layer] += f.cost()
        local[f.layer] &= world_size <= 1 or f.diagonal or f.dim < local_below
    owners = dict(zip(layers, _place([costs[i] for i in layers], [local[i] for i in layers],
                                     world_size, strategy)))
    return {f: owners[f.layer] for f in factors}


def _place(costs: Sequence[int], local: Sequence[bool], world_size: int, strategy: str) -> list[int | None]:
    """Owner per item (None: local), by ``strategy`` over the non-local items."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement {strategy!r}; valid: {', '.join(STRATEGIES)}")
    owners: list[int | None] = [None] * len(costs)
    remote = [i for i in range(len(costs)) if not local[i]]
    if strategy == "round_robin":
        for j, i in enumerate(remote):
            owners[i] = j % world_size
        return owners
    load = [0] * world_size
    for i in sorted(remote, key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def loads(plan: dict[FactorKey, int | None], world_size: int) -> list[int]:
    """The ``n³`` cost each rank decomposes under ``plan`` (local factors excluded)."""
    out = [0] * world_size
    for f, rank in plan.items():
        if rank is not None:
            out[rank] += f.cost()
    return out

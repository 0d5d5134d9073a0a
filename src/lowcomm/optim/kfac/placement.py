"""Which rank decomposes which factor.

Why: an ``n x n`` eigendecomposition costs ``~n³``; done by every rank, the largest factors
dominate the step. SPD-KFAC's balanced placement sorts the factors by cost and gives each to
the least-loaded rank, which then broadcasts the result. Small factors (dimension under
``local_inverse_below``) and diagonal ones are decomposed by every rank: sending the result
would cost more than computing it. ``round_robin`` (factor ``i`` to rank ``i mod P``, in
layer order) is the simple baseline. The plan depends only on the factor sizes, so every
rank computes the same plan with no communication.

KAISA's ``grad_worker_fraction`` adds a second level (:class:`Grid`, :func:`assign_grid`):
each layer is first given to a group of ``g`` gradient workers, then its factors to members of
that group. Fraction 1 (one group of all ranks) and ``1/world_size`` (one rank per group) are
the two ends; :func:`assign` and :func:`assign_layers` are those ends.
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


@dataclass(frozen=True)
class Grid:
    """KAISA's layout of ``world_size`` ranks for ``grad_workers`` gradient workers per layer.

    The ranks fill a ``grad_workers x columns`` grid row by row (``columns = world_size /
    grad_workers``; rank ``r`` sits in row ``r // columns``, column ``r % columns``):

    * a **column** is a gradient-worker group: a layer placed on it has its factors decomposed
      by the column's members and broadcast within the column, and every member computes the
      layer's preconditioned gradient;
    * a **row** is a receiver group: it holds exactly one member of every column, so each rank
      receives a layer's preconditioned gradient from the member of the layer's column in its
      own row, by a broadcast within the row.

    Why this shape: decompositions travel only within a column (``g`` ranks) and gradients only
    within a row (``world_size / g`` ranks), and each rank stores the decompositions of its
    column's layers only. ``grad_workers == world_size`` is one column (every rank receives
    every decomposition, no gradient traffic); ``grad_workers == 1`` is one row (DP-KFAC: the
    owner broadcasts the gradient to all, no decomposition traffic).
    """

    world_size: int
    grad_workers: int

    def __post_init__(self) -> None:
        if not (1 <= self.grad_workers <= self.world_size and self.world_size % self.grad_workers == 0):
            raise ValueError(f"{self.grad_workers} gradient workers do not divide {self.world_size} ranks")

    @property
    def columns(self) -> int:
        """Number of gradient-worker groups (the size of a receiver group)."""
        return self.world_size // self.grad_workers

    def column(self, rank: int) -> int:
        """The gradient-worker group ``rank`` belongs to."""
        return rank % self.columns

    def row(self, rank: int) -> int:
        """The receiver group ``rank`` belongs to."""
        return rank // self.columns

    def workers(self, column: int) -> list[int]:
        """The ranks of gradient-worker group ``column``, ascending."""
        return [column + j * self.columns for j in range(self.grad_workers)]

    def receivers(self, row: int) -> list[int]:
        """The ranks of receiver group ``row``, ascending."""
        return list(range(row * self.columns, (row + 1) * self.columns))

    def source(self, column: int, rank: int) -> int:
        """The member of ``column`` that sends ``rank`` the gradients of the column's layers
        (``rank`` itself when it is in that column)."""
        return self.row(rank) * self.columns + column


def assign_grid(
    factors: Sequence[FactorKey], grid: Grid, strategy: str, local_below: int
) -> tuple[dict[FactorKey, int | None], dict[int, int | None]]:
    """``(owners, columns)``: the owner rank of every factor, and the column of every layer.

    A factor is *local* when it is diagonal or its dimension is under ``local_below`` (or there
    is one rank): no one broadcasts it. A layer whose factors are all local has column None:
    every rank decomposes and preconditions it itself. The other layers go to columns by
    ``strategy`` over their cost (the sum of their factors' ``n³``; balanced: least-loaded
    column, the load of a column being the sum of its members' loads); then within each
    column, its layers' non-local factors go to the column's members by ``strategy`` over their
    own cost, in factor order. A local factor of a non-local layer has owner None when the
    column has several members (each decomposes it itself) and the column's one rank otherwise.

    The two ends reproduce :func:`assign` (one column) and :func:`assign_layers` (columns of
    one rank) exactly: the same owners, the same tie-breaking.
    """
    local = [grid.world_size <= 1 or f.diagonal or f.dim < local_below for f in factors]
    layers = sorted({f.layer for f in factors})
    cost = {i: 0 for i in layers}
    layer_local = {i: True for i in layers}
    for f, lo in zip(factors, local):
        cost[f.layer] += f.cost()
        layer_local[f.layer] &= lo
    columns = dict(zip(layers, _place([cost[i] for i in layers], [layer_local[i] for i in layers],
                                      grid.columns, strategy)))
    owners: dict[FactorKey, int | None] = {f: None for f in factors}
    for column in range(grid.columns):
        members = grid.workers(column)
        mine = [j for j, f in enumerate(factors) if columns[f.layer] == column]
        slots = _place([factors[j].cost() for j in mine], [local[j] for j in mine], grid.grad_workers, strategy)
        for j, slot in zip(mine, slots):
            if slot is not None:
                owners[factors[j]] = members[slot]
            elif grid.grad_workers == 1:
                owners[factors[j]] = members[0]
    return owners, columns


def assign(
    factors: Sequence[FactorKey], world_size: int, strategy: str, local_below: int
) -> dict[FactorKey, int | None]:
    """The owner rank of every factor, or None for one decomposed locally on every rank.

    Every factor appears exactly once. ``balanced``: the remote factors in decreasing cost
    (ties: layer order), each to the rank with the least cost so far (ties: lowest rank).
    With one rank everything is local. (:func:`assign_grid` with one column of all ranks.)
    """
    return assign_grid(factors, Grid(max(world_size, 1), max(world_size, 1)), strategy, local_below)[0]


def assign_layers(
    factors: Sequence[FactorKey], world_size: int, strategy: str, local_below: int
) -> dict[FactorKey, int | None]:
    """Like :func:`assign`, but both factors of a layer get one owner (DP-KFAC: the owner
    preconditions the layer's gradient). A layer is local when both its factors would be;
    its cost is the sum of theirs. (:func:`assign_grid` with columns of one rank.)"""
    return assign_grid(factors, Grid(max(world_size, 1), 1), strategy, local_below)[0]


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

"""Layers ("units") and fusion groups: the granularity at which the engine communicates.

A *unit* is one module together with the trainable parameters it owns directly (a Linear's
weight and bias). Units are listed in module registration order, which for ordinary models
is the forward order; a parameter shared by several modules (tied weights) belongs to the
first module that owns it. A *group* is a run of consecutive units fused into one flat,
padded buffer so that one collective carries all of them. A grouping is described by a
list of unit counts per group in forward order (``[2, 1, 3]``), which is what planners
produce and what rank 0 broadcasts so every rank uses the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lowcomm.errors import UsageError


@dataclass
class Unit:
    """One layer: a module and the trainable parameters it owns directly."""

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter]
    param_names: list[str]

    @property
    def numel(self) -> int:
        """Elements of the unit's parameters."""
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        """Bytes of the unit's parameters (the gradient bytes it sends uncompressed)."""
        return sum(p.numel() * p.element_size() for p in self.params)


def collect_units(model: nn.Module) -> list[Unit]:
    """Units of ``model`` in registration (≈ forward) order; frozen parameters and model-parallel
    partitions (:mod:`lowcomm.parallel.fc`: each rank owns different rows, never averaged) are skipped."""
    seen: set[int] = set()
    units: list[Unit] = []
    for mod_name, module in model.named_modules():
        params, names = [], []
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen or getattr(p, "lowcomm_model_parallel", False):
                continue
            seen.add(id(p))
            params.append(p)
            names.append(f"{mod_name}.{p_name}" if mod_name else p_name)
        if params:
            units.append(Unit(len(units), mod_name or "<root>", module, params, names))
    if not units:
        raise UsageError("the model has no trainable parameters to synchronize")
    dtypes = {p.dtype for u in units for p in u.params}
    if len(dtypes) > 1:
        raise UsageError(
            f"the scheduling engine needs one parameter dtype, found {sorted(map(str, dtypes))}; "
            "cast the model first (e.g. model.float())"
        )
    return units


def check_sizes(sizes: list[int], n_units: int) -> None:
    """Refuse a grouping that does not cover every unit exactly once."""
    if any(s <= 0 for s in sizes) or sum(sizes) != n_units:
        raise ValueError(f"group sizes {sizes} do not partition {n_units} units")


def fuse_sizes(nbytes: Sequence[int], numels: Sequence[int], threshold_bytes: float,
               min_numel: int = 0, first_bytes: float = 0.0) -> list[int]:
    """Greedy fusion in forward order of layers given by their bytes and elements: close a
    group once it holds ``threshold_bytes`` and at least ``min_numel`` elements; the group
    sizes (layer counts). The engine (:func:`fuse_by_threshold`) and the simulator
    (:func:`lowcomm.sim.schedules.engine.forward_groups`) both group with it.

    ``first_bytes`` > 0 closes the first group at the smaller of it and ``threshold_bytes``, as
    DDP's first bucket (1 MiB) is small so that communication starts early. For the sharded
    schedules (``dear``, ``lee18``) the forward-order first group is the one whose
    reduce-scatter is issued last in backward and whose all-gather the next forward waits for
    first, so its size is exposed twice per step (docs/scheduling.md, "The first group").

    ``threshold_bytes <= 0`` and ``min_numel <= 0`` give one group per layer (plain WFBP);
    ``min_numel`` alone keeps one group per layer but lets layers smaller than it (BatchNorm's
    affine pair, a lone bias) ride with their neighbours, as MG-WFBP always merges tensors under
    :data:`lowcomm.sched.cost.SMALL_TENSOR_ELEMS`: each of them would pay a collective's whole
    start-up cost for a few kilobytes.
    """
    sizes: list[int] = []
    count, acc, elems = 0, 0, 0
    for b, n in zip(nbytes, numels, strict=True):
        count += 1
        acc += b
        elems += n
        limit = min(first_bytes, threshold_bytes) if first_bytes > 0 and not sizes else threshold_bytes
        if acc >= limit and elems >= min_numel:
            sizes.append(count)
            count, acc, elems = 0, 0, 0
    if count:
        sizes.append(count)
    return sizes


def fuse_by_threshold(units: list[Unit], threshold_bytes: float, min_numel: int = 0,
                      first_bytes: float = 0.0) -> list[int]:
    """:func:`fuse_sizes` over ``units``, in forward order."""
    return fuse_sizes([u.nbytes for u in units], [u.numel for u in units], threshold_bytes, min_numel, first_bytes)


@dataclass
class Group:
    """A fused run of units with one flat buffer padded to a multiple of the world size."""

    index: int
    units: list[Unit]
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    padded: int
    flat: torch.Tensor
    shard: torch.Tensor
    # per-step state
    ready: set[int] = field(default_factory=set)
    work: object | None = None
    launched: bool = False
    pending: bool = False  # a deferred all-gather / update still has to happen
    ag_work: object | None = None
    msg: object | None = None  # compressed payload in flight (lowcomm.sched.payload.InFlight)
    full: bool = False  # dear: g.flat holds the full decoded mean (no all-gather needed)

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's shard."""
        return self.shard.numel()

    def slice_of(self, i: int) -> torch.Tensor:
        """Group-buffer view of parameter ``i``'s gradient."""
        p = self.params[i]
        return self.flat[self.offsets[i] : self.offsets[i] + p.numel()]


def build_groups(units: list[Unit], sizes: list[int], world_size: int) -> list[Group]:
    """Allocate flat buffers for a grouping (``sizes`` = unit counts per group, forward order)."""
    check_sizes(sizes, len(units))
    groups: list[Group] = []
    start = 0
    for gi, size in enumerate(sizes):
        members = units[start : start + size]
        start += size
        params = [p for u in members for p in u.params]
        names = [n for u in members for n in u.param_names]
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        padded = -(-off // world_size) * world_size
        ref = params[0]
        flat = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        shard = torch.zeros(padded // world_size, dtype=ref.dtype, device=ref.device)
        groups.append(Group(gi, members, params, names, offsets, off, padded, flat, shard))
    return groups


def name_list(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``: parameter names for a message."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_unused(groups: list[Group], missing: list[tuple[Group, int]],
                 reduce: Callable[[torch.Tensor], None]) -> None:
    """First backward: refuse parameters that received no gradient, on every rank at once
    (``reduce`` sums a tensor over the ranks).

    The count lives on the gradients' device (a process group on NCCL alone has no CPU
    backend). Reading it back is one host sync, on the first backward only: whether to
    raise has to be decided on the host, identically on every rank.
    """
    device = groups[0].flat.device if groups else torch.device("cpu")
    count = torch.tensor([float(len(missing))], device=device)
    reduce(count)
    total = int(count.item())
    if total > 0:
        local = name_list([g.names[i] for g, i in missing]) if missing else "none on this rank"
        raise UsageError(
            f"{total} trainable parameters (summed over ranks) got no gradient in "
            f"the first backward ({local}); the scheduling engine needs every trainable "
            "parameter used in each step: freeze unused ones with requires_grad_(False)"
        )

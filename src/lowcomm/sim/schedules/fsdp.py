"""PyTorch FSDP2 in the simulator: ``torch_fsdp`` (``fully_shard(reshard_after_forward=False)``).

What the method does (:class:`lowcomm.methods.reference.TorchFSDP`): every block is a sharding
unit; before a unit's forward its parameters are all-gathered (each worker holds 1/P of each
parameter, dim 0 padded to a multiple of P), they stay gathered through backward, and after
the unit's backward its gradients are reduce-scattered; the optimizer steps on the shards.

Why the schedule depends on the device: FSDP2 issues both collectives with ``async_op=False``
and orders them with CUDA streams. On a GPU the training thread runs ahead of the device, so
the next units' all-gathers are issued while the current unit computes (implicit prefetching)
and the reduce-scatters run beside backward: the collectives overlap compute as DDP's do. On a
CPU there are no streams: each collective blocks the training thread until it is done, so
forward waits for every all-gather and backward for every reduce-scatter. And gloo's
reduce-scatter runs a whole all-reduce underneath (the method counts it so), so on a CPU
profile the reduce-scatter is priced and counted as an all-reduce of the padded gradient.
On a GPU the all-gathers run at most two units ahead (FSDP2's all-gather streams wait for the
copy-out of the unit before the previous one); the GPU side is not validated here (no GPU was
lent).

Units come from the profile's layer names, as :func:`lowcomm.methods.reference.shard_units`
picks them from the model: a layer ``a.b.c`` belongs to unit ``a.b`` when ``b`` is an index
(the child of a top-level ``Sequential``/``ModuleList``) and to unit ``a`` otherwise.
FSDP's copies into and out of its flat buffers (each parameter read and written once per
collective) are priced as elementwise passes with the profile's constants.
"""

from __future__ import annotations

import math

from lowcomm.sim.profile import Profile
from lowcomm.sim.schedules.base import Schedule, Sim
from lowcomm.sim.timeline import Task


def unit_of(layer_name: str) -> str:
    """The FSDP unit of a profiled layer (see the module docstring)."""
    parts = layer_name.split(".")
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def shard_units_of(profile: Profile) -> list[list[int]]:
    """Layer indices of each unit, in forward order; units with no parameters are left out
    (FSDP makes no parameter group for them)."""
    units: list[list[int]] = []
    key = None
    for i, layer in enumerate(profile.layers):
        k = unit_of(layer.name)
        if k != key:
            units.append([])
            key = k
        units[-1].append(i)
    return [u for u in units if any(profile.layers[i].numel > 0 for i in u)]


def padded_shard_numel(shapes: list[list[int]], workers: int) -> int:
    """Elements of one worker's shard: each parameter's dim 0 padded to a multiple of P."""
    total = 0
    for shape in shapes:
        if not shape:
            total += 1  # a scalar is sharded as a 1-element tensor
            continue
        total += math.ceil(shape[0] / workers) * math.prod(shape[1:])
    return total


class TorchFSDP(Schedule):
    """FSDP2 with one unit per block: all-gather before each unit's forward, reduce-scatter
    after its backward, blocking on a CPU, overlapped on a GPU."""

    name = "torch_fsdp"
    summary = "PyTorch FSDP2 fully_shard: per-block all-gather and reduce-scatter (reference)"
    caveat = "PyTorch's reference engine; same updates as ssgd."
    exact = True
    advised = False

    def setup(self, sim: Sim) -> None:
        """Units, each one's shard size, and whether collectives block (a CPU profile)."""
        self.units = shard_units_of(sim.profile)
        self.first_of = {u[0]: k for k, u in enumerate(self.units)}
        self.shard = [padded_shard_numel([s for i in u for s in sim.profile.layers[i].param_shapes], sim.p)
                      for u in self.units]
        self.blocking = sim.profile.device.startswith("cpu")
        #: the last optimizer step: the shards an all-gather sends are the updated ones
        self.stepped: Task | None = None
        #: this iteration's copies out of each unit's all-gather (a GPU's prefetch limit)
        self.copied_out: dict[int, Task] = {}

    def optimizer_s(self, profile: Profile, workers: int) -> float:
        """The step on one shard: 1/P of the model's."""
        return super().optimizer_s(profile, workers) / workers

    def _copy(self, sim: Sim, name: str, elements: int, it: int, kind: str, after: list[Task | None], *,
              side: bool = False) -> Task:
        """FSDP's copy into or out of a flat buffer, on the compute stream (FSDP runs them on the
        current stream), or, with ``side`` on a GPU, on the all-gather's copy-in stream."""
        seconds = elements * sim.c.elementwise_s_per_elem
        if side and not self.blocking:
            return sim.tl.add(name, "comm", seconds, kind="comm", iteration=it, after=after)
        return sim.compute(name, seconds, it, kind=kind, after=after)

    def _block(self, sim: Sim, it: int, task: Task) -> None:
        """On a CPU, the training thread waits for the collective (``async_op=False``)."""
        if self.blocking:
            sim.tl.add(f"wait.{task.name}", "compute", 0.0, kind="sync", iteration=it, after=[task])

    def all_gather(self, sim: Sim, it: int, k: int) -> Task:
        """Unit ``k``'s all-gather with its copies in and out. On a GPU it runs ahead of the
        compute (implicit prefetching), at most two units ahead: FSDP2 makes the all-gather
        streams wait for the copy-out of the unit before the previous one."""
        shard = self.shard[k]
        after = [self.stepped, self.copied_out.get(k - 2)] if not self.blocking else [self.stepped]
        copy_in = self._copy(sim, f"agin.u{k}", shard, it, "forward", after, side=True)
        ag = sim.collective(f"ag.u{k}", "all_gather", shard * sim.bpe, it, after=[copy_in])
        self._block(sim, it, ag)
        self.copied_out[k] = self._copy(sim, f"agout.u{k}", shard * sim.p, it, "forward", [ag])
        return self.copied_out[k]

    def reduce_scatter(self, sim: Sim, it: int, k: int, ready: Task) -> Task:
        """Unit ``k``'s gradient reduce-scatter after its backward (an all-reduce on gloo)."""
        full = self.shard[k] * sim.p
        copy_in = self._copy(sim, f"rsin.u{k}", full, it, "backward", [ready])
        kind = "all_reduce" if self.blocking else "reduce_scatter"
        rs = sim.collective(f"rs.u{k}", kind, full * sim.bpe, it, after=[copy_in])
        self._block(sim, it, rs)
        return rs

    def iteration(self, sim: Sim, it: int) -> None:
        """Forward with each unit's all-gather first, backward with its reduce-scatter, step."""
        self.copied_out = {}
        for i in range(len(sim.profile.layers)):
            after: list[Task | None] = []
            if i in self.first_of:
                after.append(self.all_gather(sim, it, self.first_of[i]))
            sim.forward_layer(i, it, after=after)
        pending: list[Task | None] = []
        for i in reversed(range(len(sim.profile.layers))):
            done = sim.backward_layer(i, it)
            if i in self.first_of:  # backward finishes a unit at its first layer
                pending.append(self.reduce_scatter(sim, it, self.first_of[i], done))
        self.stepped = sim.tl.add("opt", "compute", sim.optimizer_s, kind="optimizer", iteration=it, after=pending)

"""K-FAC's collectives, all through :mod:`lowcomm.comm.accounting` so the ledger counts them.

* factor statistics are all-reduced and averaged, tagged ``kfac.A`` / ``kfac.G``: an async
  all-reduce started from the hooks (pipelined; per factor, or per merged group once
  :mod:`~lowcomm.optim.kfac.pipeline` has a plan), or in ``step()`` fused into 25 MB buckets
  per kind, launched back to back (the non-pipelined baseline); the upper triangle only with ``symmetric_comm``
  (a diagonal factor is a vector either way);
* DP-KFAC's preconditioned gradients are broadcast by the preconditioner (tag ``kfac.grad``);
* each remote decomposition is broadcast from its owner, tagged ``kfac.eigen`` or
  ``kfac.inverse``, to all ranks or (hybrid ``grad_worker_fraction``) within the layer's
  gradient-worker group; all broadcasts are launched before any is waited on.

The hybrid's groups (:meth:`FactorComm.grid_groups`) are created by every rank, in one order,
in the constructor; a group of all ranks is K-FAC's own group and a group of one rank is
never created (nothing travels in it), so the two ends of ``grad_worker_fraction`` create no
group beyond today's.

Every tensor handed to a collective lives on the factor's device (the parameters' device).
K-FAC's traffic runs on its own process group, so it never interleaves with DDP's buckets
on the default group (collectives on one group must be issued in one order by every rank).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.optim.kfac.factors import pack, packed_numel, unpack
from lowcomm.optim.kfac.fusion import Flight
from lowcomm.optim.kfac.inverse import Decomposition, from_wire, to_wire, wire_numel
from lowcomm.optim.kfac.placement import FactorKey, Grid


#: the non-pipelined baseline's bucket size in bytes (DDP's default ``bucket_cap_mb=25``)
BUCKET_BYTES = 25 * 2**20


class FactorComm:
    """The collectives of one preconditioner on one process group."""

    def __init__(self, group: Any, world_size: int, rank: int, symmetric: bool) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.symmetric = symmetric

    @classmethod
    def create(cls, symmetric: bool) -> FactorComm:
        """One on a new group of all ranks (collective: every rank must call it), or a
        world-size-1 one when torch.distributed is not initialized."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None, 1, 0, symmetric)
        group = dist.new_group(list(range(dist.get_world_size())))
        return cls(group, dist.get_world_size(), dist.get_rank(), symmetric)

    def subgroup(self, ranks: Sequence[int]) -> Any:
        """A process group of ``ranks`` (collective: every rank calls it for every group, in
        one order). All ranks: K-FAC's own group; one rank: None (never used: nothing to send).
        Created like K-FAC's own group (the default backend), so on CUDA it carries CUDA
        tensors."""
        if len(ranks) == self.world_size:
            return self.group
        if len(ranks) == 1:
            return None
        return dist.new_group(list(ranks))

    def grid_groups(self, grid: Grid) -> tuple[list[Any], list[Any]]:
        """The gradient-worker group of every column and the receiver group of every row of
        ``grid`` (collective: columns first, then rows, in index order on every rank)."""
        columns = [self.subgroup(grid.workers(c)) for c in range(grid.columns)]
        rows = [self.subgroup(grid.receivers(r)) for r in range(grid.grad_workers)]
        return columns, rows

    def start(self, flat: torch.Tensor, kind: str) -> Any:
        """Start the async all-reduce of a packed buffer; its work handle (None alone)."""
        if self.world_size == 1:
            return None
        return accounting.all_reduce(flat, group=self.group, async_op=True, tag=f"kfac.{kind}")

    def finish(self, flight: Flight, n: int, diagonal: bool) -> torch.Tensor:
        """Wait for a launched all-reduce; the averaged factor statistic, unpacked."""
        return self.mean_in_place(unpack(flight.wait(), n, self.symmetric, diagonal=diagonal))

    def mean_in_place(self, total: torch.Tensor) -> torch.Tensor:
        """The sum over ranks divided by their number, in place (the buffer is ours)."""
        return total.div_(self.world_size) if self.world_size > 1 else total

    def launch_all(self, stats: Sequence[tuple[torch.Tensor, int, bool]], kind: str) -> Buckets:
        """Start averaging ``(stat, n, diagonal)`` statistics in 25 MB buckets (baseline
        mode); :meth:`Buckets.finish` waits and returns them in order."""
        flats = [pack(s, self.symmetric, copy=False) for s, _, _ in stats]  # this step's, handed over
        launched = self._launch_buckets(flats, kind) if self.world_size > 1 and flats else []
        return Buckets(self, flats, [(n, d) for _, n, d in stats], launched)

    def _launch_buckets(self, flats: list[torch.Tensor], kind: str) -> list[tuple[list[int], torch.Tensor, Any]]:
        """All-reduce ``flats`` fused into buckets of about :data:`BUCKET_BYTES` (a larger
        factor alone), in order, each launched as soon as it is packed.

        Why buckets rather than one buffer: the next bucket is packed while the previous one
        is on the wire, and ResNet-18's 340 MB of factors in one gloo all-reduce took 2-3 s
        longer per factor step than in buckets on 4 workers at 1 Gbit/s (kfac.md).
        """
        buckets: list[list[int]] = []
        size = 0
        for i, flat in enumerate(flats):
            nbytes = flat.numel() * flat.element_size()
            if not buckets or (size > 0 and size + nbytes > BUCKET_BYTES):
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        launched = []
        for members in buckets:
            buf = torch.cat([flats[i] for i in members]) if len(members) > 1 else flats[members[0]]
            launched.append((members, buf, accounting.all_reduce(buf, group=self.group, async_op=True,
                                                                 tag=f"kfac.{kind}")))
        return launched

    def share(self, mine: Mapping[FactorKey, Decomposition], remote: Sequence[FactorKey],
              sources: Mapping[FactorKey, int | None], compute: str,
              devices: Mapping[FactorKey, torch.device], group: Any = None,
              whole: Collection[FactorKey] = ()) -> dict[FactorKey, Decomposition]:
        """Broadcast each of ``remote``'s decompositions from its source; return them all.

        ``mine`` holds the decompositions this rank sends; ``remote`` lists the factors in one
        order shared by every rank of ``group`` (None: K-FAC's group of all ranks); ``sources``
        gives each one's sending rank (a global rank), ``devices`` its device. The source uses
        the received form too (the upper triangle mirrored), so all ranks apply bit-identical
        preconditioners. Factors in ``whole`` are sent unpacked: their holder decomposed them
        itself and never applied the packed form, so packing would change their bits.
        """
        tag = f"kfac.{compute}"
        group = self.group if group is None else group
        pending: list[tuple[FactorKey, torch.Tensor, Any, bool]] = []
        for key in remote:
            source = sources[key]
            assert source is not None
            sym = self.symmetric and key not in whole
            if source == self.rank:
                buf = to_wire(mine[key], compute, sym).contiguous()
            else:
                buf = torch.empty(wire_numel(key.dim, compute, sym, key.diagonal), dtype=torch.float32,
                                  device=devices[key])
            work = accounting.broadcast(buf, source, group=group, async_op=True, tag=tag)
            pending.append((key, buf, work, sym))
        out: dict[FactorKey, Decomposition] = {}
        for key, buf, work, sym in pending:
            work.wait()
            out[key] = from_wire(buf, key.dim, compute, sym, key.diagonal)
        return out


def factor_bytes(dims: Sequence[tuple[int, bool]], symmetric: bool) -> int:
    """Payload bytes of one all-reduce round of float32 factors ``(n, diagonal)``: what the
    ledger's ``payload_bytes`` grows by per factor update (tests and the docs use it)."""
    return 4 * sum(packed_numel(n, symmetric, diagonal=d) for n, d in dims)


class Buckets:
    """The baseline's bucketed all-reduces of one kind, launched and not yet waited for."""

    def __init__(self, comm: FactorComm, flats: list[torch.Tensor], shapes: list[tuple[int, bool]],
                 launched: list[tuple[list[int], torch.Tensor, Any]]) -> None:
        self.comm, self.flats, self.shapes, self.launched = comm, flats, shapes, launched

    def finish(self) -> list[torch.Tensor]:
        """Wait for every bucket; the averaged statistics, unpacked, in launch order."""
        out = list(self.flats)
        for members, buf, work in self.launched:
            work.wait()
            for i, part in zip(members, buf.split([self.flats[i].numel() for i in members])):
                out[i] = part
        sym = self.comm.symmetric
        return [self.comm.mean_in_place(unpack(f, n, sym, diagonal=d)) for f, (n, d) in zip(out, self.shapes)]

"""Where each worker sits: nodes of ``local_size`` workers, and the process groups per level.

Why: a cluster of multi-GPU nodes has two links with very different costs, the fast one
inside a node (NVLink, PCIe, loopback) and the node's network card. Hierarchical algorithms
(:mod:`lowcomm.comm.hierarchical`, the ``hitopk`` codec) send most bytes on the first and
only a fraction on the second; the accounting layer splits counted bytes by link with the
same picture (:mod:`lowcomm.comm.accounting`).

The layout is torchrun's: ranks are numbered node by node, so worker ``r`` is on node
``r // local_size`` with local rank ``r % local_size``. Two kinds of groups follow:

* **intra** groups: the ``local_size`` workers of one node (``{0,1}``, ``{2,3}`` for 2 x 2);
* **inter** groups: the workers with the same local rank on every node (``{0,2}``, ``{1,3}``),
  which carry the cross-node traffic: each node's NIC is used by all of them at once, each
  carrying ``1/local_size`` of the data.

:func:`node_groups` creates them with ``dist.new_group``, which every rank must call for every
group in the same order (it is collective), and caches them, so a method and a codec asking
for them share one set.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lowcomm.errors import UsageError

#: link classes of the accounting layer
LINKS = ("intra", "inter")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Topology:
    """``world`` workers in nodes of ``local_size`` each; this process is ``rank``."""

    world: int
    local_size: int
    rank: int

    def __post_init__(self) -> None:
        for name in ("world", "local_size", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise UsageError(f"topology: {name} must be an integer, got {value!r}")
        if self.world < 1:
            raise UsageError(f"topology: world size must be >= 1, got {self.world}")
        if self.local_size < 1 or self.world % self.local_size != 0:
            raise UsageError(
                f"topology: {self.local_size} workers per node do not divide {self.world} workers; "
                f"valid workers per node: {', '.join(map(str, _divisors(self.world)))}"
            )
        if not 0 <= self.rank < self.world:
            raise UsageError(f"topology: rank must be in [0, {self.world - 1}], got {self.rank}")

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return self.world // self.local_size

    @property
    def node(self) -> int:
        """This worker's node (torchrun's contiguous layout)."""
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This worker's index inside its node (its rank in the intra group)."""
        return self.rank % self.local_size

    @property
    def hierarchical(self) -> bool:
        """Two real levels: several nodes of several workers (otherwise one flat group)."""
        return self.nodes > 1 and self.local_size > 1

    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank``."""
        return rank // self.local_size

    def intra_ranks(self, node: int | None = None) -> list[int]:
        """Global ranks of ``node`` (this worker's node by default), in local-rank order."""
        n = self.node if node is None else node
        return list(range(n * self.local_size, (n + 1) * self.local_size))

    def inter_ranks(self, local_rank: int | None = None) -> list[int]:
        """Global ranks with local rank ``local_rank`` (this worker's by default), node order."""
        lr = self.local_rank if local_rank is None else local_rank
        return [node * self.local_size + lr for node in range(self.nodes)]

    @classmethod
    def from_env(cls, gpus_per_node: int | None = None, *, world: int | None = None,
                 rank: int | None = None) -> Topology:
        """The topology of this process: ``gpus_per_node`` if given, else torchrun's
        ``LOCAL_WORLD_SIZE``, else one node of ``world`` workers. ``world`` and ``rank`` default
        to the initialized process group's (else ``WORLD_SIZE`` / ``RANK``, else 1 / 0)."""
        initialized = dist.is_available() and dist.is_initialized()
        if world is None:
            world = dist.get_world_size() if initialized else _env_int("WORLD_SIZE", 1)
        if rank is None:
            rank = dist.get_rank() if initialized else _env_int("RANK", 0)
        if gpus_per_node is not None:
            local = gpus_per_node
        else:
            local = _env_int("LOCAL_WORLD_SIZE", world)
        return cls(world=world, local_size=local, rank=rank)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"environment variable {name} must be an integer, got {raw!r}") from None


@dataclass(frozen=True)
class NodeGroups:
    """This worker's two process groups: ``intra`` (its node) and ``inter`` (its peers with the
    same local rank on the other nodes). Both None for a topology that is not
    :attr:`~Topology.hierarchical`: everything then runs on the world group (flat fallback)."""

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None

    def of(self, scope: str) -> dist.ProcessGroup | None:
        """The group of a message scope (``world`` -> None, i.e. the default group)."""
        if scope == "world":
            return None
        if scope == "intra":
            return self.intra
        if scope == "inter":
            return self.inter
        raise ValueError(f"unknown scope {scope!r}; valid: world, intra, inter")


_CACHE: dict[tuple[int, int, int], NodeGroups] = {}
_LINK_OF_GROUP: dict[int, str] = {}
_LOCK = threading.Lock()


def _world_key() -> int:
    """Identity of the current default group: a re-initialized world gets new groups."""
    return id(dist.group.WORLD) if dist.is_initialized() else 0


def node_groups(topo: Topology) -> NodeGroups:
    """The intra and inter process groups of ``topo`` (created on first call, then cached).

    Collective on first call: every rank must call it with the same topology (it creates all
    ``nodes`` intra groups, then all ``local_size`` inter groups, in that order, as
    ``dist.new_group`` requires). Without an initialized process group, or for a topology that
    is not hierarchical, returns ``NodeGroups(None, None)``.
    """
    if not topo.hierarchical or not (dist.is_available() and dist.is_initialized()):
        return NodeGroups(None, None)
    if dist.get_world_size() != topo.world:
        raise UsageError(f"topology of {topo.world} workers, but the process group has "
                         f"{dist.get_world_size()}")
    key = (_world_key(), topo.world, topo.local_size)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        intra: Any = None
        inter: Any = None
        for node in range(topo.nodes):
            g = dist.new_group(topo.intra_ranks(node))
            _LINK_OF_GROUP[id(g)] = "intra"
            if node == topo.node:
                intra = g
        for lr in range(topo.local_size):
            g = dist.new_group(topo.inter_ranks(lr))
            _LINK_OF_GROUP[id(g)] = "inter"
            if lr == topo.local_rank:
                inter = g
        groups = NodeGroups(intra, inter)
        _CACHE[key] = groups
        return groups


def link_of_group(group: dist.ProcessGroup | None) -> str | None:
    """``"intra"`` / ``"inter"`` for a group made by :func:`node_groups`, else None."""
    if group is None:
        return None
    return _LINK_OF_GROUP.get(id(group))


def link_of_peer(topo: Topology, peer_global_rank: int) -> str:
    """The link a point-to-point transfer to ``peer_global_rank`` crosses."""
    if not 0 <= peer_global_rank < topo.world:
        raise ValueError(f"peer rank must be in [0, {topo.world - 1}], got {peer_global_rank}")
    return "intra" if topo.node_of(peer_global_rank) == topo.node else "inter"


__all__ = ["LINKS", "NodeGroups", "Topology", "link_of_group", "link_of_peer", "node_groups"]

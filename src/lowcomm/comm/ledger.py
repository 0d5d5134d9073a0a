"""The per-process tally of collective traffic, and how its bytes split over the two links.

Why apart from :mod:`lowcomm.comm.accounting`: the wrappers there decide *what* a collective
sends; this module keeps the counts (by collective kind, by tag, by link class) and owns the
one rule that says which bytes cross nodes, so byte-count tests, summaries and the
benchmark read one ledger.

Link classes (``by_link``: ``"intra"`` and ``"inter"``, each a :class:`Counter`). Every wrapper
takes a keyword ``link``; where it is None the class follows from the group and the topology
(:func:`set_topology`, else torchrun's ``LOCAL_WORLD_SIZE`` read once the process group exists):

* a collective on an intra-node group (:func:`lowcomm.comm.topology.node_groups`) -> intra;
  on an inter-node group -> inter;
* a flat collective over the world when the topology has several nodes -> the ring model:
  ``1/local_size`` of its wire bytes are inter, the rest intra. The ring crosses each node
  boundary once, so a node's NIC carries what one of its workers sends, shared by its
  ``local_size`` workers; per worker that is ``1/local_size`` of the worker's bytes;
* point-to-point -> the link to the peer's node;
* with one node everything is intra.

Payload bytes are split in the same proportion as wire bytes; a call split over both links
counts as a call on each. Summaries carry the inter part per worker and iteration as
``inter_node_bytes_per_worker_per_iter``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lowcomm.comm.topology import LINKS, Topology, link_of_group


@dataclass
class Counter:
    """Calls and bytes of one collective kind or one tag: a summary's traffic breakdown."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0

    def add(self, payload: int, wire: int) -> None:
        """Count one call."""
        self.calls += 1
        self.payload_bytes += payload
        self.wire_bytes += wire


@dataclass
class Ledger:
    """Per-process tally of collective traffic, keyed by collective kind and by tag."""

    by_collective: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    by_tag: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    #: ``"intra"`` / ``"inter"`` (see the module docstring's link classes)
    by_link: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in LINKS})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, collective: str, tag: str, payload: int, wire: int,
               inter: tuple[int, int] = (0, 0)) -> None:
        """Count one call under its collective kind and its tag (thread-safe: DDP's comm hooks
        and the engine's callbacks may record from another thread). ``inter``: the (payload,
        wire) part that crosses nodes; the rest is intra-node."""
        with self._lock:
            self.by_collective[collective].add(payload, wire)
            self.by_tag[tag].add(payload, wire)
            ip, iw = inter
            if ip or iw:
                self.by_link["inter"].add(ip, iw)
            if payload - ip or wire - iw or not (ip or iw):
                self.by_link["intra"].add(payload - ip, wire - iw)

    @property
    def inter_wire_bytes(self) -> int:
        """Bytes this worker sent over inter-node links (the ring model's share, see module doc)."""
        return self.by_link["inter"].wire_bytes

    @property
    def intra_wire_bytes(self) -> int:
        """Bytes this worker sent inside its node."""
        return self.by_link["intra"].wire_bytes

    @property
    def wire_bytes(self) -> int:
        """Bytes this worker sent: a summary's ``bytes_sent_per_worker``."""
        return sum(c.wire_bytes for c in self.by_collective.values())

    @property
    def payload_bytes(self) -> int:
        """Bytes this worker handed to collectives (before the ring's factor)."""
        return sum(c.payload_bytes for c in self.by_collective.values())

    def reset(self) -> None:
        """Forget every count: the trainer measures each phase (warm-up, timed steps) apart."""
        with self._lock:
            self.by_collective.clear()
            self.by_tag.clear()
            for c in self.by_link.values():
                c.calls = c.payload_bytes = c.wire_bytes = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready totals (what run summaries and the distributed tests compare)."""
        def dump(d: dict[str, Counter]) -> dict[str, dict[str, int]]:
            return {k: vars(v).copy() for k, v in sorted(d.items())}

        return {
            "wire_bytes": self.wire_bytes,
            "payload_bytes": self.payload_bytes,
            "by_collective": dump(self.by_collective),
            "by_tag": dump(self.by_tag),
            "by_link": dump(self.by_link),
            "inter_wire_bytes": self.inter_wire_bytes,
        }


_LEDGER = Ledger()


def ledger() -> Ledger:
    """The process-wide ledger."""
    return _LEDGER


_TOPOLOGY: Topology | None = None
_TOPOLOGY_SET = False


def set_topology(topo: Topology | None) -> None:
    """Use ``topo`` to split counted bytes by link (None: derive it from the environment
    again, torchrun's ``LOCAL_WORLD_SIZE``, when the process group exists)."""
    global _TOPOLOGY, _TOPOLOGY_SET
    _TOPOLOGY, _TOPOLOGY_SET = topo, topo is not None


def topology() -> Topology | None:
    """The topology the ledger splits bytes by (None: one node, everything intra)."""
    global _TOPOLOGY, _TOPOLOGY_SET
    initialized = dist.is_available() and dist.is_initialized()
    if _TOPOLOGY_SET:
        if not initialized or _TOPOLOGY is None or _TOPOLOGY.world == dist.get_world_size():
            return _TOPOLOGY
        _TOPOLOGY_SET = False  # set for another world (a forked test rank inherits it): derive it
    if not initialized:
        return None
    t = _TOPOLOGY
    if t is None or t.world != dist.get_world_size() or t.rank != dist.get_rank():
        try:
            t = Topology.from_env()
        except ValueError:  # a LOCAL_WORLD_SIZE that does not divide the world: one node
            t = Topology(dist.get_world_size(), dist.get_world_size(), dist.get_rank())
        _TOPOLOGY = t
    return t


def inter_share(collective: str, payload: int, wire: int, group: dist.ProcessGroup | None,
                link: str | None, peer: int | None) -> tuple[int, int]:
    """The (payload, wire) bytes of one call that cross nodes (module docstring's rules)."""
    if link is None:
        link = link_of_group(group)
    if link is not None and link not in ("intra", "inter", "world"):
        raise ValueError(f"unknown link {link!r}; valid: intra, inter, world, or None")
    if link == "inter":
        return payload, wire
    if link == "intra":
        return 0, 0
    topo = topology()
    if topo is None or topo.nodes == 1:
        return 0, 0
    if collective == "p2p" and peer is not None and 0 <= peer < topo.world:
        return (payload, wire) if topo.node_of(peer) != topo.node else (0, 0)
    return payload // topo.local_size, wire // topo.local_size


__all__ = ["Counter", "Ledger", "inter_share", "ledger", "set_topology", "topology"]

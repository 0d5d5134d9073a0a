"""Hierarchical all-reduce for clusters of multi-GPU nodes, and the hybrid flat/hierarchical rule.

Why: a flat ring all-reduce over ``P = N·G`` workers (``N`` nodes of ``G``) pushes
``2(P-1)/P·s`` bytes per worker through a ring whose slowest hop is the node's network card.
The hierarchical form (Jia et al. 2018, "ImageNet in four minutes") keeps most bytes inside
the node:

1. intra-node reduce-scatter: each worker gets the node's sum of one ``1/G`` chunk
   (``(G-1)/G·s`` bytes per worker, intra);
2. inter-node all-reduce of that chunk among the workers with the same local rank
   (``2(N-1)/N·s/G`` bytes per worker, inter; the ``G`` such all-reduces of a node run at
   once, so the node's card carries ``2(N-1)/N·s``, against the flat ring's ``2(P-1)/P·s``);
3. intra-node all-gather of the summed chunks (``(G-1)/G·s`` bytes per worker, intra).

Every stage goes through :mod:`lowcomm.comm.accounting` on the groups of
:func:`~lowcomm.comm.topology.node_groups`, so the ledger counts each under its link class.
The buffer is padded to a multiple of ``G`` (a copy only when it is not one already). The sum
is exact up to the order of additions (node sums first, then across nodes).

Hybrid rule. Three collectives cost three start-up latencies, so for small tensors the flat
ring wins. With each link modelled as ``α + β·bytes`` (α: seconds per collective on the link;
β: seconds per byte a worker sends on it while every worker of its node sends at once, which
is what :func:`probe_link_costs` measures and what the ledger counts per worker):

* flat: ``α_inter + max(β_inter·W/G, β_intra·W·(G-1)/G)`` with ``W = 2(P-1)/P·s`` (the ring
  crosses each node boundary once: ``1/G`` of a worker's bytes are inter, see accounting);
* hierarchical, pipelined in ``K`` pieces of ``c = s/K`` (about :data:`PIPELINE_BYTES` each):
  ``2·stage(c) + K·max(α_inter + β_inter·2(N-1)/N·c/G, 2·stage(c))`` with
  ``stage(c) = α_intra + β_intra·(G-1)/G·c`` (one piece crosses the nodes while the next
  is reduce-scattered and the previous all-gathered inside the node).

:func:`choose` picks the cheaper one per fused buffer, from the buffer's size and the four
numbers only; those are pinned by the user or probed once and averaged over all ranks, so
every rank decides alike.

Asynchrony. The three stages depend on each other, so they cannot all be started at once
from a backward hook without waiting there. :class:`HierarchicalReducer` runs them on one
communication thread per reducer, in the order the buffers were submitted (the engine's
launch order, the same on every rank). That thread is the only user of the intra and inter
groups, so their collective sequences are the same everywhere; flat choices stay on the
caller's world group, issued asynchronously from the caller's thread as before.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.comm.ordered import OrderedThread
from lowcomm.comm.topology import NodeGroups, Topology, node_groups
from lowcomm.errors import UsageError, check_positive
from lowcomm.sched.cost import AlphaBeta, probe_alpha_beta

#: ``mode`` values: always hierarchical, per-buffer choice by the α-β model, always flat
MODES = ("hier", "hybrid", "flat")


def _padded(n: int, k: int) -> int:
    return -(-n // k) * k


#: pipeline granularity of :func:`hierarchical_all_reduce`: a buffer is cut into pieces of
#: about this size so that one piece's inter-node all-reduce runs while the next piece is
#: reduce-scattered and the previous one all-gathered inside the node
PIPELINE_BYTES = 4 << 20
#: at most this many pieces per buffer (each costs three start-ups)
MAX_PIECES = 16


def pieces_of(numel: int, element_size: int, g: int, piece_bytes: int = PIPELINE_BYTES) -> list[int]:
    """Lengths of the pieces a padded buffer of ``numel`` elements (a multiple of ``g``) is cut
    into: each a multiple of ``g``, about ``piece_bytes`` each, at most :data:`MAX_PIECES`."""
    count = max(1, min(MAX_PIECES, -(-numel * element_size // max(1, piece_bytes)), numel // g))
    step = _padded(-(-numel // count), g)
    return [min(step, numel - start) for start in range(0, numel, step)]


def hierarchical_all_reduce(flat: torch.Tensor, topo: Topology, groups: NodeGroups | None = None, *,
                            tag: str = "hier", piece_bytes: int = PIPELINE_BYTES) -> None:
    """Sum ``flat`` over all workers in place: intra reduce-scatter, inter all-reduce, intra
    all-gather (module docstring), counted under ``<tag>.rs``, ``<tag>.ar``, ``<tag>.ag``.

    Pipelined: the buffer is cut into pieces of about ``piece_bytes`` (:func:`pieces_of`);
    piece ``i``'s inter-node all-reduce is in flight while piece ``i+1`` is reduce-scattered
    and piece ``i-1`` all-gathered inside the node (different process groups, so the two
    links work at once; the order of calls on each group is the same on every rank). Bytes
    per link are those of the unpipelined form. ``groups``:
    :func:`~lowcomm.comm.topology.node_groups` of ``topo`` (made here when None; that is
    collective). A topology that is not hierarchical runs one flat all-reduce under ``tag``
    on the world group. Synchronous; see :class:`HierarchicalReducer` for overlap with backward.
    """
    if not (dist.is_available() and dist.is_initialized()) or topo.world == 1:
        return
    if not topo.hierarchical:
        accounting.all_reduce(flat, tag=tag)
        return
    groups = groups if groups is not None else node_groups(topo)
    g = topo.local_size
    n = flat.numel()
    contiguous = flat.is_contiguous() and n % g == 0
    buf = flat.view(-1) if contiguous else flat.new_zeros(_padded(n, g))
    if not contiguous:
        buf[:n].copy_(flat.reshape(-1))
    pieces = list(buf.split(pieces_of(buf.numel(), buf.element_size(), g, piece_bytes)))
    shards = [p.new_empty(p.numel() // g) for p in pieces]

    def scatter(i: int) -> None:
        accounting.reduce_scatter_tensor(shards[i], pieces[i], group=groups.intra, tag=f"{tag}.rs", link="intra")

    gathers = []
    scatter(0)
    for i in range(len(pieces)):
        summed = accounting.all_reduce(shards[i], group=groups.inter, async_op=True, tag=f"{tag}.ar", link="inter")
        if i + 1 < len(pieces):
            scatter(i + 1)  # inside the node while piece i crosses the nodes
        summed.wait()
        gathers.append(accounting.all_gather_into_tensor(pieces[i], shards[i], group=groups.intra, async_op=True,
                                                         tag=f"{tag}.ag", link="intra"))
    for work in gathers:
        work.wait()
    if not contiguous:
        flat.copy_(buf[:n].view_as(flat))


# --- the α-β model and the hybrid choice --------------------------------------------------------
@dataclass(frozen=True)
class LinkCosts:
    """α-β model of the two links (module docstring): seconds per collective and per byte a
    worker sends, with every worker of the node sending at once."""

    intra: AlphaBeta
    inter: AlphaBeta

    @classmethod
    def pinned(cls, alpha_intra: float, beta_intra: float, alpha_inter: float, beta_inter: float) -> LinkCosts:
        """From user values (refused when negative or not finite)."""
        for name, v in (("alpha_intra", alpha_intra), ("beta_intra", beta_intra),
                        ("alpha_inter", alpha_inter), ("beta_inter", beta_inter)):
            check_positive(f"hier: {name}", v, allow_zero=True)
        return cls(AlphaBeta(float(alpha_intra), float(beta_intra)), AlphaBeta(float(alpha_inter), float(beta_inter)))


def flat_time(nbytes: float, topo: Topology, costs: LinkCosts) -> float:
    """Predicted seconds of a flat ring all-reduce of ``nbytes`` (module docstring)."""
    p, g = topo.world, topo.local_size
    wire = 2 * (p - 1) / p * nbytes
    if topo.nodes == 1:
        return costs.intra.alpha + costs.intra.beta * wire
    return costs.inter.alpha + max(costs.inter.beta * wire / g, costs.intra.beta * wire * (g - 1) / g)


def hier_time(nbytes: float, topo: Topology, costs: LinkCosts) -> float:
    """Predicted seconds of the pipelined hierarchical all-reduce of ``nbytes`` (module
    docstring): ``K`` pieces of ``c = nbytes/K``; the first reduce-scatter and the last
    all-gather are exposed, in between each step takes the longer of a piece's inter-node
    all-reduce and its two intra-node stages."""
    n, g = topo.nodes, topo.local_size
    k = max(1, min(MAX_PIECES, math.ceil(nbytes / PIPELINE_BYTES)))
    c = nbytes / k
    stage = costs.intra.alpha + costs.intra.beta * (g - 1) / g * c
    inter = costs.inter.alpha + costs.inter.beta * 2 * (n - 1) / n * c / g
    return 2 * stage + k * max(inter, 2 * stage)


def choose(nbytes: float, topo: Topology, costs: LinkCosts | None, mode: str) -> str:
    """``"hier"`` or ``"flat"`` for a buffer of ``nbytes`` under ``mode`` (a deterministic
    function of its inputs: identical on every rank when ``costs`` are)."""
    if mode not in MODES:
        raise UsageError(f"hier: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if mode == "flat" or not topo.hierarchical:
        return "flat"
    if mode == "hier":
        return "hier"
    if costs is None:
        raise ValueError("hybrid mode needs link costs (pinned or probed)")
    return "hier" if hier_time(nbytes, topo, costs) < flat_time(nbytes, topo, costs) else "flat"


def probe_link_costs(topo: Topology, groups: NodeGroups | None = None, *, device: torch.device | None = None,
                     small_bytes: int = 4096, large_bytes: int = PIPELINE_BYTES, tag: str = "hier.probe") -> LinkCosts:
    """Measure α and β of both links with all-reduces on the intra groups (all nodes at once),
    then on the inter groups (all local ranks at once); averaged over every rank, so every
    rank gets the same numbers. β is converted to seconds per byte a worker sends (the
    all-reduce's ``2(n-1)/n`` factor divided out). Collective."""
    if not topo.hierarchical:
        raise ValueError("probe_link_costs needs a hierarchical topology")
    groups = groups if groups is not None else node_groups(topo)
    measured = []
    for group, size in ((groups.intra, topo.local_size), (groups.inter, topo.nodes)):
        ab = probe_alpha_beta(group=group, small_bytes=small_bytes, large_bytes=large_bytes, device=device, tag=tag)
        measured += [ab.alpha, ab.beta / (2 * (size - 1) / size)]
    vals = torch.tensor(measured, dtype=torch.float64, device=device or torch.device("cpu"))
    accounting.all_reduce(vals, tag=tag)
    vals /= topo.world
    a_i, b_i, a_x, b_x = (float(v) for v in vals)
    return LinkCosts(AlphaBeta(a_i, b_i), AlphaBeta(a_x, b_x))


# --- asynchronous use from the engine and the hooks ---------------------------------------------
class Handle:
    """A submitted hierarchical all-reduce: :meth:`wait` blocks until the sum is in the buffer;
    :meth:`get_future` gives a ``torch.futures.Future`` of ``[buffer]`` (like a Work's)."""

    def __init__(self, buf: torch.Tensor, fut: torch.futures.Future[list[torch.Tensor]]) -> None:
        self.buf = buf
        self._fut = fut

    def wait(self) -> bool:
        """Block until done; re-raises what failed on the communication thread."""
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the three stages finished."""
        return bool(self._fut.done())

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The future the communication thread completes."""
        return self._fut


class HierarchicalReducer:
    """All-reduces buffers hierarchically or flat (per :func:`choose`) without blocking the
    caller: hierarchical ones run on a communication thread in submission order, flat ones are
    started asynchronously on ``group`` (the world) from the caller's thread.

    ``pad_to``: buffers whose length is a multiple of it need no padding copy.
    """

    def __init__(self, topo: Topology, *, mode: str = "hier", costs: LinkCosts | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        if mode not in MODES:
            raise UsageError(f"hier: unknown mode {mode!r}; valid: {', '.join(MODES)}")
        self.topo = topo
        self.mode = mode
        self.costs = costs
        self.group = group
        self.groups = node_groups(topo)  # collective: made here, on every rank, in one order
        self.pad_to = topo.local_size
        self.chosen: dict[int, str] = {}  # bytes -> choice (for describe())
        self._thread: OrderedThread[list[torch.Tensor]] = OrderedThread("lowcomm-hier")

    def choice(self, nbytes: int) -> str:
        """``"hier"`` or ``"flat"`` for a buffer of ``nbytes`` (remembered for the summary)."""
        c = choose(nbytes, self.topo, self.costs, self.mode)
        self.chosen[nbytes] = c
        return c

    def start(self, buf: torch.Tensor, *, tag: str) -> Any:
        """Start summing ``buf`` in place over all workers; returns a handle with ``wait()``
        and ``get_future()`` (a torch Work for a flat choice, a :class:`Handle` otherwise)."""
        if self.choice(buf.numel() * buf.element_size()) == "flat":
            return accounting.all_reduce(buf, group=self.group, async_op=True, tag=tag)

        def job() -> list[torch.Tensor]:
            # a new thread starts on CUDA device 0: allocate the chunk on the buffer's device
            with torch.cuda.device(buf.device) if buf.is_cuda else contextlib.nullcontext():
                hierarchical_all_reduce(buf, self.topo, self.groups, tag=tag)
            return [buf]

        return Handle(buf, self._thread.submit(job))

    def run(self, buf: torch.Tensor, *, tag: str) -> None:
        """Sum ``buf`` in place and wait (a codec's non-final message), in submission order."""
        self.start(buf, tag=tag).wait()

    def close(self) -> None:
        """Stop the communication thread after the buffers already submitted."""
        self._thread.close()

    def describe(self) -> dict[str, Any]:
        """Mode, topology, link costs and the choice made per buffer size (for run summaries)."""
        d: dict[str, Any] = {"hier_mode": self.mode, "nodes": self.topo.nodes, "gpus_per_node": self.topo.local_size,
                             "hierarchical_buffers": sum(1 for c in self.chosen.values() if c == "hier"),
                             "flat_buffers": sum(1 for c in self.chosen.values() if c == "flat")}
        if self.costs is not None:
            d["link_costs"] = {"alpha_intra": self.costs.intra.alpha, "beta_intra": self.costs.intra.beta,
                               "alpha_inter": self.costs.inter.alpha, "beta_inter": self.costs.inter.beta}
        return d


__all__ = ["MODES", "Handle", "HierarchicalReducer", "LinkCosts", "choose", "flat_time", "hier_time",
           "hierarchical_all_reduce", "probe_link_costs"]

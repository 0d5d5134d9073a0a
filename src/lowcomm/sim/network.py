"""α-β cost model of collectives: time = (latency steps)·α + (bytes on the wire)·β.

α is the per-message start-up latency in seconds and β the seconds per byte (1/bandwidth).
The byte terms are the ring-model wire bytes of :mod:`lowcomm.comm.accounting`, so a
prediction's traffic equals what the accounting layer counts for the same collectives.

Formulas (P workers, ``n`` = bytes of the full tensor, ``n_local`` = bytes one worker
contributes to an all-gather, so ``n = P·n_local``; with P == 1 every collective costs nothing):

* ring all-reduce:      2(P-1)·α + 2(P-1)/P·n·β
* tree all-reduce:      2⌈log2 P⌉·α + 2·n·β        (pipelined reduce + broadcast trees)
* reduce-scatter:       (P-1)·α + (P-1)/P·n·β
* all-gather:           (P-1)·α + (P-1)·n_local·β
* broadcast:            ⌈log2 P⌉·(α + n·β)          (binomial tree)
* hierarchical all-reduce (G workers per node, N = P/G nodes): intra-node reduce-scatter,
  inter-node ring all-reduce of n/G, intra-node all-gather:
  2(G-1)·α_i + 2(G-1)/G·n·β_i + 2(N-1)·α_e + 2(N-1)/N·(n/G)·β_e

**Two-level topology** (``gpus_per_node`` G > 1 with an ``intra`` link; ``lowcomm simulate
--nodes N --gpus-per-node G``): ``nic`` says who owns the inter-node link, ``gpu`` (one per
worker, the formula above) or ``node`` (one NIC per node shared by its G workers: public
clouds, ``lowcomm bench --nodes``). The flat ring, hierarchical and hybrid all-reduce over a
node NIC, and where a codec's scoped rounds run, are in docs/simulator.md §2.1.

**Per-collective calibration.** On gloo over TCP on a CPU box a small all-reduce costs
milliseconds (each ring step wakes a thread and copies), and kinds differ per byte.
``collective_alpha`` (per-step α by kind: ``all_reduce``, ``reduce_scatter``, ``all_gather``,
``broadcast``, ``p2p``), ``collective_beta_scale`` (β multiplier, 1/efficiency),
``queued_alpha`` and ``queued_overlap`` (a collective queued behind another) override the
link's α and β; :mod:`lowcomm.sim.calibrate` fits them from a probe of the real library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from lowcomm.comm.accounting import wire_bytes
from lowcomm.errors import UsageError

ALGORITHMS = ("ring", "tree", "hierarchical", "hybrid")
#: who owns an inter-node link: every worker (multi-rail) or the node (one shared NIC)
NICS = ("gpu", "node")
SCOPES = ("world", "intra", "inter")


@dataclass(frozen=True)
class Link:
    """One α-β link: ``alpha_s`` latency per message, ``beta_s_per_byte`` = 1/bandwidth."""

    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth_bits_per_s(self) -> float:
        """Line rate in bit/s (what presets and ``--net`` rates are given in)."""
        return 8.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


def _link(bits_per_s: float, alpha_s: float) -> Link:
    return Link(alpha_s=alpha_s, beta_s_per_byte=8.0 / bits_per_s)


#: Presets. α values are typical one-way per-message latencies of a collective library on
#: that fabric (TCP stacks ~tens of µs, RDMA ~µs); β comes from the nominal line rate.
PRESETS: dict[str, Link] = {
    "1gbit": _link(1e9, 50e-6),
    "10gbit": _link(10e9, 30e-6),
    "25gbit": _link(25e9, 20e-6),
    "100gbit": _link(100e9, 10e-6),
    "infiniband": _link(100e9, 2e-6),  # HDR/EDR-class IB, RDMA verbs
    "nvlink": _link(300e9 * 8, 1e-6),  # NVLink 3 intra-node, ~300 GB/s per GPU
}
#: links inside a node besides :data:`PRESETS`: ``loopback`` is what the emulated cluster's
#: workers of one node get (memory copies through the kernel, tens of Gbit/s on a CPU box)
INTRA_PRESETS: dict[str, Link] = {"loopback": _link(20e9, 20e-6), "nvlink": PRESETS["nvlink"], "pcie": _link(100e9, 5e-6)}
PRESET_ALIASES = {"ib": "infiniband", "1gbe": "1gbit", "10gbe": "10gbit", "25gbe": "25gbit",
                  "100gbe": "100gbit"}


@dataclass(frozen=True)
class NetworkModel:
    """Costs of collectives among ``P`` workers on one network.

    ``inter`` is the link between workers (between nodes when hierarchical); ``intra`` the
    link inside a node, used by the hierarchical and hybrid all-reduce and by scoped codec
    rounds when ``gpus_per_node`` > 1 (the two-level topology, module docstring).
    """

    inter: Link
    algorithm: str = "ring"
    intra: Link | None = None
    gpus_per_node: int = 1
    name: str = "custom"
    #: ``gpu``: one inter-node link per worker; ``node``: one NIC per node, shared by its workers
    nic: str = "gpu"
    #: per-step latency (s) by collective kind, replacing ``inter.alpha_s`` for that kind
    collective_alpha: Mapping[str, float] = field(default_factory=dict, compare=False)
    #: β multiplier by collective kind (measured seconds per wire byte / link β)
    collective_beta_scale: Mapping[str, float] = field(default_factory=dict, compare=False)
    #: per-step latency (s) by kind of a collective queued behind another (empty: as isolated)
    queued_alpha: Mapping[str, float] = field(default_factory=dict, compare=False)
    #: kinds the library runs two at a time (gloo's worker threads; Timeline.add's ``beside``)
    queued_overlap: tuple[str, ...] = field(default=(), compare=False)
    #: per-step latency (s) by kind of a ``queued_overlap`` collective beside a transfer (the
    #: probe's tiny ones behind a large one; empty: the larger of wire time and queued latency)
    beside_alpha: Mapping[str, float] = field(default_factory=dict, compare=False)
    #: compute seconds a worker loses per wire byte it moves (the library's threads taking CPU from
    #: compute on shared cores; 0 on a GPU, emulated compute; bench.contention.measure_contention)
    cpu_s_per_wire_byte: float = field(default=0.0, compare=False)
    #: the least compute a collective takes that way, however small (thread wake-ups, syscalls,
    #: a Python hook), measured with a small payload: a collective costs the larger of the two
    cpu_s_per_collective: float = field(default=0.0, compare=False)
    #: what that CPU slows: ``compute`` (real compute: every compute second needs a core) or
    #: ``host`` (emulated compute, whose layers are waits: only the host work beside a transfer)
    contention_on: str = field(default="compute", compare=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise UsageError(f"unknown all-reduce algorithm {self.algorithm!r}; valid: "
                             f"{', '.join(ALGORITHMS)}")
        if self.algorithm in ("hierarchical", "hybrid") and (self.intra is None or self.gpus_per_node < 1):
            raise UsageError(f"{self.algorithm} all-reduce needs an intra-node link and gpus_per_node")
        if self.nic not in NICS:
            raise UsageError(f"unknown nic {self.nic!r}; valid: {', '.join(NICS)}")
        if self.gpus_per_node < 1:
            raise UsageError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **kw: Any) -> NetworkModel:
        """A named fabric (``10gbit``, ``nvlink``...; see :data:`PRESETS`)."""
        key = PRESET_ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            raise UsageError(f"unknown network preset {name!r}; valid: {', '.join(PRESETS)} "
                             "or a rate like 500mbit")
        return cls(inter=PRESETS[key], name=key, **kw)

    @classmethod
    def two_level(cls, inter: Link, intra: Link, gpus_per_node: int, *, algorithm: str = "ring",
                  nic: str = "node", **kw: Any) -> NetworkModel:
        """Nodes of ``gpus_per_node`` workers: ``intra`` inside a node, ``inter`` between nodes."""
        return cls(inter=inter, intra=intra, gpus_per_node=gpus_per_node, algorithm=algorithm, nic=nic, **kw)

    @classmethod
    def from_probe(cls, bandwidth_bits_per_s: float, rtt_s: float, **kw: Any) -> NetworkModel:
        """From a measured bandwidth and round-trip time: α = rtt/2, β = 8/bandwidth."""
        if bandwidth_bits_per_s <= 0 or rtt_s < 0:
            raise UsageError("probe needs bandwidth > 0 and rtt >= 0, got "
                             f"{bandwidth_bits_per_s} bit/s, {rtt_s} s")
        kw.setdefault("name", f"probe:{bandwidth_bits_per_s / 1e6:g}Mbit/s,rtt={rtt_s * 1e3:g}ms")
        return cls(inter=_link(bandwidth_bits_per_s, rtt_s / 2.0), **kw)

    @property
    def alpha_s(self) -> float:
        """Per-message latency of the inter-node link."""
        return self.inter.alpha_s

    def alpha_for(self, kind: str) -> float:
        """Per-step α of collective ``kind`` (calibrated if known, else the link's)."""
        return float(self.collective_alpha.get(kind, self.inter.alpha_s))

    def beta_for(self, kind: str) -> float:
        """Seconds per wire byte of collective ``kind`` (link β times its calibrated scale)."""
        return self.inter.beta_s_per_byte * float(self.collective_beta_scale.get(kind, 1.0))

    def with_contention(self, cpu_s_per_wire_byte: float, cpu_s_per_collective: float = 0.0, *,
                        on: str = "compute") -> NetworkModel:
        """A copy charging each collective's CPU (:meth:`contention_s`) to ``on`` (see
        :attr:`contention_on`): workers on CPU cores shared with the collective library."""
        for name, v in (("cpu_s_per_wire_byte", cpu_s_per_wire_byte), ("cpu_s_per_collective", cpu_s_per_collective)):
            if v < 0 or v != v:
                raise UsageError(f"{name} must be >= 0, got {v}")
        if on not in ("compute", "host"):
            raise UsageError(f"contention charged to {on!r}; valid: compute, host")
        return replace(self, cpu_s_per_wire_byte=float(cpu_s_per_wire_byte),
                       cpu_s_per_collective=float(cpu_s_per_collective), contention_on=on)

    def contention_s(self, wire_bytes: float) -> float:
        """Compute seconds a collective moving ``wire_bytes`` takes from a worker sharing its
        cores: per byte, never less than a small collective's (docs/simulator.md §5.2); 0 without."""
        return max(self.cpu_s_per_collective, self.cpu_s_per_wire_byte * wire_bytes)

    def with_calibration(self, alpha: Mapping[str, float], beta_scale: Mapping[str, float],
                         **kw: Any) -> NetworkModel:
        """A copy with per-collective α and β scale (see module docstring)."""
        return replace(self, collective_alpha=dict(alpha), collective_beta_scale=dict(beta_scale), **kw)

    def queued(self) -> NetworkModel | None:
        """The model of a collective that waits for the link (queued α by kind), or None."""
        return self._with_alpha(self.queued_alpha)

    def beside(self) -> NetworkModel | None:
        """The model of a collective beside a transfer (beside α by kind), or None."""
        return self._with_alpha(self.beside_alpha)

    def _with_alpha(self, alpha: Mapping[str, float]) -> NetworkModel | None:
        return replace(self, collective_alpha={**self.collective_alpha, **alpha}, queued_alpha={}) if alpha else None

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte of the inter-node link."""
        return self.inter.beta_s_per_byte

    def describe(self) -> dict[str, Any]:
        """JSON form, recorded with every prediction so a result says which network it assumed."""
        d: dict[str, Any] = {
            "name": self.name,
            "algorithm": self.algorithm,
            "alpha_s": self.inter.alpha_s,
            "bandwidth_bits_per_s": self.inter.bandwidth_bits_per_s,
        }
        optional = {"collective_alpha_s": dict(self.collective_alpha),
                    "collective_beta_scale": dict(self.collective_beta_scale),
                    "queued_alpha_s": dict(self.queued_alpha),
                    "queued_overlap": list(self.queued_overlap) if self.queued_alpha else None,
                    "beside_alpha_s": dict(self.beside_alpha),
                    "cpu_s_per_wire_byte": self.cpu_s_per_wire_byte,
                    "cpu_s_per_collective": self.cpu_s_per_collective,
                    "contention_on": self.contention_on if self.contention_s(1.0) > 0 else None}
        d.update({k: v for k, v in optional.items() if v})
        if self.intra is not None and (self.algorithm in ("hierarchical", "hybrid") or self.gpus_per_node > 1):
            d.update(intra_alpha_s=self.intra.alpha_s,
                     intra_bandwidth_bits_per_s=self.intra.bandwidth_bits_per_s,
                     gpus_per_node=self.gpus_per_node, nic=self.nic)
        return d

    # -- two-level topology ---------------------------------------------------------------
    def levels(self, p: int) -> tuple[int, int] | None:
        """``(nodes, workers per node)`` when ``p`` workers form a two-level topology, else None."""
        g = self.gpus_per_node
        if self.intra is None or g < 2 or p <= g or p % g:
            return None
        return p // g, g

    def _nic_share(self, g: int) -> int:
        """Concurrent inter-node collectives sharing one NIC (G with a node NIC, else 1)."""
        return g if self.nic == "node" else 1

    def flat_all_reduce(self, nbytes: float, p: int) -> float:
        """A ring over all ``p`` workers: paced by the inter-node link (or the intra link when
        every worker is on one node)."""
        if self.intra is not None and 1 < p <= self.gpus_per_node:
            return ring_all_reduce(self.intra, nbytes, p)
        return ring_all_reduce(Link(self.alpha_for("all_reduce"), self.beta_for("all_reduce")), nbytes, p)

    def hybrid_choice(self, nbytes: float, p: int) -> str:
        """``hierarchical`` or ``flat``: the faster all-reduce of ``nbytes`` under this model
        (flat on a tie and when there is no two-level topology)."""
        if self.levels(p) is None:
            return "flat"
        return "hierarchical" if self.hierarchical_all_reduce(nbytes, p) < self.flat_all_reduce(nbytes, p) else "flat"

    def all_reduce_with(self, algorithm: str, nbytes: float, p: int) -> float:
        """An all-reduce with an explicit algorithm (``flat``/``ring``, ``hierarchical``, ``hybrid``)."""
        if algorithm == "hybrid":
            algorithm = self.hybrid_choice(nbytes, p)
        if algorithm == "hierarchical" and self.levels(p) is not None:
            return self.hierarchical_all_reduce(nbytes, p)
        return self.flat_all_reduce(nbytes, p)

    def scoped(self, collective: str, nbytes: float, p: int, scope: str) -> float:
        """Seconds of ``collective`` (``nbytes`` as in the methods below) on ``scope``'s group.

        ``intra``: the G workers of a node on the intra link; ``inter``: the N same-local-rank
        workers on the inter link, the G concurrent collectives sharing a node NIC; ``world``
        or no two-level topology: all ``p`` workers (the transport's flat fallback).
        """
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; valid: {', '.join(SCOPES)}")
        lv = self.levels(p)
        if scope == "world" or lv is None:
            return self._flat(collective, nbytes, p)
        nodes, g = lv
        assert self.intra is not None
        if scope == "intra":
            return NetworkModel(inter=self.intra, name=self.name)._flat(collective, nbytes, g)
        # the inter-node link with its calibration, β scaled by the G collectives sharing a NIC
        share = self._nic_share(g)
        inter = replace(self, intra=None, gpus_per_node=1, algorithm="ring",
                        inter=Link(self.inter.alpha_s, self.inter.beta_s_per_byte * share))
        return inter._flat(collective, nbytes, nodes)

    def _flat(self, collective: str, nbytes: float, p: int) -> float:
        kinds = {"all_reduce": self.all_reduce, "reduce_scatter": self.reduce_scatter,
                 "all_gather": self.all_gather, "broadcast": self.broadcast}
        if collective == "p2p":
            return self.point_to_point(nbytes) if p > 1 else 0.0
        if collective not in kinds:
            raise ValueError(collective)
        return kinds[collective](nbytes, p)

    def inter_bytes(self, collective: str, payload: int, p: int, scope: str = "world",
                    algorithm: str = "flat") -> float:
        """Bytes one worker sends over inter-node links, by :mod:`lowcomm.comm.accounting`'s
        convention: intra -> 0; inter -> all of it; a flat collective over several nodes ->
        1/G of its wire bytes (the ring crosses each node boundary once); hierarchical
        all-reduce -> its inter-node ring of n/G. Without a two-level topology each worker is
        its own node: every byte is inter-node."""
        lv = self.levels(p)
        if lv is None:
            if self.intra is not None and p <= self.gpus_per_node:
                return 0.0  # one node
            return float(collective_wire_bytes(collective, payload, p))
        nodes, g = lv
        if scope == "intra":
            return 0.0
        if scope == "inter":
            return float(collective_wire_bytes(collective, payload, nodes))
        if collective == "all_reduce" and algorithm == "hybrid":
            algorithm = self.hybrid_choice(payload, p)
        if collective == "all_reduce" and algorithm == "hierarchical":
            return float(collective_wire_bytes("all_reduce", math.ceil(payload / g), nodes))
        return collective_wire_bytes(collective, payload, p) / g

    def wire_bytes_of(self, collective: str, payload: int, p: int, scope: str = "world",
                      algorithm: str = "flat") -> int:
        """Bytes one worker sends on all links for ``collective`` (scoped / hierarchical aware)."""
        lv = self.levels(p)
        if lv is None:
            return collective_wire_bytes(collective, payload, p)
        nodes, g = lv
        if scope in ("intra", "inter"):
            return collective_wire_bytes(collective, payload, g if scope == "intra" else nodes)
        if collective == "all_reduce" and algorithm == "hybrid":
            algorithm = self.hybrid_choice(payload, p)
        if collective == "all_reduce" and algorithm == "hierarchical":
            shard = math.ceil(payload / g)
            return (collective_wire_bytes("reduce_scatter", shard * g, g)
                    + collective_wire_bytes("all_reduce", shard, nodes)
                    + collective_wire_bytes("all_gather", shard, g))
        return collective_wire_bytes(collective, payload, p)

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, nbytes: float, p: int) -> float:
        """Seconds of an all-reduce of ``nbytes`` among ``p`` workers (ring, tree or hierarchical)."""
        if p <= 1:
            return 0.0
        if self.algorithm == "tree":
            return 2 * math.ceil(math.log2(p)) * self.alpha_s + 2 * nbytes * self.beta_s_per_byte
        if self.algorithm in ("hierarchical", "hybrid"):
            return self.all_reduce_with(self.algorithm, nbytes, p) if self.levels(p) is not None \
                else self.hierarchical_all_reduce(nbytes, p)
        if self.levels(p) is not None:
            return self.flat_all_reduce(nbytes, p)
        return ring_all_reduce(Link(self.alpha_for("all_reduce"), self.beta_for("all_reduce")), nbytes, p)

    def hierarchical_all_reduce(self, nbytes: float, p: int) -> float:
        """Intra-node reduce-scatter, inter-node all-reduce of n/G, intra-node all-gather."""
        assert self.intra is not None
        g = min(self.gpus_per_node, p)
        nodes = math.ceil(p / g)
        t = 0.0
        if g > 1:  # reduce-scatter + all-gather inside the node
            t += 2 * ((g - 1) * self.intra.alpha_s + (g - 1) / g * nbytes * self.intra.beta_s_per_byte)
        # G inter-node rings of n/G at once: on a shared node NIC they add up to n
        inter = Link(self.alpha_for("all_reduce"), self.beta_for("all_reduce") * self._nic_share(g))
        return t + ring_all_reduce(inter, nbytes / g, nodes)

    def reduce_scatter(self, nbytes: float, p: int) -> float:
        """``nbytes`` is the full input tensor (each worker keeps 1/P of the result)."""
        if p <= 1:
            return 0.0
        return (p - 1) * self.alpha_for("reduce_scatter") + (p - 1) / p * nbytes * self.beta_for("reduce_scatter")

    def all_gather(self, local_nbytes: float, p: int) -> float:
        """``local_nbytes`` is what one worker contributes; the output is P times that."""
        if p <= 1:
            return 0.0
        return (p - 1) * self.alpha_for("all_gather") + (p - 1) * local_nbytes * self.beta_for("all_gather")

    def broadcast(self, nbytes: float, p: int) -> float:
        """Seconds of a binomial-tree broadcast of ``nbytes`` to ``p`` workers."""
        if p <= 1:
            return 0.0
        return math.ceil(math.log2(p)) * (self.alpha_for("broadcast") + nbytes * self.beta_for("broadcast"))

    def point_to_point(self, nbytes: float) -> float:
        """One exchange with a partner (a recursive-doubling round)."""
        return self.alpha_for("p2p") + nbytes * self.beta_for("p2p")


def ring_all_reduce(link: Link, nbytes: float, p: int) -> float:
    """2(P-1)·α + 2(P-1)/P·n·β: the bandwidth-optimal all-reduce NCCL and gloo run."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes * link.beta_s_per_byte


def collective_wire_bytes(collective: str, payload: int, p: int) -> int:
    """Bytes one worker sends, exactly as :mod:`lowcomm.comm.accounting` counts them."""
    return wire_bytes(collective, payload, p)


# the --net / --intra parsers live in :mod:`lowcomm.sim.netspec` (one job each); re-exported here
from lowcomm.sim.netspec import parse_intra, parse_network, parse_rate  # noqa: E402

__all__ = ["ALGORITHMS", "INTRA_PRESETS", "NICS", "PRESETS", "PRESET_ALIASES", "SCOPES", "Link", "NetworkModel",
           "collective_wire_bytes", "parse_intra", "parse_network", "parse_rate", "ring_all_reduce"]

"""α-β cost model of collectives: time = (latency steps)·α + (bytes on the wire)·β.

α is the per-message start-up latency in seconds and β the seconds per byte (1/bandwidth).
The byte terms are the ring-model wire bytes of :mod:`lowcomm.comm.accounting`, so a
prediction's traffic equals what the accounting layer counts for the same collectives.

Formulas (P workers, ``n`` = bytes of the full tensor, ``n_local`` = bytes one worker
contributes to an all-gather, so ``n = P·n_local``):

* ring all-reduce:      2(P-1)·α + 2(P-1)/P·n·β
* tree all-reduce:      2⌈log2 P⌉·α + 2·n·β        (pipelined reduce + broadcast trees)
* reduce-scatter:       (P-1)·α + (P-1)/P·n·β
* all-gather:           (P-1)·α + (P-1)·n_local·β
* broadcast:            ⌈log2 P⌉·(α + n·β)          (binomial tree)
* hierarchical all-reduce (G workers per node, N = P/G nodes): intra-node reduce-scatter,
  inter-node ring all-reduce of n/G, intra-node all-gather:
  2(G-1)·α_i + 2(G-1)/G·n·β_i + 2(N-1)·α_e + 2(N-1)/N·(n/G)·β_e

With P == 1 every collective costs nothing.

**Per-collective calibration.** A real collective library does not reach one (α, β) for
every collective: on gloo over TCP on a CPU box a small all-reduce costs milliseconds (the
ring's 2(P-1) steps each wake a thread and copy), and gloo's all-to-all (which lowcomm's
reduce-scatter uses on gloo) moves a byte more slowly than its ring all-reduce or
all-gather. ``NetworkModel.collective_alpha`` (per-step α by collective kind) and
``collective_beta_scale`` (β multiplier by kind, 1/efficiency) override the link's α and β
for that kind; :mod:`lowcomm.sim.calibrate` fits both from a probe of the real library.
Kinds: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``p2p``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from lowcomm.comm.accounting import wire_bytes
from lowcomm.errors import UsageError

ALGORITHMS = ("ring", "tree", "hierarchical")


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
PRESET_ALIASES = {"ib": "infiniband", "1gbe": "1gbit", "10gbe": "10gbit", "25gbe": "25gbit",
                  "100gbe": "100gbit"}


@dataclass(frozen=True)
class NetworkModel:
    """Costs of collectives among ``P`` workers on one network.

    ``inter`` is the link between workers (between nodes when hierarchical); ``intra`` the
    link inside a node, used only by ``algorithm="hierarchical"`` with ``gpus_per_node``.
    """

    inter: Link
    algorithm: str = "ring"
    intra: Link | None = None
    gpus_per_node: int = 1
    name: str = "custom"
    #: per-step latency (s) by collective kind, replacing ``inter.alpha_s`` for that kind
    collective_alpha: Mapping[str, float] = field(default_factory=dict, compare=False)
    #: β multiplier by collective kind (measured seconds per wire byte / link β)
    collective_beta_scale: Mapping[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise UsageError(f"unknown all-reduce algorithm {self.algorithm!r}; valid: "
                             f"{', '.join(ALGORITHMS)}")
        if self.algorithm == "hierarchical" and (self.intra is None or self.gpus_per_node < 1):
            raise UsageError("hierarchical all-reduce needs an intra-node link and gpus_per_node")

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

    def with_calibration(self, alpha: Mapping[str, float], beta_scale: Mapping[str, float],
                         **kw: Any) -> NetworkModel:
        """A copy with per-collective α and β scale (see module docstring)."""
        return replace(self, collective_alpha=dict(alpha), collective_beta_scale=dict(beta_scale), **kw)

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
        if self.collective_alpha:
            d["collective_alpha_s"] = dict(self.collective_alpha)
        if self.collective_beta_scale:
            d["collective_beta_scale"] = dict(self.collective_beta_scale)
        if self.algorithm == "hierarchical" and self.intra is not None:
            d.update(intra_alpha_s=self.intra.alpha_s,
                     intra_bandwidth_bits_per_s=self.intra.bandwidth_bits_per_s,
                     gpus_per_node=self.gpus_per_node)
        return d

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, nbytes: float, p: int) -> float:
        """Seconds of an all-reduce of ``nbytes`` among ``p`` workers (ring, tree or hierarchical)."""
        if p <= 1:
            return 0.0
        if self.algorithm == "tree":
            return 2 * math.ceil(math.log2(p)) * self.alpha_s + 2 * nbytes * self.beta_s_per_byte
        if self.algorithm == "hierarchical":
            return self._hierarchical_all_reduce(nbytes, p)
        return ring_all_reduce(Link(self.alpha_for("all_reduce"), self.beta_for("all_reduce")), nbytes, p)

    def _hierarchical_all_reduce(self, nbytes: float, p: int) -> float:
        assert self.intra is not None
        g = min(self.gpus_per_node, p)
        nodes = math.ceil(p / g)
        t = 0.0
        if g > 1:  # reduce-scatter + all-gather inside the node
            t += 2 * ((g - 1) * self.intra.alpha_s + (g - 1) / g * nbytes * self.intra.beta_s_per_byte)
        return t + ring_all_reduce(self.inter, nbytes / g, nodes)

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


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)(?:/s)?\s*$", re.I)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """``"500mbit"`` -> 5e8 bits/s."""
    m = _RATE.match(text)
    if not m:
        raise UsageError(f"bad network rate {text!r}; use e.g. 100mbit, 1gbit, 10gbit")
    rate = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"network rate must be a finite number > 0, got {text!r}")
    return rate


def _parse_seconds(key: str, text: str) -> float:
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*$", text)
    if not m:
        raise UsageError(f"bad {key}={text!r}; use e.g. {key}=0.5ms or {key}=20us")
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2)]
    return float(m.group(1)) * unit


def parse_network(spec: str) -> NetworkModel:
    """Parse ``--net``: ``PRESET|RATE[,delay=MS][,alpha=T][,algo=ring|tree][,intra=PRESET,gpus_per_node=G]``.

    ``delay`` is a one-way delay as given to ``tc netem`` (the emulated cluster's flag) and
    becomes α; ``alpha`` sets α directly. ``intra=`` with ``gpus_per_node=`` switches to the
    hierarchical all-reduce.
    """
    head, *opts = [s.strip() for s in spec.split(",") if s.strip()] or [""]
    if not head:
        raise UsageError("empty --net; valid presets: " + ", ".join(PRESETS))
    key = PRESET_ALIASES.get(head.lower(), head.lower())
    if key in PRESETS:
        link = PRESETS[key]
    else:
        link = _link(parse_rate(head), 50e-6)
    algo, intra, gpn = "ring", None, 1
    for opt in opts:
        k, sep, v = (s.strip() for s in opt.partition("="))
        if not sep:
            raise UsageError(f"network option {opt!r} must look like key=value")
        if k in ("delay", "alpha"):
            link = replace(link, alpha_s=_parse_seconds(k, v))
        elif k == "algo":
            algo = v
        elif k == "intra":
            intra = NetworkModel.preset(v).inter
        elif k == "gpus_per_node":
            try:
                gpn = int(v)
            except ValueError:
                raise UsageError(f"gpus_per_node must be an integer, got {v!r}") from None
        else:
            raise UsageError(f"unknown network option {k!r}; valid: delay, alpha, algo, intra, "
                             "gpus_per_node")
    if gpn < 1:
        raise UsageError(f"gpus_per_node must be >= 1, got {gpn}")
    if intra is not None and algo == "ring":
        algo = "hierarchical"
        if gpn < 2:
            gpn = 8
    return NetworkModel(inter=link, algorithm=algo, intra=intra, gpus_per_node=gpn, name=spec)

"""The ``hier`` method in the simulator: fused groups whose all-reduce runs hierarchically.

Why its own schedule: on a two-level topology (nodes of G workers, a slow link between nodes)
the same bytes cost very different times flat or hierarchical
(:meth:`lowcomm.sim.network.NetworkModel.hierarchical_all_reduce`), and the method chooses
per fused group: ``mode=hier`` always hierarchical, ``mode=flat`` always the ring over all
workers, ``mode=hybrid`` whichever the α-β model says is faster for that group's size (what
the training method decides from the same model; with the method's link costs pinned,
``alpha_intra=...,beta_inter=...``, its own rule, :func:`lowcomm.comm.hierarchical.choose`,
decides). The groups are the engine's: consecutive
layers in forward order, a group closed once it holds ``threshold_mb``, each all-reduced as
soon as its last gradient is ready. ``compress=`` carries a sum-compatible codec whose
all-reduce rounds run the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowcomm.sim.schedules.base import MIB, Bucket, Sim, layer_buckets
from lowcomm.sim.schedules.codec import CodecPlan
from lowcomm.sim.schedules.ddp import BucketSchedule
from lowcomm.sim.schedules.engine import forward_groups
from lowcomm.sim.timeline import Task

#: the method's pinned link costs (all four, or the rule is the network model's)
COST_KEYS = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter")
#: the method's ``mode`` -> the network model's all-reduce algorithm
ALGORITHM_OF_MODE = {"hier": "hierarchical", "hierarchical": "hierarchical", "flat": "flat", "hybrid": "hybrid"}


@dataclass
class HierOptions:
    """The options the simulator reads when the method registry has no ``hier``."""

    mode: str = "hier"
    threshold_mb: float = 25.0


class Hier(BucketSchedule):
    """Engine groups of ``threshold_mb``; each group's all-reduce flat, hierarchical or hybrid."""

    name = "hier"
    Options = HierOptions
    decode_after_backward = True
    summary = "hierarchical all-reduce per fused group (intra reduce-scatter, inter all-reduce, intra all-gather)"
    caveat = "same updates as ssgd (scheduling only)."
    exact = True

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, codec)
        mode = str(self.opt("mode", "hier")).lower()
        self.algorithm = ALGORITHM_OF_MODE.get(mode, "hierarchical")

    def setup(self, sim: Sim) -> None:
        """Groups of ``threshold_mb`` in forward order (0: one group per layer)."""
        threshold = float(self.opt("threshold_mb", 25.0))
        self.buckets = layer_buckets(sim, forward_groups(sim, threshold * MIB))
        self.arrivals = []

    def algorithm_for(self, sim: Sim, nbytes: int) -> str:
        """The algorithm of one group's all-reduce: the mode's; for ``hybrid`` with pinned link
        costs the training method's own choice, else the network model's (``hybrid``)."""
        costs = [self.opt(k, None) for k in COST_KEYS]
        lv = sim.net.levels(sim.p)
        if self.algorithm != "hybrid" or lv is None or any(c is None for c in costs):
            return self.algorithm
        from lowcomm.comm.hierarchical import LinkCosts, choose
        from lowcomm.comm.topology import Topology

        pick = choose(nbytes, Topology(sim.p, lv[1], 0), LinkCosts.pinned(*costs), "hybrid")
        return "hierarchical" if pick == "hier" else "flat"

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task) -> Task | None:
        """The group's all-reduce with the mode's algorithm (or the codec's rounds, whose
        all-reduces take the same algorithm)."""
        algorithm = self.algorithm_for(sim, b.numel * sim.bpe)
        if self.codec is None:
            return sim.collective(f"ar.b{b.index}", "all_reduce", b.numel * sim.bpe, it,
                                  after=[ready], algorithm=algorithm)
        task, cost = self.codec.hook(sim, it, b, ready, defer=True, algorithm=algorithm)
        self.arrivals.append((b, cost, task))
        return task

"""``--method hier``: the engine's fused groups all-reduced hierarchically on multi-GPU nodes.

Why a schedule: Jia et al. (2018) fuse gradients into buffers and all-reduce each one either
flat or hierarchically (intra-node reduce-scatter, inter-node all-reduce among same-local-rank
peers, intra-node all-gather), chosen per buffer size. The scheduling engine already fuses
and overlaps with backward; this method hands it a
:class:`~lowcomm.comm.hierarchical.HierarchicalReducer` for the all-reduces
(:mod:`lowcomm.comm.hierarchical` has the algorithm, the byte formulas and the hybrid rule).
``compress=`` carries ``SUM`` codecs (their all-reduce messages, non-final ones included, go
through the reducer); ``GATHER`` codecs are refused (:func:`~lowcomm.sched.pairing.sum_only_refusal`).

The topology is the process's (``--gpus-per-node`` / torchrun's ``LOCAL_WORLD_SIZE``, as the
accounting layer uses it); on one node, or with a process group other than the world, the
method runs the engine's plain all-reduce (and says so in ``describe()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.comm.hierarchical import MODES as HIER_MODES
from lowcomm.comm.hierarchical import HierarchicalReducer, LinkCosts, probe_link_costs
from lowcomm.comm.topology import Topology
from lowcomm.errors import UsageError, check_positive
from lowcomm.methods import register
from lowcomm.methods.base import MethodContext
from lowcomm.methods.schedules import EngineFields, EngineMethod
from lowcomm.sched.engine import Engine, Mode
from lowcomm.sched.groups import fuse_by_threshold
from lowcomm.sched.options import chosen_codec, with_codec_options
from lowcomm.sched.pairing import sum_only_refusal
from lowcomm.sched.tune import MB


@dataclass
class HierOptions(EngineFields):
    """hier: fused groups all-reduced hierarchically (intra-node reduce-scatter, inter-node
    all-reduce, intra-node all-gather; :mod:`lowcomm.comm.hierarchical`). ``mode=hybrid``
    picks flat or hierarchical per group from the α-β model of both links (probed at
    start-up unless all four of ``alpha_intra``, ``beta_intra``, ``alpha_inter``,
    ``beta_inter`` are given: seconds per collective, seconds per byte a worker sends);
    ``mode=flat`` is plain WFBP with the same fusion (a baseline)."""

    mode: str = "hier"
    threshold_mb: float = 25.0  # fusion buffer size, as DDP's buckets; 0 = one group per layer
    alpha_intra: float | None = None
    beta_intra: float | None = None
    alpha_inter: float | None = None
    beta_inter: float | None = None

    def __post_init__(self) -> None:
        self.mode = str(self.mode).strip().lower()
        if self.mode not in HIER_MODES:
            raise UsageError(f"hier: unknown mode {self.mode!r}; valid: {', '.join(HIER_MODES)}")
        check_positive("hier: threshold_mb", self.threshold_mb, allow_zero=True)
        costs = [getattr(self, k) for k in COST_KEYS]
        if any(v is None for v in costs) and any(v is not None for v in costs):
            raise UsageError(f"hier: give all of {', '.join(COST_KEYS)}, or none (then they are probed)")
        for k, v in zip(COST_KEYS, costs):
            if v is not None:
                check_positive(f"hier: {k}", v, allow_zero=True)
        codec = chosen_codec(self)
        refusal = None if codec is None else sum_only_refusal("hier", codec)
        if refusal is not None:
            raise UsageError(refusal)


COST_KEYS = ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter")


@register
class Hier(EngineMethod):
    """Hierarchical (or hybrid) all-reduce of fused groups over multi-GPU nodes (Jia et al. 2018)."""

    name = "hier"
    mode = Mode.ALLREDUCE
    sums_only = True  # only SUM codecs: see lowcomm.sched.pairing.sum_only_refusal
    Options = with_codec_options(name, mode, HierOptions)

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.topology: Topology | None = None
        self.costs: LinkCosts | None = None
        self.reducer: HierarchicalReducer | None = None

    def make_reducer(self, model: nn.Module, ctx: MethodContext) -> Any:
        """The topology (``--gpus-per-node`` / ``LOCAL_WORLD_SIZE``, as the ledger uses it), the
        link costs (pinned, kept from a checkpoint or a previous wrap, else probed: collective)
        and a :class:`~lowcomm.comm.hierarchical.HierarchicalReducer`; None on one node or with
        ``mode=flat`` (the engine's plain all-reduce)."""
        if not dist.is_initialized() or ctx.process_group is not None:
            return None  # the scoped groups are subgroups of the world
        topo = accounting.topology() or Topology.from_env()
        self.topology = topo
        o = self.options
        if o.mode == "flat" or not topo.hierarchical:
            return None
        pending = self._pending_state or {}
        if o.alpha_intra is not None:
            self.costs = LinkCosts.pinned(o.alpha_intra, o.beta_intra, o.alpha_inter, o.beta_inter)
        elif self.costs is None and "link_costs" in pending:
            c = pending["link_costs"]
            self.costs = LinkCosts.pinned(c["alpha_intra"], c["beta_intra"], c["alpha_inter"], c["beta_inter"])
        if self.reducer is not None:
            self.reducer.close()
        if o.mode == "hybrid" and self.costs is None:
            self.costs = probe_link_costs(topo, device=ctx.device, tag=f"{self.name}.probe")
        self.reducer = HierarchicalReducer(topo, mode=o.mode, costs=self.costs, group=ctx.process_group)
        return self.reducer

    def setup(self, engine: Engine) -> None:
        """Fuse by ``threshold_mb`` (the groups the all-reduces carry)."""
        engine.set_grouping(fuse_by_threshold(engine.units, float(self.options.threshold_mb) * MB))

    def state_dict(self) -> dict[str, Any]:
        """Adds the link costs: a resumed hybrid run makes the same choices without probing."""
        d = super().state_dict()
        if self.costs is not None:
            d["link_costs"] = {"alpha_intra": self.costs.intra.alpha, "beta_intra": self.costs.intra.beta,
                               "alpha_inter": self.costs.inter.alpha, "beta_inter": self.costs.inter.beta}
        return d

    def describe(self) -> dict[str, Any]:
        """Adds the topology, the mode and the per-group choices."""
        d = super().describe()
        if self.topology is not None:
            d.update(nodes=self.topology.nodes, gpus_per_node=self.topology.local_size,
                     hierarchical=self.reducer is not None)
        if self.reducer is not None:
            d.update(self.reducer.describe())
        return d

"""Communication scheduling engine: WFBP, MG-WFBP, DeAR and Lee et al. 2018 shard updates.

See ``docs/scheduling.md``. The ``--method`` entries live in :mod:`lowcomm.sched.methods`.
"""

from __future__ import annotations

from lowcomm.sched.cost import AlphaBeta, plan_mgwfbp, probe_alpha_beta
from lowcomm.sched.engine import Engine, Mode, ScheduledModule
from lowcomm.sched.groups import collect_units, fuse_by_threshold
from lowcomm.sched.lowrank import LowRankCodec

__all__ = [
    "AlphaBeta",
    "Engine",
    "LowRankCodec",
    "Mode",
    "ScheduledModule",
    "collect_units",
    "fuse_by_threshold",
    "plan_mgwfbp",
    "probe_alpha_beta",
]

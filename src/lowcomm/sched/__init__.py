"""Communication scheduling engine: WFBP, MG-WFBP, DeAR and Lee et al. 2018 shard updates.

See ``docs/scheduling.md``. The ``--method`` entries live in :mod:`lowcomm.methods.schedules`;
which compressor each schedule carries: :func:`lowcomm.sched.pairing.pairing_refusal`.
"""

from __future__ import annotations

from lowcomm.sched.cost import AlphaBeta, plan_mgwfbp, probe_alpha_beta
from lowcomm.sched.engine import Engine, Mode
from lowcomm.sched.module import ScheduledModule
from lowcomm.sched.groups import collect_units, fuse_by_threshold
from lowcomm.sched.pairing import pairing_refusal

__all__ = [
    "AlphaBeta",
    "Engine",
    "Mode",
    "ScheduledModule",
    "collect_units",
    "fuse_by_threshold",
    "pairing_refusal",
    "plan_mgwfbp",
    "probe_alpha_beta",
]

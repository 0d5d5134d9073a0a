"""Distributed K-FAC (KAISA's API, SPD-KFAC's pipelined communication and balanced placement).

Modules, one job each: :mod:`.layers` (factor math per layer type), :mod:`.factors` (running
averages, symmetric packing), :mod:`.inverse` (eigen/inverse decompositions, KL clipping),
:mod:`.placement` (which rank decomposes which factor), :mod:`.comm` (the counted
collectives), :mod:`.fusion` (SPD-KFAC's α-β merge rule, profiling), :mod:`.pipeline` (how
the hooks' statistics travel), :mod:`.rounds` (a factor step from launch to fold),
:mod:`.options` (hyperparameter checks),
:mod:`.preconditioner` (:class:`KFAC`). User guide: ``docs/kfac.md``.
"""

from __future__ import annotations

from lowcomm.optim.kfac.preconditioner import KFAC

__all__ = ["KFAC"]

"""Pipelined factor communication: what the hooks send, and when it gets merged.

Why a module: the hooks only say "this factor is ready"; this class decides how it travels.
Before a plan exists every factor is its own async all-reduce. During a window of factor
steps (by default the 2nd to the 6th: the first runs allocator and connection warm-up) the
ready times are profiled; then ``α`` and ``β`` are probed once and SPD-KFAC's merge rule
(:func:`~lowcomm.optim.kfac.fusion.merge_groups`) fixes the groups for the rest of the run.
Merging changes only how numbers travel: the same bytes are counted, one ``α`` fewer per
merged factor.
"""

from __future__ import annotations

import torch

from lowcomm.optim.kfac.comm import FactorComm
from lowcomm.optim.kfac.factors import pack
from lowcomm.optim.kfac.fusion import CostModel, Flight, Fuser, Profile, merge_groups, probe_cost


class Pipeline:
    """Sends the hooks' statistics, alone or grouped once the plan exists."""

    def __init__(self, comm: FactorComm, sizes: dict[tuple[str, int], int], device: torch.device,
                 window: tuple[int, int] = (1, 5)) -> None:
        self.comm = comm
        self.sizes = sizes  # (kind, layer index) -> packed numel
        self.device = device
        self.window = window  # (first profiled factor step, number profiled)
        self.factor_steps = 0
        self.profile = Profile(device) if comm.world_size > 1 else None
        self.fuser: Fuser | None = None
        self.cost: CostModel | None = None
        #: a known cost model (e.g. the paper's α = 9.29e-4 s, β = 1.4335e-9 s per number)
        #: to use instead of probing
        self.fixed_cost: CostModel | None = None

    @property
    def groups(self) -> dict[str, list[list[int]]] | None:
        """The merge plan (kind -> groups of layer indices in hook order), once made."""
        return None if self.fuser is None else self.fuser.groups

    @property
    def profiling(self) -> bool:
        """Whether the current factor step's ready times are being profiled (then its
        all-reduces are waited for in its own ``step()``: the plan's probe must not queue
        behind them)."""
        start, count = self.window
        return (self.fuser is None and self.profile is not None and count > 0
                and start <= self.factor_steps < start + count)

    def send(self, kind: str, layer: int, stat: torch.Tensor) -> list[tuple[int, Flight]]:
        """Pack a ready statistic and send it, or hold it for its group (called in a hook:
        no host reads). Returns the (layer index, flight) pairs launched now."""
        flat = pack(stat, self.comm.symmetric, copy=False)  # the hook's statistic, handed over
        if self.profiling:
            assert self.profile is not None
            self.profile.mark(kind, layer)
        if self.fuser is not None and self.fuser.covers(kind, layer):
            return self.fuser.push(kind, layer, flat)
        return [(layer, Flight(flat, self.comm.start(flat, kind), 0, flat.numel()))]

    def flush(self) -> list[tuple[str, int, Flight]]:
        """Launch groups whose members did not all arrive (in ``step()``, on every rank)."""
        return self.fuser.flush() if self.fuser is not None else []

    def end_factor_step(self) -> None:
        """Called by ``step()`` after a factor step (same step on every rank): profile, and
        make the plan when the window closes (collective: probes and averages times)."""
        if self.profiling:
            assert self.profile is not None
            self.profile.close_step()
            if self.profile.steps == self.window[1]:
                self._plan()
        self.factor_steps += 1

    def state_dict(self) -> dict[str, object]:
        """Where the profiling stands and the plan, if made: a resumed run must send the
        factors in the same groups (on 3+ ranks the grouping changes the ring's summation
        order, so a re-profiled plan could change the last bits)."""
        cost = None if self.cost is None else [self.cost.alpha, self.cost.beta]
        return {"factor_steps": self.factor_steps, "groups": self.groups, "cost": cost}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`'s output (the plan, when one was made, is used as is)."""
        self.factor_steps = int(state.get("factor_steps", 0))  # type: ignore[call-overload]
        groups = state.get("groups")
        cost = state.get("cost")
        self.cost = CostModel(*cost) if isinstance(cost, (list, tuple)) else None
        if isinstance(groups, dict):
            plan = {str(kind): [[int(i) for i in g] for g in gs] for kind, gs in groups.items()}
            self.fuser = Fuser(plan, self.comm.start)

    def _plan(self) -> None:
        assert self.profile is not None
        self.cost = self.fixed_cost or probe_cost(self.comm.group, self.device)
        groups: dict[str, list[list[int]]] = {}
        for kind in ("A", "G"):
            order = self.profile.order[kind]
            ready = self.profile.ready_times(kind, self.comm.group, self.comm.world_size)
            sizes = [self.sizes[(kind, layer)] for layer in order]
            groups[kind] = [[order[i] for i in g] for g in merge_groups(sizes, ready, self.cost)]
        self.fuser = Fuser(groups, self.comm.start)

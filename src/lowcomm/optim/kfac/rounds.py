"""One factor step's statistics, from the all-reduce's launch to the fold into the factors.

Why deferred: a running factor is read only when it is decomposed (every
``inv_update_steps``), so the all-reduce of a factor step that is not also an inverse step
need not be waited for in that step. With ``defer_factor_comm`` the preconditioner keeps the
launched round and folds it into the running averages when a factor is next needed: at the
next factor step (before that step's own round, so the order of the averages is the same),
an inverse step, ``state_dict()`` or ``remove()``. The factors' traffic then overlaps the
preconditioning and the following steps' forward and backward, not only the backward it was
launched in. The result is bit for bit that of waiting at once: the same sums, folded in the
same order with the decay of the step that launched them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowcomm.optim.kfac.comm import Buckets, FactorComm
from lowcomm.optim.kfac.factors import LayerFactors, running_average
from lowcomm.optim.kfac.fusion import Flight
from lowcomm.optim.kfac.layers import KFACLayer

#: (layer index, "A" or "G")
Slot = tuple[int, str]


@dataclass
class FactorRound:
    """The all-reduces launched for one factor step, with that step's ``factor_decay``."""

    decay: float
    #: pipelined mode: each factor's flights (several when a layer ran twice), size, diagonal
    flights: dict[Slot, tuple[list[Flight], int, bool]] = field(default_factory=dict)
    #: baseline mode: the slots of each kind's bucketed all-reduce, in its order
    buckets: list[tuple[list[Slot], Buckets]] = field(default_factory=list)

    def empty(self) -> bool:
        """Whether nothing was launched (no statistics were collected this step)."""
        return not self.flights and not self.buckets

    def averaged(self, comm: FactorComm) -> dict[Slot, torch.Tensor]:
        """Wait for every all-reduce; each factor's statistic averaged over ranks (and over a
        layer's calls in the step, when it ran more than once)."""
        done: dict[Slot, torch.Tensor] = {}
        for slot, (flights, n, diagonal) in self.flights.items():
            stats = [comm.finish(f, n, diagonal) for f in flights]
            done[slot] = stats[0] if len(stats) == 1 else torch.stack(stats).mean(0)
        for slots, buckets in self.buckets:
            done.update(zip(slots, buckets.finish()))
        return done


def launch_round(layers: list[KFACLayer], factors: dict[str, LayerFactors], comm: FactorComm,
                 late: list[tuple[str, int, Flight]], decay: float) -> FactorRound | None:
    """Collect one factor step's all-reduces: the hooks' flights (pipelined; ``late`` are the
    groups ``step()`` had to send) and, for statistics still in the accumulators (baseline),
    one bucketed all-reduce per kind, launched now. None when the step collected nothing."""
    for kind, i, flight in late:
        st = factors[layers[i].name]
        (st.a_flight if kind == "A" else st.g_flight).append(flight)
    launched = FactorRound(decay)
    left: dict[str, list[tuple[Slot, torch.Tensor, int, bool]]] = {"A": [], "G": []}
    for i, layer in enumerate(layers):
        st = factors[layer.name]
        for kind, flights, acc, n, diag in (
            ("A", st.a_flight, st.a_acc, layer.a_dim, layer.a_diagonal),
            ("G", st.g_flight, st.g_acc, layer.g_dim, False),
        ):
            if flights:
                launched.flights[(i, kind)] = (list(flights), n, diag)
                flights.clear()
            elif acc.count:
                mean = acc.mean()
                assert mean is not None
                left[kind].append(((i, kind), mean, n, diag))
            acc.clear()
    for kind, items in left.items():
        if items:
            buckets = comm.launch_all([(s, n, d) for _, s, n, d in items], kind)
            launched.buckets.append(([slot for slot, *_ in items], buckets))
    return None if launched.empty() else launched


def fold_round(launched: FactorRound, layers: list[KFACLayer], factors: dict[str, LayerFactors],
               comm: FactorComm) -> list[KFACLayer]:
    """Wait for ``launched`` and fold it into the running factors; the layers whose hooks
    did not both fire in that step (left unchanged)."""
    done = launched.averaged(comm)
    silent = []
    for i, layer in enumerate(layers):
        st = factors[layer.name]
        a, g = done.get((i, "A")), done.get((i, "G"))
        if a is None or g is None:
            silent.append(layer)
            continue
        # a non-finite statistic (an overflowing AMP step, a diverging batch the trainer
        # skips) must not poison the running factor for good: decided on the device
        st.a = running_average(st.a, a, launched.decay, True)
        st.g = running_average(st.g, g, launched.decay, True)
    return silent

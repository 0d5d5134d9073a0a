"""SPD-KFAC's dynamic fusion: merge small factors' all-reduces by an α-β cost model.

Why: in pipelined mode each factor's all-reduce starts as soon as its hook computed it. A
small factor pays the start-up cost ``α`` of a message for few bytes; merging it with the
next factor saves an ``α`` but delays its own transfer until that factor is ready. SPD-KFAC
(Shi, Zhang, Li, ICDCS'21) decides per pair, in readiness order, with the model
``t(n) = α + β·n``: the current group is merged with the next factor when its all-reduce could
not start before that factor is ready anyway (the link is still busy), or when the wait for
it is shorter than the ``α`` a separate message would cost.

Inputs, measured once: ``α``, ``β`` by timing all-reduces of two sizes on K-FAC's group; each
factor's ready time (from the first hook of its kind) averaged over a few profiled factor
steps. Both are averaged over ranks before the plan is made, so every rank derives the same
groups (collectives must match). A group whose members did not all arrive in the hooks is
sent by ``step()`` (same order on every rank), so a missing hook costs overlap, not a hang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lowcomm.comm import accounting


@dataclass(frozen=True)
class CostModel:
    """All-reduce time ``α + β·n`` for ``n`` float32 numbers (seconds)."""

    alpha: float
    beta: float

    def time(self, numel: float) -> float:
        """Predicted seconds of one all-reduce of ``numel`` numbers."""
        return self.alpha + self.beta * numel


def merge_groups(sizes: Sequence[int], ready: Sequence[float], cost: CostModel) -> list[list[int]]:
    """Groups of consecutive factor positions (readiness order), by SPD-KFAC's rule.

    ``sizes[i]`` is the packed numel of the ``i``-th factor to become ready, ``ready[i]`` its
    ready time. The current group's all-reduce would start at ``max(link free, its last
    member ready)``; the next factor joins it when that start is after the factor's ready
    time, or when waiting for it costs less than ``α``.
    """
    if not sizes:
        return []
    groups: list[list[int]] = [[0]]
    total = sizes[0]
    link_free = 0.0
    for i in range(1, len(sizes)):
        start = max(link_free, ready[i - 1])
        if start > ready[i] or ready[i] - start < cost.alpha:
            groups[-1].append(i)
            total += sizes[i]
            continue
        link_free = start + cost.time(total)
        groups.append([i])
        total = sizes[i]
    return groups


def probe_cost(group: Any, device: torch.device, *, small: int = 16, large: int = 1 << 16,
               repeats: int = 3) -> CostModel:
    """``α`` and ``β`` from the median time of all-reduces of two sizes, averaged over ranks
    (collective: every rank must call it; traffic counted under ``kfac.probe``)."""
    def median_time(n: int) -> float:
        buf = torch.zeros(n, dtype=torch.float32, device=device)
        times = []
        for _ in range(repeats + 1):  # the first one warms the connection up
            _sync(device)
            t0 = time.perf_counter()
            accounting.all_reduce(buf, group=group, tag="kfac.probe")
            _sync(device)
            times.append(time.perf_counter() - t0)
        return sorted(times[1:])[len(times[1:]) // 2]

    t_small, t_large = median_time(small), median_time(large)
    beta = max(0.0, (t_large - t_small) / (large - small))
    both = torch.tensor([max(0.0, t_small - beta * small), beta], dtype=torch.float64, device=device)
    accounting.all_reduce(both, group=group, tag="kfac.probe")
    world = torch.distributed.get_world_size(group)
    alpha, beta = (both / world).tolist()
    return CostModel(alpha, beta)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Profile:
    """Ready times of each kind's factors, in the order their hooks ran, over profiled steps.

    On CUDA a hook records an event (no host wait); the times are read in ``step()``.
    """

    device: torch.device
    marks: dict[str, list[tuple[int, Any]]] = field(default_factory=lambda: {"A": [], "G": []})
    sums: dict[str, dict[int, float]] = field(default_factory=lambda: {"A": {}, "G": {}})
    order: dict[str, list[int]] = field(default_factory=lambda: {"A": [], "G": []})
    steps: int = 0

    def mark(self, kind: str, layer: int) -> None:
        """A factor of ``kind`` for ``layer`` is packed and ready (called in a hook)."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[kind].append((layer, ev))
        else:
            self.marks[kind].append((layer, time.perf_counter()))

    def close_step(self) -> None:
        """Fold this step's marks into the sums (in ``step()``: events may be waited on)."""
        for kind, marks in self.marks.items():
            if not marks:
                continue
            if self.device.type == "cuda":
                marks[-1][1].synchronize()
                times = [marks[0][1].elapsed_time(ev) / 1e3 for _, ev in marks]
            else:
                times = [t - marks[0][1] for _, t in marks]
            self.order[kind] = [layer for layer, _ in marks]
            for (layer, _), t in zip(marks, times):
                self.sums[kind][layer] = self.sums[kind].get(layer, 0.0) + t
            marks.clear()
        self.steps += 1

    def ready_times(self, kind: str, group: Any, world: int) -> list[float]:
        """Mean ready time per factor of ``kind`` in hook order, averaged over ranks
        (collective; the hook order is the same on every rank)."""
        order = self.order[kind]
        mine = [self.sums[kind].get(layer, 0.0) / max(1, self.steps) for layer in order]
        if world > 1 and mine:
            t = torch.tensor(mine, dtype=torch.float64, device=self.device)
            accounting.all_reduce(t, group=group, tag="kfac.probe")
            return (t / world).tolist()
        return mine


@dataclass
class Flight:
    """One member's slice of an all-reduce in progress (the buffer may hold a whole group)."""

    buf: torch.Tensor
    work: Any
    offset: int
    numel: int

    def wait(self) -> torch.Tensor:
        """The summed member slice, once the all-reduce is done."""
        if self.work is not None:
            self.work.wait()
        return self.buf[self.offset: self.offset + self.numel]


class Fuser:
    """Holds packed factors until their group is complete, then starts one all-reduce."""

    def __init__(self, groups: dict[str, list[list[int]]], launch: Any) -> None:
        self.groups = groups
        self._launch = launch  # (flat, kind) -> work
        self._where = {(kind, layer): gi for kind, gs in groups.items() for gi, g in enumerate(gs) for layer in g}
        self._pending: dict[tuple[str, int], dict[int, torch.Tensor]] = {}

    def covers(self, kind: str, layer: int) -> bool:
        """Whether ``layer``'s factor of ``kind`` belongs to a planned group."""
        return (kind, layer) in self._where

    def push(self, kind: str, layer: int, flat: torch.Tensor) -> list[tuple[int, Flight]]:
        """Add a packed factor; when its group is complete, launch it and return the flights."""
        gi = self._where[(kind, layer)]
        out: list[tuple[int, Flight]] = []
        if layer in self._pending.get((kind, gi), {}):  # called twice (weight sharing): send
            out = self._send(kind, gi)
        pending = self._pending.setdefault((kind, gi), {})
        pending[layer] = flat
        if len(pending) < len(self.groups[kind][gi]):
            return out
        return out + self._send(kind, gi)

    def _send(self, kind: str, gi: int) -> list[tuple[int, Flight]]:
        pending = self._pending.pop((kind, gi))
        members = [m for m in self.groups[kind][gi] if m in pending]
        buf = torch.cat([pending[m] for m in members]) if len(members) > 1 else pending[members[0]]
        work = self._launch(buf, kind)
        out, offset = [], 0
        for m in members:
            n = pending[m].numel()
            out.append((m, Flight(buf, work, offset, n)))
            offset += n
        return out

    def flush(self) -> list[tuple[str, int, Flight]]:
        """Launch the incomplete groups (in plan order, the same on every rank)."""
        out: list[tuple[str, int, Flight]] = []
        for kind, gs in self.groups.items():
            for gi in range(len(gs)):
                if (kind, gi) in self._pending:
                    out.extend((kind, m, f) for m, f in self._send(kind, gi))
        return out

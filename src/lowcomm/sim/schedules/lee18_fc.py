"""``lee18`` with its ``fc=`` option in the simulator: model-parallel FC layers beside the shards.

Why a subclass that wraps :class:`~lowcomm.sim.schedules.base.Sim` instead of edits in
:mod:`.engine`: lee18's own schedule (groups, reduce-scatters, shard update, all-gathers,
per-layer update) stays where it is; a model-parallel layer only changes what happens around
that layer's forward and backward, which :class:`_ModelParallelSim` inserts whenever the
schedule asks ``sim`` for them. Per model-parallel layer (``n`` = the profile's batch per
worker, the traffic :func:`lowcomm.parallel.fc.model_parallel_bytes` counts):

* forward: all-gather of the ``n x in`` inputs after the previous layer's forward, the
  layer's forward (the same FLOPs: ``P n`` rows times ``out / P`` neurons), then the
  all-to-all of the outputs, which the next layer's forward waits for;
* backward: the all-to-all of the errors after the next layer's backward, the layer's
  backward, then the reduce-scatter of the input gradient (skipped for a first layer), which
  the previous layer's backward waits for.

The all-to-all is timed as a reduce-scatter of the same payload (both send ``(P-1)/P`` of it
per worker over the ring model). The layer joins no group (no gradient reduce-scatter, no
weight all-gather). Which Linear layers: a profile layer whose parameters are one 2-D weight
(plus a bias of its rows), not an embedding by name, chosen as the method chooses
(:func:`lowcomm.parallel.lee18_fc` rules, ``fc_batch`` rows per worker for ``fc=auto``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lowcomm.parallel.fc import choose_model_parallel
from lowcomm.sim.profile import LayerProfile, Profile
from lowcomm.sim.schedules.base import Sim
from lowcomm.sim.schedules.lee18 import Lee18
from lowcomm.sim.timeline import Task


def linear_shape(layer: LayerProfile) -> tuple[int, int, bool] | None:
    """``(in, out, bias)`` when the profiled layer looks like an ``nn.Linear``, else None."""
    shapes = [list(s) for s in layer.param_shapes]
    if not shapes or len(shapes[0]) != 2 or "emb" in layer.name.lower():
        return None
    out_f, in_f = shapes[0]
    if len(shapes) == 1:
        return in_f, out_f, False
    if len(shapes) == 2 and shapes[1] == [out_f]:
        return in_f, out_f, True
    return None


def model_parallel_layers(profile: Profile, workers: int, fc: str, fc_batch: int) -> list[int]:
    """Indices of the layers ``lee18:fc=<fc>`` runs model-parallel on ``workers`` ranks."""
    from lowcomm.parallel.lee18_fc import AUTO_COST

    if fc == "data_parallel" or workers < 2:
        return []
    out = []
    for i, layer in enumerate(profile.layers):
        shape = linear_shape(layer)
        if shape is None or shape[1] % workers:
            continue
        in_f, out_f, bias = shape
        if fc == "auto" and not choose_model_parallel(
            in_f, out_f, fc_batch, workers, AUTO_COST, bias=bias
        ):
            continue
        out.append(i)
    if out and len(out) == sum(1 for layer in profile.layers if layer.numel > 0):
        out.pop()  # the engine needs one data-parallel layer, as in training
    return out


class _ModelParallelSim:
    """A :class:`Sim` whose model-parallel layers exchange activations and errors (module doc)."""

    def __init__(self, sim: Sim, layers: list[int]) -> None:
        self._sim = sim
        self._mp = set(layers)
        first = min((i for i, layer in enumerate(sim.profile.layers) if layer.numel > 0), default=0)
        self._needs_input_grad = {i: i > first for i in layers}
        self._last: Task | None = None  # the previous forward/backward compute task
        self._pending: Task | None = None  # an exchange the next layer waits for

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)

    def _rows_bytes(self, features: int) -> int:
        s = self._sim
        return s.profile.batch_size * features * s.bpe

    def forward_layer(self, i: int, it: int, after: Iterable[Task | None] = ()) -> Task:
        """Layer ``i``'s forward; a model-parallel one between its all-gather and all-to-all."""
        s = self._sim
        deps = [*after, self._pending]
        self._pending = None
        shape = linear_shape(s.profile.layers[i]) if i in self._mp else None
        if shape is None:
            task = s.forward_layer(i, it, after=deps)
        else:
            in_f, out_f, _ = shape
            ag = s.collective(
                f"fc.ag.{i}", "all_gather", self._rows_bytes(in_f), it, after=[*deps, self._last]
            )
            task = s.forward_layer(i, it, after=[ag])
            self._pending = s.collective(
                f"fc.a2a.{i}", "reduce_scatter", self._rows_bytes(out_f), it, after=[task]
            )
        self._last = task
        return task

    def backward_layer(self, i: int, it: int) -> Task:
        """Layer ``i``'s backward; a model-parallel one between its all-to-all and reduce-scatter."""
        s = self._sim
        shape = linear_shape(s.profile.layers[i]) if i in self._mp else None
        deps = [self._pending]
        self._pending = None
        if shape is not None:  # the errors of this rank's neurons arrive first
            deps = [s.collective(f"fc.a2a_bwd.{i}", "reduce_scatter", self._rows_bytes(shape[1]), it,
                                 after=[*deps, self._last])]
        task = s.tl.add(f"bwd.{i}", "compute", s.profile.layers[i].backward_s, kind="backward",
                        iteration=it, after=deps)
        if shape is not None and self._needs_input_grad[i]:
            self._pending = s.collective(
                f"fc.rs.{i}", "reduce_scatter", s.p * self._rows_bytes(shape[0]), it, after=[task]
            )
        self._last = task
        return task


class Lee18FC(Lee18):
    """lee18 with ``fc=model_parallel|data_parallel|auto`` (module docstring)."""

    summary = Lee18.summary + "; Linear layers model-parallel where that moves fewer bytes (fc=)"

    def setup(self, sim: Sim) -> None:
        """Pick the model-parallel layers, then lee18's groups without them."""
        self.mp_layers = model_parallel_layers(
            sim.profile, sim.p, str(self.opt("fc", "auto")),
            int(self.opt("fc_batch", sim.profile.batch_size or 64)),  # as the method: the run's batch
        )
        super().setup(sim)

    def group_plan(self, sim: Sim) -> list[list[int]]:
        """lee18's groups, less the model-parallel layers (their weights are never averaged)."""
        mp = set(getattr(self, "mp_layers", []))
        return [
            g for g in ([i for i in group if i not in mp] for group in super().group_plan(sim)) if g
        ]

    def after_reduce_scatter(self, sim: Sim, it: int, sync: Task) -> None:
        """The model-parallel layers' update (this rank's rows: 1/P of them), then lee18's step."""
        if self.mp_layers:
            share = sum(sim.profile.layers[i].numel for i in self.mp_layers) / max(
                sim.profile.numel, 1
            )
            sync = sim.compute(
                "upd.fc",
                sim.optimizer_s * share / sim.p,
                it + 1,
                kind="optimizer",
                after=[sync],
            )
        super().after_reduce_scatter(sim, it, sync)

    def iteration(self, sim: Sim, it: int) -> None:
        """lee18's iteration, with the model-parallel layers' exchanges inserted."""
        if not self.mp_layers:
            super().iteration(sim, it)
            return
        super().iteration(_ModelParallelSim(sim, self.mp_layers), it)  # type: ignore[arg-type]

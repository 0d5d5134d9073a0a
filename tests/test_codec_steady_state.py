"""Codecs timed outside training are timed in training's steady state.

Why: the simulator prices compression with :func:`lowcomm.sim.profiler.measure_compressors`
and the kernel benchmark sets codecs against their bounds. Both used to time the low-rank
codecs' encode with empty factor tables, so every timed call redrew its starting factors on
the host, work a run does once; and the profiler timed codecs inside their warm-up.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.compress import lowrank
from lowcomm.compress.codec import CODECS, Layout, codec_class
from lowcomm.compress.steady import compressing, primed, step_offsets
from lowcomm.sim import profiler

SHAPES = [(64, 48), (48,), (32, 64)]


def _layout() -> Layout:
    names = [f"p{i}" for i in range(len(SHAPES))]
    return Layout.of(names, SHAPES, {n: i for i, n in enumerate(names)})


def _count_draws(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = lowrank.seeded_normal

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(lowrank, "seeded_normal", counting)
    return calls


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_a_primed_low_rank_codec_encodes_without_drawing_factors(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout()
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    finite = torch.ones((), dtype=torch.bool)
    draws = _count_draws(monkeypatch)
    for offset in step_offsets(codec_class(name)):
        codec = primed(codec_class(name)(world=4).as_trained(), x, layout, finite, 4, offset)
        assert codec.step == codec.start_iter + offset and codec.active
        before = draws[0]
        buf = x.clone()
        codec.accumulate(buf, layout, finite)
        codec.encode(buf, layout, finite)
        assert draws[0] == before, f"{name} step kind {offset} drew factors in a steady-state encode"


def test_a_fresh_codec_would_draw_them_which_is_what_priming_removes(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = _layout()
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    finite = torch.ones((), dtype=torch.bool)
    draws = _count_draws(monkeypatch)
    codec = compressing(codec_class("acpsgd")(world=4))
    codec.encode(x.clone(), layout, finite)
    assert draws[0] > 0


def test_only_acpsgd_cycles_through_two_step_kinds() -> None:
    assert {n: len(step_offsets(codec_class(n))) for n in CODECS.names() if len(step_offsets(codec_class(n))) != 1} \
        == {"acpsgd": 2}


def test_the_profiler_times_every_step_kind_of_a_primed_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int]] = []
    real = profiler.primed
    draws = _count_draws(monkeypatch)
    while_priming = [0]

    def spy(codec: Any, *args: Any, **kwargs: Any) -> Any:
        before = draws[0]
        out = real(codec, *args, **kwargs)
        while_priming[0] += draws[0] - before
        seen.append((codec.name, codec.step - codec.start_iter))
        return out

    monkeypatch.setattr(profiler, "primed", spy)
    profiler.measure_compressors("cpu", n=1 << 16, reps=1)  # a 1024 x 63 matrix: compressed at rank 4
    for name in CODECS.names():
        kinds = {o for n, o in seen if n == name}
        assert kinds == set(range(codec_class(name).step_cycle)), name
    assert draws[0] > 0 and draws[0] == while_priming[0]  # no timed call drew factors

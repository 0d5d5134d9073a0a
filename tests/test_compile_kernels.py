"""A codec's numba kernels are compiled before training, so no compressed step compiles one."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lowcomm.compress import native, warm
from lowcomm.compress.codec import CODECS, Codec, Layout, codec_class
from lowcomm.compress.steady import primed
from lowcomm.compress.warm import compile_kernels, warm_shapes

COMPILED = [n for n in CODECS.names() if codec_class(n).compiled_kernels]


def model() -> nn.Module:
    """Matrices of one shape twice (batched), a lone one, and vectors."""
    return nn.Sequential(nn.Conv2d(16, 16, 3), nn.Conv2d(16, 16, 3), nn.Linear(64, 40), nn.Linear(40, 10))


def signatures(codec_name: str) -> dict[str, int]:
    """Compiled signatures per kernel of the codec's numba modules."""
    out = {}
    for name in codec_class(codec_name).compiled_kernels:
        module = importlib.import_module(f"lowcomm.compress.{name}")
        for attr, value in vars(module).items():
            if hasattr(value, "signatures"):
                out[f"{name}.{attr}"] = len(value.signatures)
    return out


def tensors(obj: object) -> int:
    """How many tensors a (nested) state dict holds."""
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensors(v) for v in obj)
    return 0


def numba_present() -> bool:
    """Whether every compiled kernel module loads (numba, the ``fast`` extra ``make`` installs)."""
    return all(native.load(m) is not None for n in COMPILED for m in codec_class(n).compiled_kernels)


def test_the_codecs_with_compiled_cpu_paths_declare_their_kernel_modules() -> None:
    assert {"signsgd", "signum", "qsgd", "powersgd", "acpsgd"} <= set(COMPILED)


def test_warm_shapes_keep_each_distinct_shape_at_most_twice_in_order() -> None:
    assert warm_shapes([(3, 4), (5,), (3, 4), (3, 4), (0, 2), (5,)]) == [(3, 4), (5,), (3, 4), (5,)]


def compressed_steps(codec: Codec, net: nn.Module) -> None:
    """``codec``'s first compressed steps (each step kind, :func:`primed`) on ``net``'s gradient
    shapes in a bucket's order (backward's), as training runs them after the hook is set up."""
    shapes = [tuple(p.shape) for p in net.parameters()][::-1]
    names = [f"p{i}" for i in range(len(shapes))]
    layout = Layout.of(names, shapes, {n: i for i, n in enumerate(names)})
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(3))
    primed(codec, x, layout, torch.ones((), dtype=torch.bool), codec.world)


def _check_in_fresh_process() -> None:  # pragma: no cover - runs in the subprocess below
    """For every codec with compiled kernels: set up (compile), snapshot the kernels'
    signatures, run the compressed steps; print what the steps added."""
    added = {}
    for name in COMPILED:
        net = model()
        codec = codec_class(name)(world=4).as_trained()
        compile_kernels(codec, net.parameters())
        before = signatures(name)
        compressed_steps(codec, net)
        added[name] = {k: v - before.get(k, 0) for k, v in signatures(name).items() if v != before.get(k, 0)}
    print(json.dumps(added))


def test_after_the_setup_compiles_no_compressed_step_compiles_or_loads_a_kernel() -> None:
    """In a fresh process (in this one, other tests may have run the kernels already): a
    kernel first called inside a step would add a signature to its dispatcher there."""
    if not numba_present():  # (without the fast extra: nothing to compile, and nothing is)
        assert not any(compile_kernels(codec_class(n)(world=4), model().parameters()) for n in COMPILED)
        return
    code = "import test_compile_kernels as t; t._check_in_fresh_process()"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True,
                         text=True, timeout=600, check=True)
    added = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(added) == set(COMPILED)
    assert added == {name: {} for name in COMPILED}


def test_compiling_runs_once_per_configuration_on_a_blank_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "_WARMED", set())
    codec = codec_class("acpsgd")(world=4).as_trained()
    params = list(model().parameters())
    rng = torch.get_rng_state()
    if not numba_present():  # (without the fast extra: nothing to compile, and nothing is)
        assert not compile_kernels(codec, params)
        return
    assert compile_kernels(codec, params)
    assert codec.step == 0 and tensors(codec.state_dict()) == 0  # the copy did the work
    assert torch.equal(torch.get_rng_state(), rng)  # training's random stream untouched (exact resume)
    assert not compile_kernels(codec, model().parameters())
    other = codec_class("acpsgd")(world=4)  # without the velocity: other kernels
    assert compile_kernels(other, model().parameters())


def test_nothing_is_compiled_for_parameters_off_the_cpu_or_not_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "_WARMED", set())
    codec = codec_class("powersgd")(world=2)
    assert not compile_kernels(codec, model().to(torch.float64).parameters())
    assert not compile_kernels(codec_class("topk")(world=2), model().parameters())  # no compiled kernels


def test_nothing_is_compiled_for_a_run_that_ends_before_its_first_compressed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "_WARMED", set())
    cls = codec_class("powersgd")
    codec = cls(cls.Options(start_iter=5), world=2)
    codec.set_run(steps_per_epoch=None, total_steps=5)
    assert not codec.compresses and not compile_kernels(codec, model().parameters())
    codec.set_run(steps_per_epoch=None, total_steps=6)
    assert codec.compresses

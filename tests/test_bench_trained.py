"""What the bench's lower bound learns about each method: the model it trains, its codec."""

from __future__ import annotations

import math

import pytest

from lowcomm import methods
from lowcomm.bench import bounds
from lowcomm.bench.trained import codec_of, compute_reference, trained_shapes


@pytest.mark.parametrize("spec", ["ssgd", "nocomm", "dear", "topk:density=0.01", "wfbp:compress=powersgd,rank=4"])
def test_methods_that_keep_the_model_use_nocomm_as_their_compute(spec: str) -> None:
    assert compute_reference(spec) == "nocomm"


@pytest.mark.parametrize("spec", [
    "pufferfish",
    "pufferfish:rank_ratio=0.5,warmup_epochs=2,then=(topk:density=0.01)",
    "pufferfish:auto_switch=true,auto_rank=true,frob_decay=1e-4,full_rank=(conv1|fc)",
])
def test_pufferfish_compute_is_its_own_factorized_model_without_communication(spec: str) -> None:
    ref = compute_reference(spec)
    built = methods.create(ref)  # a valid spec, read back by the registry
    original = methods.create(spec).options
    assert built.name == "pufferfish" and built.options.then == "nocomm"
    for key in ("rank_ratio", "warmup_epochs", "auto_rank", "auto_switch", "frob_decay", "full_rank"):
        assert getattr(built.options, key) == getattr(original, key)
    if original.warmup_epochs or original.auto_switch:
        assert built.options.warmup_method == "nocomm"


def test_codec_is_found_through_hooks_engine_schedules_and_model_axis_methods() -> None:
    assert codec_of("ssgd") is None and codec_of("dear") is None and codec_of("pufferfish") is None
    name, opts = codec_of("topk:density=0.02")  # type: ignore[misc]
    assert name == "topk" and opts["density"] == 0.02
    name, opts = codec_of("wfbp:compress=powersgd,rank=2")  # type: ignore[misc]
    assert name == "powersgd" and opts["rank"] == 2
    name, opts = codec_of("pufferfish:then=(acpsgd:rank=8)")  # type: ignore[misc]
    assert name == "acpsgd" and opts["rank"] == 8


def test_trained_shapes_are_the_factors_for_pufferfish() -> None:
    full = trained_shapes("ssgd", "cnn1d")
    factored = trained_shapes("pufferfish:rank_ratio=0.25", "cnn1d")
    assert full == trained_shapes("nocomm", "cnn1d")
    assert sum(math.prod(s) for s in factored) < sum(math.prod(s) for s in full)


def test_bound_uses_the_trained_models_compute_and_the_kernel_bound_and_keeps_the_old_terms() -> None:
    run = {"method": "pufferfish", "iter_time_s_median": 2.0, "bytes_per_worker_per_iter": 1e6,
           "breakdown_s": {"compress": 0.5}}
    out = bounds.derive(run, batch_size=32, world_size=2, bits_per_s=100e6, compute_only_s=1.5,
                        ssgd_iter_s=None, compress_bound_s=0.01, compute_full_model_s=3.5)
    assert out["lower_bound_s"] == pytest.approx(1.5 + 0.01)
    assert out["bound_ratio"] == pytest.approx(2.0 / 1.51)
    assert out["bound_compress_source"] == "kernel bound"
    assert out["compute_only_full_model_s"] == 3.5 and out["compress_s"] == 0.5
    assert out["lower_bound_measured_compress_s"] == pytest.approx(3.5 + 0.5)  # the old, flattering formula

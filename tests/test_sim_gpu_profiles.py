"""Shipped GPU profiles: resolve by name, sum to the published step time, rebuild identically."""

from __future__ import annotations

import json

import pytest
from torch import nn

from lowcomm.cli import main
from lowcomm.errors import UsageError
from lowcomm.sim import Profile
from lowcomm.sim.gpu_profiles import (ANCHORS, DEVICES, MEASURED_DEVICES, MODELS, build_profile, layer_flops,
                                      shipped_names, write_all)
from lowcomm.sim.profile import SHIPPED_DIR, resolve_profile, shipped_profiles


def test_every_device_model_cell_is_shipped_and_resolves_by_name() -> None:
    assert shipped_profiles() == sorted(shipped_names())
    assert len(shipped_names()) == len(DEVICES) * len(MODELS) == 12
    for name in shipped_names():
        path = resolve_profile(name)
        assert path == SHIPPED_DIR / f"{name}.json" and resolve_profile(f"{name}.json") == path
        prof = Profile.load(path)
        assert prof.layers and not prof.costs.is_zero
        if name.split("-")[0] in MEASURED_DEVICES:
            assert prof.notes.startswith("measured by benchmarks/gpu_profiles_measured.py")
        else:
            assert "published-throughput" in prof.device


def test_unknown_name_is_refused_listing_the_shipped_ones() -> None:
    with pytest.raises(UsageError, match="a100-resnet50") as e:
        resolve_profile("a100-resnet51")
    assert "lowcomm profile --device cuda" in str(e.value)


def test_an_existing_path_wins_over_a_shipped_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "a100-resnet50.json"
    Profile.load(SHIPPED_DIR / "v100-lstm-lm.json").save(mine)
    assert resolve_profile("a100-resnet50.json") == mine.relative_to(tmp_path)
    assert resolve_profile("a100-resnet50") == SHIPPED_DIR / "a100-resnet50.json"


@pytest.mark.parametrize("device", ["v100", "a100"])
def test_published_cells_sum_to_the_published_step_time(device: str) -> None:
    anchor = ANCHORS[device]
    assert anchor is not None
    prof = Profile.load(resolve_profile(f"{device}-resnet50"))
    # step time = batch / published samples per second, whatever the batch of the profile
    assert prof.compute_s == pytest.approx(prof.batch_size / anchor.samples_per_s, rel=1e-12)
    assert f"{anchor.samples_per_s:g} img/s" in prof.notes


def test_a_derived_h100_cell_uses_the_peak_flops_ratio_and_says_so() -> None:
    a100 = Profile.load(resolve_profile("a100-vgg16"))
    h100 = build_profile("h100", "vgg16")
    ratio = DEVICES["h100"].peak_flops / DEVICES["a100"].peak_flops
    assert a100.compute_s / h100.compute_s == pytest.approx(ratio, rel=1e-12)
    assert "DERIVED" in h100.notes


@pytest.mark.parametrize("model", list(MODELS))
def test_measured_h100_layers_sum_to_the_unhooked_step_they_record(model: str) -> None:
    import re

    prof = Profile.load(resolve_profile(f"h100-{model}"))
    assert "H100" in prof.device and "DERIVED" not in prof.notes
    plain_ms = float(re.search(r"forward\+backward ([0-9.]+) ms without hooks", prof.notes).group(1))
    # the notes print 2 decimals of a millisecond: the sum agrees to that rounding
    assert (prof.forward_s + prof.backward_s) * 1e3 == pytest.approx(plain_ms, abs=0.006)
    assert (prof.factorized is not None) == MODELS[model].factorize


def test_write_all_rebuilds_only_the_derived_devices(tmp_path, monkeypatch) -> None:
    import lowcomm.sim.gpu_profiles as gp

    monkeypatch.setattr(gp, "MODELS", {"vgg16": MODELS["vgg16"]})
    written = sorted(p.name for p in write_all(tmp_path))
    assert written == sorted(f"{d}-vgg16.json" for d in DEVICES if d not in MEASURED_DEVICES)


def test_layers_split_forward_backward_one_to_two_and_the_optimizer_is_memory_bound() -> None:
    prof = Profile.load(resolve_profile("v100-lstm-lm"))
    for layer in prof.layers:
        assert layer.backward_s == pytest.approx(2 * layer.forward_s, rel=1e-12, abs=0.0)
    assert prof.optimizer_s == pytest.approx(20 * prof.numel / DEVICES["v100"].mem_bytes_per_s, rel=1e-12)
    # the decoder's vocabulary matmul dominates the LSTM LM's FLOPs, hence its time
    assert max(prof.layers, key=lambda layer: layer.forward_s).name == "decoder"


def test_builder_is_deterministic_and_matches_the_shipped_json() -> None:
    # VGG-16: the cheapest cell to count that still derives its throughput from ResNet-50's
    shipped = json.loads((SHIPPED_DIR / "v100-vgg16.json").read_text())
    built = json.loads(json.dumps(build_profile("v100", "vgg16").to_dict()))
    assert built == shipped
    assert "DERIVED" in built["notes"] and len(built["layers"]) == 16


def test_pufferfish_models_ship_their_factorized_profile() -> None:
    for name in ("v100-resnet50", "a100-lstm-lm"):  # derived: fewer FLOPs, less time
        prof = Profile.load(resolve_profile(name))
        assert prof.factorized is not None and prof.factorized.model.endswith(":pufferfish")
        assert prof.factorized.numel < prof.numel and prof.factorized.compute_s < prof.compute_s


def test_layer_flops_credit_non_parameter_work_to_the_layer_before_in_forward_order() -> None:
    import torch

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    got = layer_flops(model, torch.empty(3, 8, device="meta"))
    assert [(n, f) for n, f, _ in got] == [("0", 2 * 3 * 8 * 16), ("2", 2 * 3 * 16 * 4)]
    assert got[0][2] == [[16, 8], [16]]


def test_simulate_accepts_a_shipped_profile_name(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", "h100-resnet50", "--workers", "8", "--net", "10gbit",
                 "--methods", "ssgd,acpsgd", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["profile"]["model"] == "resnet50_imagenet" and len(res["results"]) == 2
    assert main(["advise", "--profile", "nosuch-gpu", "--net", "1gbit", "--workers", "8"]) == 2
    assert "shipped:" in capsys.readouterr().err

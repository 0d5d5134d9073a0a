"""Profiles: JSON round trip, hand-written documents, and the hook-based profiler."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.sim import ComputeCosts, LayerProfile, Profile
from lowcomm.sim.profiler import measure_costs, parameter_layers, profile_model


def test_profile_json_round_trip(tmp_path) -> None:
    prof = Profile(model="m", batch_size=8, optimizer_s=1e-4, device="cpu",
                   costs=ComputeCosts(elementwise_s_per_elem=1e-9),
                   compressors={"topk": {"encode_s_per_elem": 2e-9, "decode_s_per_elem": 1e-9}},
                   layers=[LayerProfile("a", 1e-3, 2e-3, [[4, 3], [4]])])
    prof.factorized = Profile(model="m:pf", batch_size=8, layers=[LayerProfile("u", 1e-4, 1e-4, [[2, 3]])])
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    assert back == prof
    assert back.numel == 16 and back.grad_bytes == 64
    assert back.compute_s == pytest.approx(1e-3 + 2e-3 + 1e-4)


def test_hand_written_profile_with_numel_and_defaults(tmp_path) -> None:
    doc = {"model": "published", "batch_size": 64,
           "layers": [{"name": "conv", "forward_s": 0.001, "backward_s": 0.002, "numel": 1000},
                      {"forward_s": 0.0005, "backward_s": 0.001, "param_shapes": [[10, 100], [10]]}]}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(doc))
    prof = Profile.load(path)
    assert [l.numel for l in prof.layers] == [1000, 1010]
    assert prof.layers[1].name == "layer1" and prof.bytes_per_elem == 4 and prof.costs.is_zero


@pytest.mark.parametrize("doc,match", [
    ({"batch_size": 1, "layers": []}, "model"),
    ({"model": "x", "batch_size": 1, "layers": []}, "empty"),
    ({"model": "x", "batch_size": 1, "layers": [{"forward_s": 1}]}, "backward_s"),
    ({"model": "x", "batch_size": 1, "layers": [{"forward_s": -1, "backward_s": 0, "numel": 1}]}, ">= 0"),
    ({"model": "x", "batch_size": 1, "layers": [{"forward_s": 0, "backward_s": 0, "numel": 1}],
      "costs": {"flops": 1}}, "unknown costs"),
    ({"model": "x", "batch_size": 1, "format_version": 9, "layers": []}, "format_version"),
])
def test_bad_profiles_are_refused_clearly(tmp_path, doc, match) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UsageError, match=match):
        Profile.load(path)


def test_missing_or_invalid_file_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        Profile.load(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        Profile.load(tmp_path / "x.json")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 8, bias=False)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
        self.out = nn.Linear(8, 6, bias=False)
        self.out.weight = nn.Parameter(self.emb.weight.t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.emb(x)))


def test_parameter_layers_list_each_parameter_once() -> None:
    layers = parameter_layers(Tied())
    assert [n for n, _, _ in layers] == ["emb", "mid.0", "mid.2", "out"]
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert len(parameter_layers(model)) == 1


def test_profiler_reports_layers_in_forward_order_with_shapes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    prof = profile_model(model, lambda: (x, y), nn.functional.cross_entropy, model_name="seq",
                         batch_size=8, warmup=1, iters=3, measure_kernels=False)
    assert [l.name for l in prof.layers] == ["0", "2", "4"]
    assert [l.param_shapes for l in prof.layers] == [[[32, 16], [32]], [[32, 32], [32]], [[4, 32], [4]]]
    assert prof.numel == sum(p.numel() for p in model.parameters())
    assert all(l.forward_s >= 0 and l.backward_s >= 0 for l in prof.layers)
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.optimizer_s > 0
    assert all(not h for h in (model[0]._forward_pre_hooks, model[2]._forward_pre_hooks))


def test_measured_costs_are_positive() -> None:
    c = measure_costs("cpu", n=1 << 16)
    assert all(v > 0 for v in vars(c).values())


def test_profiler_times_codecs_on_the_models_own_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 M-element synthetic buffer stays in cache where the model's gradients do not, so the
    codecs are timed on the model's own shapes (its size and its tensors)."""
    from lowcomm.sim import profiler

    seen: list[tuple[int, list[list[int]]]] = []

    def encode_s(cls: Any, x: torch.Tensor, layout: Any, *_: Any) -> float:
        seen.append((x.numel(), [list(s) for s in layout.shapes]))
        return 1e-3

    monkeypatch.setattr(profiler, "_encode_s", encode_s)
    monkeypatch.setattr(profiler, "_decode_s", lambda *a, **k: (1e-3, "all_reduce"))
    monkeypatch.setattr(profiler, "measure_costs", lambda *a, **k: profiler.ComputeCosts())
    hooks_seen: list[list[list[int]]] = []
    monkeypatch.setattr(profiler, "measure_torch_hooks",
                        lambda shapes, *a, **k: hooks_seen.append([list(s) for s in shapes]) or {})
    model = nn.Sequential(nn.Conv1d(2, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6, 4))
    x, y = torch.randn(4, 2, 8), torch.randint(0, 4, (4,))
    prof = profile_model(model, lambda: (x, y), nn.functional.cross_entropy, model_name="c",
                         batch_size=4, warmup=1, iters=2)
    numel = sum(p.numel() for p in model.parameters())
    assert hooks_seen == [[[8, 2, 3], [8], [4, 48], [4]]]  # PyTorch's hooks on the same gradients
    assert seen and all(n == numel for n, _ in seen)
    assert seen[0][1] == [[8, 2, 3], [8], [4, 48], [4]]
    assert all(e["encode_s_per_elem"] == pytest.approx(1e-3 / numel) for e in prof.compressors.values())
    seen.clear()
    profiler.measure_compressors("cpu", n=1 << 12, reps=1)  # no shapes: the synthetic matrix and vector
    assert seen[0][1] == [[1024, 3], [1024]]

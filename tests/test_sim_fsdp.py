"""PyTorch's FSDP2 (torch_fsdp) in the simulator: units, bytes, blocking on a CPU, overlap on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.methods.base import MethodContext
from lowcomm.methods.reference import shard_units
from lowcomm import models
from lowcomm.sim import LayerProfile, Link, NetworkModel, Profile, predict_iteration_time
from lowcomm.sim.predict import simulate
from lowcomm.sim.profile import ComputeCosts
from lowcomm.sim.profiler import parameter_layers
from lowcomm.sim.schedules import method_names
from lowcomm.sim.schedules.fsdp import padded_shard_numel, shard_units_of, unit_of
from lowcomm.testing import distributed

NET = NetworkModel(inter=Link(1e-4, 8e-9))


def _profile_of(model: nn.Module, device: str = "cpu") -> Profile:
    """The model's parameterized modules as the profiler names them, 1 ms each way."""
    layers = [LayerProfile(name, 1e-3, 2e-3, [list(p.shape) for p in params])
              for name, _, params in parameter_layers(model)]
    return Profile(model="m", batch_size=8, optimizer_s=0.02, layers=layers, device=device,
                   costs=ComputeCosts(elementwise_s_per_elem=1e-10))


def test_the_simulator_knows_torch_fsdp() -> None:
    assert "torch_fsdp" in method_names()


def test_units_are_the_blocks_the_method_shards() -> None:
    model = models.create("resnet18", num_classes=10)
    names = {id(m): n for n, m in model.named_modules()}
    expected = [names[id(u)] for u in shard_units(model)]
    prof = _profile_of(model)
    got = [unit_of(prof.layers[u[0]].name) for u in shard_units_of(prof)]
    assert got == expected  # conv1, bn1, each of the 8 blocks, linear


def test_a_shard_pads_each_parameters_first_dimension_to_a_multiple_of_p() -> None:
    assert padded_shard_numel([[10, 3], [5], []], 4) == 3 * 3 + 2 + 1


def _spans(prof: Profile) -> tuple[list, list]:
    sim, _ = simulate(prof, "torch_fsdp", workers=4, network=NET, iterations=3)
    tasks = [t for t in sim.tl.tasks if t.iteration == 3 and t.duration > 0]
    return [t for t in tasks if t.stream == "compute"], [t for t in tasks if t.kind == "comm"]


def test_on_a_cpu_every_collective_blocks_the_training_thread() -> None:
    compute, comm = _spans(_profile_of(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))))
    assert comm and not any(c.overlaps(x) for c in comm for x in compute)


def test_on_a_gpu_the_collectives_overlap_compute_and_the_iteration_is_shorter() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 64))
    compute, comm = _spans(_profile_of(model, "cuda:0"))
    assert any(c.overlaps(x) for c in comm for x in compute)
    cpu, gpu = (predict_iteration_time(_profile_of(model, d), "torch_fsdp", workers=4, network=NET).iter_time_s
                for d in ("cpu", "cuda:0"))
    assert gpu < cpu


def test_on_a_gpu_an_all_gather_sends_the_shards_the_last_step_updated() -> None:
    sim, _ = simulate(_profile_of(nn.Sequential(nn.Linear(64, 64)), "cuda"), "torch_fsdp", workers=4,
                      network=NET, iterations=2)
    assert sim.tl.find("agin.u0", 2).start >= sim.tl.find("opt", 1).end


def test_the_step_updates_one_shard() -> None:
    prof = _profile_of(nn.Sequential(nn.Linear(64, 64)))
    pred = predict_iteration_time(prof, "torch_fsdp", workers=4, network=NET)
    assert pred.breakdown_s["optimizer"] == pytest.approx(prof.optimizer_s / 4)


@distributed(world_size=2)
def test_the_bytes_predicted_are_the_bytes_fsdp_sends() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 7))  # odd sizes: padding
    prof = _profile_of(model)  # names taken before FSDP swaps the parameters
    method = methods.create("torch_fsdp")
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=world))
    accounting.ledger().reset()
    wrapped(torch.randn(4, 33)).square().mean().backward()
    counted = sum(v["wire_bytes"] for v in accounting.ledger().as_dict()["by_tag"].values())
    predicted = predict_iteration_time(prof, "torch_fsdp", workers=world, network=NET)
    assert predicted.wire_bytes_per_worker == counted


def test_a_profile_of_an_unknown_device_is_simulated_as_a_gpu_profile() -> None:
    prof = dataclasses.replace(_profile_of(nn.Sequential(nn.Linear(64, 64))), device="unknown")
    _, schedule = simulate(prof, "torch_fsdp", workers=2, network=NET, iterations=1)
    assert not schedule.blocking  # type: ignore[attr-defined]


def test_every_method_a_run_can_time_has_a_schedule() -> None:
    assert set(methods.names(include_timing_only=True)) <= set(method_names())


def test_on_a_gpu_an_all_gather_runs_at_most_two_units_ahead() -> None:
    model = nn.Sequential(*(nn.Linear(128, 128) for _ in range(5)))
    sim, _ = simulate(_profile_of(model, "cuda"), "torch_fsdp", workers=4, network=NET, iterations=2)
    for k in range(2, 5):
        assert sim.tl.find(f"agin.u{k}", 2).start >= sim.tl.find(f"agout.u{k - 2}", 2).end
    assert sim.tl.find("agin.u1", 2).start < sim.tl.find("agout.u0", 2).end  # one ahead is free

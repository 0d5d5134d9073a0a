"""DDP's buckets as lowcomm's methods build them, and as the simulator replays them.

Why a test: torch 2.13's DDP closes its first bucket at 1 MiB only when it is given no bucket
cap; given one (even its own default, 25), it closes the first bucket at the cap too. lowcomm
passed 25 until 2026-12-02, so its runs lost DDP's small first bucket while the simulator kept
it, and every DDP method was predicted a little fast (ssgd at 8 emulated workers by 2.5 points).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods
from lowcomm.bench.prediction import ddp_caps_of
from lowcomm.methods.base import MethodContext
from lowcomm.runtime.config import TrainConfig
from lowcomm.sim import LayerProfile, Link, NetworkModel, Profile
from lowcomm.sim.predict import ddp_caps
from lowcomm.sim.schedules.base import Sim, ddp_buckets
from lowcomm.testing import distributed

NET = NetworkModel(inter=Link(1e-5, 8e-9))
WIDTH = 256  # a layer: 65,792 float32 elements, 263 KB


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(10)))


def _simulated(model: nn.Sequential, caps: tuple[float, float]) -> list[int]:
    """Bucket sizes (elements, backward order) the simulator gives ``model`` under ``caps``."""
    layers = [LayerProfile(name, 1e-3, 1e-3, [list(p.shape) for p in m.parameters()])
              for name, m in model.named_children()]
    sim = Sim(Profile(model="mlp", batch_size=4, optimizer_s=0.0, layers=layers), 2, NET,
              bucket_mb=caps[0], first_bucket_mb=caps[1])
    return [b.numel for b in ddp_buckets(sim.tensors_backward(), sim.bpe, sim.bucket_bytes, sim.first_bucket_bytes)]


@distributed(world_size=2)
@pytest.mark.parametrize("cap, recorded", [(None, (25.0, 1.0)), (0.5, (0.5, 0.5))])
def test_ssgds_rebuilt_buckets_are_the_simulators_for_the_caps_its_run_records(
        cap: float | None, recorded: tuple[float, float]) -> None:
    model = _model()
    method = methods.create("ssgd")
    wrapped = method.wrap(model, MethodContext(rank=dist.get_rank(), world_size=2, bucket_cap_mb=cap))
    for _ in range(2):  # DDP rebuilds its buckets in backward's order after the first step
        wrapped(torch.randn(4, WIDTH)).sum().backward()
        method.finish_sync()
    info = method.describe()
    assert (info["bucket_cap_mb"], info["first_bucket_mb"]) == recorded
    assert ddp_caps(cap) == recorded  # `lowcomm simulate --bucket-mb` reads a cap as the trainer's DDP does
    sizes = dict(model.named_parameters())
    measured = [sum(sizes[name].numel() for name in bucket) for bucket in method.state_dict()["ddp_buckets"]]
    assert measured == _simulated(model, ddp_caps_of({"method_info": info}))
    assert len(measured) == (2 if cap is None else 5)  # 4 layers then 6; 2 layers per bucket


def test_runs_recorded_before_the_first_bucket_was_reported_replay_torchs_explicit_cap() -> None:
    assert ddp_caps_of({"method_info": {"method": "ssgd", "bucket_cap_mb": 25.0}}) == (25.0, 25.0)
    assert ddp_caps_of({}) == (25.0, 25.0)
    assert ddp_caps_of({"method_info": {"bucket_cap_mb": 25.0, "first_bucket_mb": 1.0}}) == (25.0, 1.0)


def test_the_trainer_leaves_ddps_bucket_defaults_alone_unless_given_a_cap() -> None:
    assert TrainConfig().bucket_cap_mb is None and MethodContext().bucket_cap_mb is None

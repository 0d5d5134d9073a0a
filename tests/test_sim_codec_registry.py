"""Completeness: every registered codec simulates, is profiled and advised, from its
declarations alone; a codec registered at run time does too, without touching ``lowcomm.sim``."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from compress_testlib import has_reference
from lowcomm.compress.codec import CODECS, Aggregation, Codec, CodecCost, Layout, Message, Round, Work, codec_class, register_codec
from lowcomm.errors import UsageError
from lowcomm.sched.pairing import Mode, mode_refusal
from lowcomm.sim import ComputeCosts, LayerProfile, Link, NetworkModel, Profile, predict_iteration_time, simulate
from lowcomm.sim.advise import advise, candidates, caveat
from lowcomm.sim.network import collective_wire_bytes
from lowcomm.sim.profiler import measure_compressors

NET = NetworkModel(inter=Link(1e-3, 1e-8))
COSTS = ComputeCosts(elementwise_s_per_elem=1e-9, matmul_s_per_flop=1e-11,
                     orthogonalize_s_per_elem=1e-8, topk_s_per_elem=2e-9, scatter_s_per_elem=3e-9)
SHAPES = [[256, 128], [256], [64, 256], [64]]


def tiny() -> Profile:
    return Profile(model="tiny", batch_size=4, optimizer_s=1e-4, costs=COSTS,
                   layers=[LayerProfile("a", 1e-3, 2e-3, SHAPES[:2]),
                           LayerProfile("b", 1e-3, 2e-3, SHAPES[2:])])


def codec_names() -> list[str]:
    return CODECS.names()


@pytest.mark.parametrize("name", codec_names())
def test_every_codec_has_bytes_a_reference_and_a_caveat(name: str) -> None:
    cls = codec_class(name)
    codec = cls(world=4)
    for world in (2, 4, 6):
        cost = codec.cost(SHAPES, world=world, dtype_bytes=4, step=0)
        assert cost.rounds and cost.nbytes > 0
        assert cost.nbytes == sum(r.nbytes for r in cost.rounds)
        if cls.aggregation is Aggregation.SUM:  # a sum does not grow with the world
            assert cost.nbytes == codec.cost(SHAPES, world=2, dtype_bytes=4, step=0).nbytes
    assert has_reference(name), f"{name}: no central reference in tests/compress_testlib.py"
    assert cls.caveat and cls.summary


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("workers", [1, 2, 6])
def test_every_codec_simulates_exactly_the_bytes_it_declares(name: str, workers: int) -> None:
    prof = tiny()
    sim, sched = simulate(prof, name, workers=workers, network=NET, bucket_mb=0.1,
                          first_bucket_mb=0.1)
    codec = codec_class(name)(world=workers)
    declared = sum(collective_wire_bytes(r.collective, r.nbytes, workers)
                   for it in range(2, 6) for b in sched.buckets  # type: ignore[attr-defined]
                   for r in codec.cost(b.shapes, world=workers, dtype_bytes=4, step=it - 1).rounds)
    pred = predict_iteration_time(prof, name, workers=workers, network=NET, bucket_mb=0.1,
                                  first_bucket_mb=0.1)
    assert pred.wire_bytes_per_worker == pytest.approx(declared / 4)
    assert pred.iter_time_s >= prof.compute_s
    assert pred.breakdown_s["compress"] > 0  # the declared work is priced


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("schedule", ["wfbp", "mgwfbp", "dear", "lee18"])
def test_every_engine_schedule_carries_or_refuses_every_codec(name: str, schedule: str) -> None:
    mode = {"dear": Mode.DEAR, "lee18": Mode.SHARD}.get(schedule, Mode.ALLREDUCE)
    why = mode_refusal(mode, schedule, codec_class(name))
    spec = f"{schedule}:compress={name}"
    if why:
        with pytest.raises(UsageError) as e:
            predict_iteration_time(tiny(), spec, workers=4, network=NET)
        assert str(e.value) == why
    else:
        pred = predict_iteration_time(tiny(), spec, workers=4, network=NET)
        assert pred.breakdown_s["compress"] > 0


def test_profiler_measures_every_registered_codec() -> None:
    measured = measure_compressors("cpu", n=4096, reps=1)
    hooks = {"torch_fp16", "torch_powersgd.rank4"}  # PyTorch's own hooks, timed whole beside them
    assert set(measured) == set(CODECS.names()) | hooks
    for name, entry in measured.items():
        if name in hooks:
            assert entry["hook_s_per_elem"] > 0
        else:
            assert entry["encode_s_per_elem"] > 0 and entry["decode_s_per_elem"] >= 0


def test_advisor_considers_every_codec_with_its_caveat() -> None:
    assert set(CODECS.names()) <= set(candidates())
    for name in CODECS.names():
        assert caveat(name) == codec_class(name).caveat
    assert "pufferfish" not in candidates(tiny())


# -- a codec registered at run time ----------------------------------------------------------
@dataclass
class _ByteOptions:
    scale: float = 127.0


class _ByteCodec(Codec):
    """Test-only: 1 byte per element (a fixed-scale int8 cast), sum-compatible."""

    name = "testbyte"
    summary = "test-only int8 cast"
    caveat = "test-only: clips at the fixed scale."
    Options = _ByteOptions
    elementwise = True

    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *, pad_to: int = 1) -> Message:
        q = (flat / self.world * self.options.scale).round().clamp(-127, 127).to(torch.int8)
        return Message(q, "all_reduce", ctx=flat.dtype)

    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(received[: out.numel()].to(out.dtype) / self.options.scale)

    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None) -> CodecCost:
        n = sum(math.prod(s) for s in shapes)
        return CodecCost(Work(elementwise=2 * n), [Round("all_reduce", n, Work(elementwise=n))])


@pytest.fixture
def byte_codec() -> Iterator[str]:
    register_codec(_ByteCodec)
    try:
        yield _ByteCodec.name
    finally:
        CODECS._factories.pop(_ByteCodec.name)  # test-only: the registry has no unregister


def test_a_codec_registered_at_run_time_simulates_and_is_advised(byte_codec: str) -> None:
    prof = tiny()
    ssgd = predict_iteration_time(prof, "ssgd", workers=4, network=NET)
    byte = predict_iteration_time(prof, f"{byte_codec}:scale=100", workers=4, network=NET)
    assert byte.wire_bytes_per_worker * 4 == ssgd.wire_bytes_per_worker
    n = prof.numel
    assert byte.breakdown_s["compress"] == pytest.approx(3 * n * 1e-9)
    with pytest.raises(UsageError, match="scale"):
        predict_iteration_time(prof, f"{byte_codec}:bogus=1", workers=4, network=NET)
    # engine schedules carry it by its declarations (elementwise SUM: lee18 too)
    for spec in ("wfbp", "mgwfbp", "dear:threshold_mb=0", "lee18"):
        predict_iteration_time(prof, f"{spec}:compress={byte_codec}" if ":" not in spec
                               else f"{spec},compress={byte_codec}", workers=4, network=NET)
    adv = advise(prof, workers=64, network=NetworkModel.preset("1gbit"))
    assert byte_codec in [p.method for p in adv.ranking]
    assert caveat(byte_codec) == _ByteCodec.caveat
    assert byte_codec in measure_compressors("cpu", n=4096, reps=1)

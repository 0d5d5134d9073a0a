"""Overflow in one rank's gradient or in one shard's sum: every rank skips the same step.

Why these tests: the sharded schedules (dear, lee18) reduce-scatter, so a non-finite entry
lands in one rank's shard only. If the ranks then disagree on skipping, their collectives
stop pairing up and the run hangs under a GradScaler (or silently diverges without one).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.compress.codec import Layout, codec_class
from lowcomm.methods.base import MethodContext
from lowcomm.testing.distributed import run_distributed

methods.names()

SHARDED = ["lee18:compress=fp16,threshold_mb=0,merge_below=0", "dear:compress=fp16,threshold_mb=0", "lee18:threshold_mb=0,merge_below=0", "dear:threshold_mb=0"]


def _row3(rank: int, big: float, both: bool) -> torch.Tensor:
    """Loss weights whose last output row (rank 1's shard of a 4x4 weight) gets ``big``."""
    v = big if (both or rank == 0) else 1.0
    return torch.tensor([[1.0, 1.0, 1.0, v]])


def _flag_after_one_step(spec: str, big: float, both: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    m = methods.create(spec)
    w = m.wrap(model, MethodContext(rank=rank, world_size=2))
    accounting.ledger().reset()
    (w(torch.ones(1, 4)) * _row3(rank, big, both)).sum().backward()
    m.finish_sync()
    flag = m.nonfinite_flag()
    finite_calls = accounting.ledger().by_tag[f"{m.name}.finite"].calls
    return {"rank": rank, "nonfinite": None if flag is None else bool(flag), "finite_calls": finite_calls}


def _big(spec: str, overflow_fp32: bool) -> float:
    """A gradient that overflows the shard's sum: fp16 (>65504 after the sum) or fp32."""
    return 3e38 if overflow_fp32 else 1e5


@pytest.mark.parametrize("spec", SHARDED[:2] + ["wfbp:compress=fp16"])
def test_value_beyond_fp16_range_on_one_rank_is_seen_as_nonfinite_by_every_rank(spec: str) -> None:
    """1e6 / P is finite in fp32 but inf in the fp16 message: the message must be poisoned."""
    res = run_distributed(_flag_after_one_step, 2, spec, 1e6, False, timeout=60)
    assert [r["nonfinite"] for r in res] == [True, True]


@pytest.mark.parametrize("spec", SHARDED)
def test_sum_that_overflows_in_one_shard_only_is_agreed_nonfinite_on_every_rank(spec: str) -> None:
    """Each rank's value is finite in the wire dtype, their sum is not, and it sits in rank
    1's shard only: one all-reduced flag makes rank 0 see it too."""
    big = _big(spec, overflow_fp32="fp16" not in spec)
    res = run_distributed(_flag_after_one_step, 2, spec, big, True, timeout=60)
    assert [r["nonfinite"] for r in res] == [True, True]
    assert [r["finite_calls"] for r in res] == [1, 1]  # one tiny all-reduce per step, counted


def _amp_steps(spec: str, big: float, both: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    m = methods.create(spec)
    w = m.wrap(model, MethodContext(rank=rank, world_size=2))
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    m.attach_scaler(scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(3):
        out = w(torch.ones(1, 4))
        coeff = _row3(rank, big, both) if step == 1 else torch.ones(1, 4)
        scaler.scale((out * coeff).sum()).backward()
        m.finish_sync()
        m.optimizer_step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    m.flush()
    return {"scales": scales, "w": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("spec", SHARDED[:2])
@pytest.mark.parametrize("both", [False, True], ids=["one-rank-beyond-fp16", "sum-overflows-one-shard"])
def test_overflow_under_cpu_gradscaler_skips_the_same_step_on_every_rank_without_hanging(
        spec: str, both: bool) -> None:
    res = run_distributed(_amp_steps, 2, spec, 1e6 if not both else 1e5, both, timeout=60)
    assert res[0]["scales"] == res[1]["scales"] == [1.0, 0.5, 0.5]
    for a, b in zip(res[0]["w"], res[1]["w"]):
        assert torch.equal(a, b)


def test_fp16_message_is_poisoned_when_the_cast_overflows() -> None:
    codec = codec_class("fp16")(codec_class("fp16").Options(), world=2, rank=0)
    flat = torch.tensor([1.0, 2.0, 1e6, 3.0])
    layout = Layout.of(["w"], [flat.shape], {"w": 0})
    msg = codec.encode(flat, layout, torch.ones((), dtype=torch.bool))
    assert torch.isnan(msg.buf).all()

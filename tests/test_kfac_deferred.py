"""``defer_factor_comm``: a factor step's all-reduce is folded when the factors are next read.

The deferral changes only when ``step()`` waits, never what it computes: the same sums are
folded in the same order with the decay of the step that launched them. So a deferred run
must equal the run that waits at once bit for bit, in both communication modes, and a round
must really stay in flight over the steps that do not read the factors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm.optim.kfac import KFAC
from lowcomm.testing import distributed, run_distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _train(steps: int, **kw: Any) -> tuple[nn.Module, KFAC]:
    net = _net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kfac = KFAC(model, **{"damping": 0.01, "local_inverse_below": 0, **kw})
    for s in range(steps):
        _step(model, opt, kfac, s)
    return net, kfac


def _step(model: nn.Module, opt: torch.optim.Optimizer, kfac: KFAC, s: int) -> None:
    gen = torch.Generator().manual_seed(100 * dist.get_rank() + s)  # each rank its own data
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    kfac.step()
    opt.step()


def _factors(kfac: KFAC) -> list[torch.Tensor]:
    state = kfac.state_dict()
    return [f for layer in state["factors"].values() for f in (layer["A"], layer["G"])]


def _deferred_equals_immediate(pipeline: bool, fraction: float) -> None:
    kw = {"factor_update_steps": 2, "inv_update_steps": 6, "pipeline": pipeline,
          "grad_worker_fraction": fraction}
    late, late_kfac = _train(13, defer_factor_comm=True, **kw)
    now, now_kfac = _train(13, defer_factor_comm=False, **kw)
    for (name, p), q in zip(late.named_parameters(), now.parameters()):
        assert torch.equal(p, q), name
    for a, b in zip(_factors(late_kfac), _factors(now_kfac)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pipeline", [True, False])
def test_deferred_factor_comm_gives_the_immediate_result_bit_for_bit(pipeline: bool) -> None:
    run_distributed(_deferred_equals_immediate, 2, pipeline, 1.0)


@distributed(world_size=2)
def test_deferral_is_exact_with_dp_kfac_where_gradients_travel_on_the_same_group() -> None:
    _deferred_equals_immediate(True, 0.5)


def _in_flight(pipeline: bool) -> None:
    net = _net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, factor_update_steps=1, inv_update_steps=4, damping=0.01, pipeline=pipeline)
    kfac.pipeline_comm.window = (0, 0)  # no profiling window: every factor step may defer
    _step(model, opt, kfac, 0)  # factor and inverse step: folded before the decomposition
    assert kfac._rounds == []
    after_first = [f.clone() for f in (kfac._factors[n].a for n in kfac._factors) if f is not None]
    _step(model, opt, kfac, 1)  # a factor step only: its all-reduce stays in flight
    assert len(kfac._rounds) == 1
    now = [f for f in (kfac._factors[n].a for n in kfac._factors) if f is not None]
    assert all(torch.equal(a, b) for a, b in zip(after_first, now))  # not folded yet
    _step(model, opt, kfac, 2)  # the next factor step folds step 1's round, launches its own
    assert len(kfac._rounds) == 1
    assert not all(torch.equal(a, b) for a, b in zip(after_first, now))  # folded in place
    kfac.state_dict()  # reads the factors: folds everything
    assert kfac._rounds == []


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_factor_step_that_is_not_an_inverse_step_leaves_its_round_in_flight(pipeline: bool) -> None:
    run_distributed(_in_flight, 2, pipeline)


@distributed(world_size=2)
def test_profiled_factor_steps_are_folded_before_the_probe() -> None:
    net = _net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, factor_update_steps=1, inv_update_steps=100, damping=0.01)
    assert kfac.pipeline_comm.window == (1, 5)
    for s in range(7):  # factor steps 1 to 5 are profiled; the plan is made at the 5th
        _step(model, opt, kfac, s)
        assert kfac._rounds == [] if s <= 5 else len(kfac._rounds) == 1, s
    assert kfac.pipeline_comm.groups is not None


@distributed(world_size=2)
def test_remove_folds_the_round_in_flight() -> None:
    net = _net()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, factor_update_steps=1, inv_update_steps=4, damping=0.01, pipeline=False)
    for s in range(2):
        _step(model, opt, kfac, s)
    assert len(kfac._rounds) == 1
    kfac.remove()
    assert kfac._rounds == []


def test_defer_factor_comm_must_be_a_bool() -> None:
    from lowcomm.errors import UsageError

    with pytest.raises(UsageError, match="defer_factor_comm must be True or False"):
        KFAC(_net(), defer_factor_comm="yes")  # type: ignore[arg-type]

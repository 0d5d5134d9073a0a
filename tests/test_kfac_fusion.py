"""SPD-KFAC's α-β merge of small factors: the rule on known timelines, and on 2 ranks the
plan is shared, covers every factor once, and changes only how the numbers travel."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.optim.kfac.fusion import CostModel, merge_groups
from lowcomm.testing import distributed
from test_kfac_distributed import _batch, _HostReads, _run, _same_on_all_ranks

import torch.nn.functional as F


@pytest.mark.parametrize("sizes, ready, cost, groups", [
    # far apart, link idle: each alone (waiting 1 s for the next costs more than α = 1 ms)
    ([10, 10, 10], [0.0, 1.0, 2.0], CostModel(1e-3, 0.0), [[0], [1], [2]]),
    # all ready at once: no wait, merging saves α each time
    ([10, 10, 10], [0.0, 0.0, 0.0], CostModel(1e-3, 0.0), [[0, 1, 2]]),
    # the next is ready 0.5 ms after: waiting < α = 1 ms, merge; the third is 1 s later
    ([10, 10, 10], [0.0, 5e-4, 1.0], CostModel(1e-3, 0.0), [[0, 1], [2]]),
    # a big first transfer (1 s) keeps the link busy until t = 1: factor 2 (ready at 0.5)
    # cannot go before then anyway, so it joins factor 1's group; factor 3 at t = 5 is alone
    ([10**9, 10, 10, 10], [0.0, 0.1, 0.5, 5.0], CostModel(1e-3, 1e-9), [[0], [1, 2], [3]]),
])
def test_merge_rule_on_known_timelines(sizes: list[int], ready: list[float], cost: CostModel,
                                       groups: list[list[int]]) -> None:
    assert merge_groups(sizes, ready, cost) == groups


def test_merge_rule_keeps_every_position_once_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        ready = torch.rand(n, generator=gen).mul(1e-2).cumsum(0).tolist()
        sizes = torch.randint(1, 10**6, (n,), generator=gen).tolist()
        groups = merge_groups(sizes, ready, CostModel(1e-3, 1e-9))
        assert [i for g in groups for i in g] == list(range(n))


@distributed(world_size=2)
def test_merged_plan_is_shared_and_gives_the_baseline_result() -> None:
    def forced(kfac):  # type: ignore[no-untyped-def]
        kfac.pipeline_comm.window = (0, 2)  # profile factor steps 0 and 1, plan after step 1
        kfac.pipeline_comm.fixed_cost = CostModel(100.0, 0.0)  # α = 100 s: everything merges
        return kfac

    merged, kfac = _run(4, pipeline=True, configure=forced)
    base, _ = _run(4, pipeline=False)
    for (name, p), q in zip(merged.named_parameters(), base.parameters()):
        assert torch.equal(p, q), name
    groups = kfac.pipeline_comm.groups
    assert groups == {"A": [[0, 1, 2, 3]], "G": [[3, 2, 1, 0]]}  # hook order: forward, backward
    # one all-reduce per kind per factor step now, the same bytes as before
    accounting.ledger().reset()
    idx, y = _batch(9)
    with _HostReads() as reads:  # grouping in the hooks reads nothing back either
        F.cross_entropy(merged(idx), y).backward()
    assert reads.calls == []
    kfac.step()
    by_tag = accounting.ledger().as_dict()["by_tag"]
    assert by_tag["kfac.A"]["calls"] == by_tag["kfac.G"]["calls"] == 1


@distributed(world_size=2)
def test_probed_plan_covers_every_factor_once_on_every_rank() -> None:
    def early(kfac):  # type: ignore[no-untyped-def]
        kfac.pipeline_comm.window = (0, 2)
        return kfac

    _, kfac = _run(3, pipeline=True, configure=early)
    cost = kfac.pipeline_comm.cost
    assert cost is not None and cost.alpha >= 0 and cost.beta >= 0
    assert _same_on_all_ranks(torch.tensor([cost.alpha, cost.beta], dtype=torch.float64))
    groups = kfac.pipeline_comm.groups
    for kind in "AG":
        flat = [i for g in groups[kind] for i in g]
        assert sorted(flat) == list(range(len(kfac.layers)))
        sizes = torch.tensor([len(g) for g in groups[kind]])
        assert _same_on_all_ranks(sizes) and _same_on_all_ranks(torch.tensor(flat))
    assert dist.get_world_size() == 2


@distributed(world_size=2)
def test_resumed_preconditioner_keeps_the_plan_instead_of_profiling_again() -> None:
    """On 3+ ranks the grouping changes the ring's summation order, so a resumed run must send
    the factors in the groups the interrupted run chose (and not re-profile)."""
    from lowcomm.optim.kfac import KFAC

    def early(kfac):  # type: ignore[no-untyped-def]
        kfac.pipeline_comm.window = (0, 2)
        kfac.pipeline_comm.fixed_cost = CostModel(100.0, 0.0)  # everything merges
        return kfac

    net, kfac = _run(3, pipeline=True, configure=early)
    state = kfac.state_dict()
    assert state["pipeline"]["groups"] == kfac.pipeline_comm.groups
    assert state["pipeline"]["factor_steps"] == 3 and state["pipeline"]["cost"] == [100.0, 0.0]
    kfac.remove()
    fresh = KFAC(net, factor_update_steps=1, inv_update_steps=2, damping=0.01, local_inverse_below=0)
    assert fresh.pipeline_comm.groups is None
    fresh.load_state_dict(state)
    assert fresh.pipeline_comm.groups == kfac.pipeline_comm.groups
    assert fresh.pipeline_comm.factor_steps == 3 and not fresh.pipeline_comm.profiling
    fresh.remove()

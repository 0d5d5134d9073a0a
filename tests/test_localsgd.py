"""``localsgd`` (and the shared harness of the semi-synchronous methods): 2 ranks against a
single-process reference computation of the same algorithm.

The harness: each rank trains a tiny model for a few steps with the method (no DDP; the
method's ``optimizer_step`` runs the inner step and the syncs), on batches drawn from
(step, rank); the reference keeps one replica per rank in one process, runs the same inner
steps on the same batches and applies the algorithm as written in the papers, per parameter
(no flat buffers, no collectives). Tolerance (tests/tolerance.py): the two sides differ only
in the order of float32 additions inside the averages and outer steps; a difference of one
rounding can grow through the later inner steps, so ``ops`` is 8 per step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.methods.outer_sync import layer_groups, split_fragments
from lowcomm.testing import run_distributed
from tolerance import assert_close_eps

methods.names()  # load the method modules before forking
WORLD = 2
LR = 0.1


class Net(nn.Module):
    """Three layers (so up to three fragments) and a BatchNorm (buffers to average)."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.norm(self.fc1(x))))))


def make_model(bn: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(bn)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def make_optimizer(model: nn.Module, inner: str) -> torch.optim.Optimizer:
    if inner == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(
        model.parameters(), lr=LR, momentum=0.5 if inner == "sgd_momentum" else 0.0
    )


def inner_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, device: str = "cpu"
) -> None:
    opt.zero_grad(set_to_none=True)
    x, y = (t.to(device) for t in batch(step, rank))
    nn.functional.cross_entropy(model(x), y).backward()


def rank_run(
    spec: str, steps: int, inner: str = "sgd", bn: bool = False, device: str = "cpu"
) -> dict[str, Any]:
    """One rank: train ``steps`` steps with method ``spec`` on ``device`` (``cuda``: this rank's
    GPU); its weights and buffers (on the CPU) and its bytes by tag."""
    accounting.ledger().reset()
    where = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device(device)
    )
    model = make_model(bn).to(where)
    method = methods.create(spec)
    rank = dist.get_rank()
    ctx = MethodContext(
        rank=rank, world_size=dist.get_world_size(), total_steps=steps, device=where
    )
    model = method.wrap(model, ctx)
    opt = make_optimizer(model, inner)
    for step in range(steps):
        inner_step(model, opt, step, rank, device)
        method.optimizer_step(opt)
    method.flush()
    return {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "by_tag": {k: v["wire_bytes"] for k, v in accounting.ledger().as_dict()["by_tag"].items()},
    }


def reference(
    steps: int,
    *,
    h: int,
    mode: str,
    inner: str = "sgd",
    bn: bool = False,
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
    outer_lr: float = 0.7,
    mu: float = 0.9,
    nesterov: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """The algorithm in one process: one replica per rank; returns each replica's state."""
    base = make_model(bn)
    reps = [copy.deepcopy(base) for _ in range(WORLD)]
    opts = [make_optimizer(m, inner) for m in reps]
    frags = split_fragments(base, fragments)
    offsets = [f * h // fragments for f in range(fragments)]
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    mom = {n: torch.zeros_like(p) for n, p in glob.items()}
    pending: list[tuple[int, int, dict[str, torch.Tensor]]] = []

    def params(r: int) -> dict[str, torch.Tensor]:
        return dict(reps[r].named_parameters())

    def merge(f: int, avg: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n in frags[f]:
                if mode == "average":
                    new = avg[n]
                else:
                    mom[n] = mu * mom[n] + avg[n]
                    glob[n] = glob[n] - outer_lr * (avg[n] + mu * mom[n] if nesterov else mom[n])
                for r in range(WORLD):
                    p = params(r)[n]
                    p.copy_(alpha * p + (1 - alpha) * glob[n] if mode != "average" else new)

    for t in range(1, steps + 1):
        for r in range(WORLD):
            inner_step(reps[r], opts[r], t - 1, r)
            opts[r].step()
        for item in [i for i in pending if i[0] <= t]:
            pending.remove(item)
            merge(item[1], item[2])
        for f in range(fragments):
            if t % h != offsets[f]:
                continue
            if f == 0 and bn:
                for name, b in reps[0].named_buffers():
                    if b.is_floating_point():
                        mean = sum(dict(m.named_buffers())[name] for m in reps) / WORLD
                        for m in reps:
                            dict(m.named_buffers())[name].copy_(mean)
            with torch.no_grad():
                if mode == "average":
                    avg = {n: sum(params(r)[n] for r in range(WORLD)) / WORLD for n in frags[f]}
                else:
                    avg = {
                        n: sum(glob[n] - params(r)[n] for r in range(WORLD)) / WORLD
                        for n in frags[f]
                    }
            if delay == 0:
                merge(f, avg)
            else:
                pending.append((t + delay, f, avg))
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in reps]


def assert_matches(
    runs: list[dict[str, Any]], expected: list[dict[str, torch.Tensor]], steps: int
) -> None:
    for rank, (run, ref) in enumerate(zip(runs, expected)):
        assert run["state"].keys() == ref.keys()
        for k, v in ref.items():
            if v.is_floating_point():
                assert_close_eps(
                    run["state"][k], v, torch.float32, ops=8 * steps, msg=f"rank {rank} {k}"
                )


# --- localsgd ---------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["sgd", "sgd_momentum", "adamw"])
def test_localsgd_replicas_equal_the_reference_mid_period(inner: str) -> None:
    steps = 7  # H = 3: syncs after steps 3 and 6, the last step is local
    runs = run_distributed(rank_run, WORLD, "localsgd:sync_every=3", steps, inner)
    assert_matches(runs, reference(steps, h=3, mode="average", inner=inner), steps)
    assert not torch.equal(runs[0]["state"]["fc1.weight"], runs[1]["state"]["fc1.weight"])


def test_localsgd_every_step_with_plain_sgd_is_synchronous_sgd() -> None:
    # averaging w - lr*g_r over ranks = w - lr * mean(g_r): one SGD step on the mean gradient
    steps = 4
    runs = run_distributed(rank_run, WORLD, "localsgd:sync_every=1", steps, "sgd")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(
            nn.functional.cross_entropy(model(batch(step, r)[0]), batch(step, r)[1])
            for r in range(WORLD)
        )
        (loss / WORLD).backward()
        opt.step()
    for k, v in model.state_dict().items():
        for run in runs:
            assert_close_eps(run["state"][k], v, torch.float32, ops=8 * steps, msg=k)


def test_localsgd_sends_one_all_reduce_of_the_weights_per_period() -> None:
    steps, h = 8, 4
    runs = run_distributed(rank_run, WORLD, f"localsgd:sync_every={h}", steps)
    numel = sum(p.numel() for p in make_model().parameters())
    ring = 2 * (WORLD - 1) * 4 * numel // WORLD  # float32 ring all-reduce, bytes sent per worker
    for run in runs:
        assert run["by_tag"]["localsgd"] == (steps // h) * ring
    # rank 0 broadcasts the initial weights once
    assert runs[0]["by_tag"]["localsgd.init"] == 4 * numel
    assert "localsgd.init" not in runs[1]["by_tag"] or runs[1]["by_tag"]["localsgd.init"] == 0


def test_batchnorm_running_statistics_are_averaged_at_every_sync() -> None:
    steps = 4
    runs = run_distributed(rank_run, WORLD, "localsgd:sync_every=2", steps, "sgd", True)
    assert torch.equal(runs[0]["state"]["norm.running_mean"], runs[1]["state"]["norm.running_mean"])
    assert_matches(runs, reference(steps, h=2, mode="average", bn=True), steps)


# --- fragments and refusals --------------------------------------------------------------------


def test_fragments_are_contiguous_whole_layers_covering_the_model() -> None:
    model = make_model()
    for f in (1, 2, 3):
        frags = split_fragments(model, f)
        assert len(frags) == f and all(frags)
        assert [n for fr in frags for n in fr] == [n for n, _ in model.named_parameters()]
        for layer in layer_groups(model):
            assert sum(layer[0] in fr for fr in frags) == 1 and any(
                set(layer) <= set(fr) for fr in frags
            )


@pytest.mark.parametrize(
    "spec, words",
    [
        ("localsgd:sync_every=0", "sync_every=0"),
        ("diloco:sync_every=-3", "sync_every=-3"),
        ("diloco:outer_lr=0", "outer_lr"),
        ("diloco:outer_momentum=1", "outer_momentum"),
        ("diloco:global_on=gpu", "global_on"),
        ("diloco:compress=pufferfish", "payload compressor"),
        ("diloco:compress=(localsgd:sync_every=2)", "payload compressor"),
        ("diloco:compress=(topk:bogus=1)", "bogus"),
        ("streaming_diloco:sync_every=4,fragments=5", "fragments=5"),
        ("streaming_diloco:sync_every=4,delay=4", "delay=4"),
        ("streaming_diloco:alpha=1", "alpha"),
        ("localsgd:outer_lr=0.5", "unknown option"),
    ],
)
def test_invalid_options_are_refused_in_one_line(spec: str, words: str) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(spec)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_more_fragments_than_layers_is_refused_in_one_line() -> None:
    method = methods.create("streaming_diloco:sync_every=8,fragments=4")
    with pytest.raises(UsageError, match=r"fragments=4 is invalid for this model: it has 3 layers"):
        method.wrap(make_model(), MethodContext())


def test_cli_misuse_exits_2_with_the_one_line_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    common = [
        "train",
        "--model",
        "mlp",
        "--data",
        "mnist1d",
        "--nproc",
        "1",
        "--steps",
        "1",
        "--quiet",
    ]
    assert main([*common, "--no-progress", "--method", "localsgd:sync_every=0"]) == 2
    assert (
        main([*common, "--no-progress", "--method", "streaming_diloco:sync_every=8,fragments=5"])
        == 2
    )
    err = capsys.readouterr().err
    assert "sync_every=0" in err and "fragments=5 is invalid for this model: it has 3 layers" in err

"""Progressive shrinking on the trainer: phases, sub-networks per step, any method, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowcomm import models
from lowcomm.cli import main
from lowcomm.elastic.shrinking import MultiNet, Phase, default_phases_text, parse_phases, step_configs
from lowcomm.errors import UsageError
from lowcomm.testing import run_distributed
from tolerance import rel_err, tolerance

DIGITS = ["--model", "elastic_cnn2d", "--data", "digits", "--batch-size", "64", "--lr", "0.05",
          "--no-progress", "--quiet", "--bn-batches", "2", "--threads", "1"]


def _net() -> torch.nn.Module:
    return models.create("elastic_cnn2d", num_classes=10)


def test_phases_follow_ofa_order_and_skip_dimensions_the_supernet_lacks() -> None:
    dims = ("kernel", "expand", "depth", "width")
    phases = parse_phases("full:2,kernel:1,depth:1,expand:1", dims, subnets={"depth": 3})
    assert [p.name for p in phases] == ["full", "kernel", "depth", "expand"]
    assert phases[0].elastic == () and phases[1].elastic == ("kernel",)
    assert phases[2].elastic == ("kernel", "depth") and phases[2].subnets == 3
    assert set(phases[3].elastic) == {"kernel", "depth", "expand", "width"} and phases[3].subnets == 4
    assert default_phases_text(dims, 16).startswith("full:") and "scales" not in default_phases_text(dims, 16)


@pytest.mark.parametrize("text, message", [
    ("kernel:1,full:1", "out of order"),
    ("full:1,scales:1", "no 'scales'"),
    ("full:0", "epochs must be >= 1"),
    ("full:x", "whole number"),
    ("warp:1", "unknown phase"),
])
def test_bad_phases_are_refused_with_the_valid_ones(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_phases(text, ("kernel", "expand", "depth", "width"))


def test_unknown_phase_in_subnets_is_refused() -> None:
    with pytest.raises(UsageError, match="--subnets: unknown phase"):
        parse_phases("full:1", ("kernel",), subnets={"kernal": 2})


def test_every_rank_draws_the_same_subnetworks_and_each_step_new_ones() -> None:
    net = _net()
    phase = Phase("expand", 1, ("kernel", "depth", "expand", "width"), 4)
    a = step_configs(net, phase, seed=0, step=7)
    assert a == step_configs(net, phase, seed=0, step=7)  # what another rank computes
    assert len(a) == 4 and a != step_configs(net, phase, seed=0, step=8)
    assert step_configs(net, Phase("full", 1, (), 1), 0, 3) == [net.space.max_config()]


def test_sandwich_adds_the_phase_smallest_subnetwork_to_every_step() -> None:
    net = _net()
    space = net.space
    kernel = Phase("kernel", 1, ("kernel",), 1)
    plain = step_configs(net, kernel, seed=0, step=5)
    with_min = step_configs(net, kernel, seed=0, step=5, sandwich=True)
    assert with_min[1:] == plain  # the random draws are unchanged
    smallest = with_min[0]
    assert smallest["kernel"] == space.min_config()["kernel"]
    assert all(smallest[d] == space.max_config()[d] for d in space.names if d != "kernel")  # not yet elastic
    every = Phase("expand", 1, tuple(space.names), 2)
    assert step_configs(net, every, seed=1, step=0, sandwich=True)[0] == space.min_config()
    assert step_configs(net, Phase("full", 1, (), 1), 0, 3, sandwich=True) == [space.max_config()]


def test_one_forward_trains_several_subnetworks_and_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(0)
    net = _net()
    multi = MultiNet(net).train()
    space = net.space
    multi.configs = [space.min_config(), space.max_config()]
    out = multi(torch.randn(8, 64))
    assert len(out["outputs"]) == 2 and out["teacher"] is None
    loss = sum(o.square().mean() for o in out["outputs"]) + out["touch"]
    loss.backward()
    assert all(p.grad is not None for p in multi.parameters())
    assert float(out["touch"].detach()) == 0.0


def test_the_sum_of_subnetwork_losses_has_the_gradient_of_separate_backward_passes() -> None:
    torch.manual_seed(1)
    net = _net()
    x = torch.randn(16, 64)
    configs = [net.space.sample(__import__("random").Random(s)) for s in range(3)]
    multi = MultiNet(net).train()
    multi.configs = configs
    out = multi(x)
    (sum(o.sum() for o in out["outputs"]) + out["touch"]).backward()
    joint = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    for c in configs:  # OFA: one backward per sub-network, gradients accumulated
        net.set_active(c)
        net(x).sum().backward()
    for g, p in zip(joint, net.parameters()):
        ref = p.grad if p.grad is not None else torch.zeros_like(g)
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def _train(tmp_path: Path, *extra: str, name: str = "run") -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["elastic", "train", *DIGITS, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_progressive_shrinking_writes_a_supernet_whose_phases_all_trained(tmp_path: Path) -> None:
    s = _train(tmp_path, "--phases", "full:1,kernel:1,depth:1,expand:1", "--subnets", "depth=2,expand=2",
               "--steps", "8", "--out", str(tmp_path / "net.pt"))
    assert [p["name"] for p in s["phases"]] == ["full", "kernel", "depth", "expand"]
    assert [p["steps"] for p in s["phases"]] == [8, 8, 8, 8]
    assert 0.0 <= s["final_test_accuracy"] <= 1.0 and "test_accuracy_min" in s["phases"][-1]["final"]
    assert s["final_test_accuracy"] > 0.3  # digits after 32 steps: far above chance (0.1)
    from lowcomm.elastic.artifacts import load_supernet

    net, blob = load_supernet(tmp_path / "net.pt")
    assert blob["model"] == "elastic_cnn2d" and len(blob["summary"]["phases"]) == 4


def test_scratch_trains_one_subnetwork_as_a_plain_module(tmp_path: Path) -> None:
    s = _train(tmp_path, "--steps", "5", "--scratch", "min", "--out", str(tmp_path / "sub.pt"))
    assert s["mode"] == "scratch" and s["phases"][0]["name"] == "scratch"
    from lowcomm.elastic.artifacts import load_subnet

    sub, blob = load_subnet(tmp_path / "sub.pt")
    assert blob["config"] == models.create("elastic_cnn2d").space.min_config()
    assert not any("Elastic" in type(m).__name__ for m in sub.modules())


def test_stop_and_resume_continues_the_phases_exactly(tmp_path: Path) -> None:
    args = ["--phases", "full:1,kernel:1,depth:1", "--steps", "4", "--checkpoint-dir"]
    straight = _train(tmp_path, *args, str(tmp_path / "a"), "--out", str(tmp_path / "a.pt"), name="a")
    first = _train(tmp_path, *args, str(tmp_path / "b"), "--stop-after-steps", "6", name="b1")
    assert first["stopped_in_phase"] == "kernel"
    resumed = _train(tmp_path, *args, str(tmp_path / "b"), "--resume", "--out", str(tmp_path / "b.pt"), name="b2")
    assert resumed["final_test_accuracy"] == straight["final_test_accuracy"]
    a = torch.load(tmp_path / "a.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "b.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _two_rank_body(method: str) -> list[float]:
    import torch.distributed as dist

    from lowcomm.elastic.config import ElasticConfig
    from lowcomm.elastic.train import ElasticTrainer
    from lowcomm.runtime.config import TrainConfig

    cfg = TrainConfig(model="elastic_cnn2d", data="digits", method=method, nproc=2, steps=6, batch_size=32,
                      lr=0.05, progress=False, eval=False, threads=1)
    phase = Phase("depth", 1, ("kernel", "depth", "expand", "width"), 2)
    trainer = ElasticTrainer(cfg, ElasticConfig(train=cfg, phases=[phase.to_json()], bn_batches=1), phase)
    assert trainer.supernet is not None
    before = torch.cat([p.detach().flatten().clone() for p in trainer.supernet.parameters()])
    trainer.run()
    trainer.close()
    after = torch.cat([p.detach().flatten() for p in trainer.supernet.parameters()])
    gathered = [torch.zeros_like(after) for _ in range(2)]
    dist.all_gather(gathered, after)
    return [float((after - before).abs().max()), rel_err(gathered[1], gathered[0])]


@pytest.mark.parametrize("method", ["ssgd", "powersgd", "dear", "topk"])
def test_two_workers_train_the_same_supernet_with_any_method(method: str) -> None:
    # gloo may sum in a different order on each rank: the ranks agree to float32 rounding over
    # 6 steps, far below one step's update (a rank that diverged would differ by ~lr * grad)
    for moved, disagreement in run_distributed(_two_rank_body, 2, method, timeout=240):
        assert moved > 1e-3 and disagreement <= tolerance(torch.float32, ops=100)


def test_a_model_axis_method_is_refused_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["elastic", "train", *DIGITS, "--epochs", "1", "--method", "pufferfish"])
    assert code == 2
    assert "model axis" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--model", "cnn1d"], "not an elastic supernet"),
    (["--phases", "full:1,scales:1"], "no 'scales'"),
    (["--scratch", '{"kernel": [4]}'], "kernel"),
    (["--subnets", "depth=two"], "whole number"),
])
def test_misuse_is_one_line_and_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["elastic", "train", *DIGITS, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_the_same_machinery_trains_an_elastic_classifier_on_cifar_files(tmp_path: Path) -> None:
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({b"labels": rng.integers(0, 10, 4).tolist(),
                         b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8)}, f)
    out = tmp_path / "c.json"
    assert main(["elastic", "train", "--model", "elastic_cnn2d", "--data", "cifar10", "--data-dir", str(tmp_path),
                 "--phases", "full:1,kernel:1", "--steps", "2", "--batch-size", "4", "--no-progress", "--quiet",
                 "--threads", "1",
                 "--bn-batches", "1", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["data"] == "cifar10" and len(s["phases"]) == 2 and 0.0 <= s["final_test_accuracy"] <= 1.0

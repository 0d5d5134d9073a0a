"""Emulated compute (``--compute emulated:...``): layers wait a profile's times, the rest is real.

What must hold, without any timing assert (the waits are 1 ms; whether the emulated time
matches the profile is benchmarks/emulated_compute.py's business, on a quiet machine):

* the emulated model has the real model's parameter names, shapes and module objects, and its
  output has the real output's shape; restoring it gives the real forward back;
* gradients arrive in reverse forward order with the parameters' shapes;
* two ranks training with emulated compute (ssgd through DDP's hooks, dear through the
  engine's per-module forward pre-hooks) finish with equal parameters that moved; the gradients
  differ per rank, so equality comes from the communication;
* a profile that does not describe the model, a bad ``--compute`` and a run the emulation
  cannot serve are one-line usage errors (exit 2 from the CLI); the summary carries the label.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from compress_testlib import run_ranks
from lowcomm.cli import main
from lowcomm.errors import UsageError
from lowcomm.runtime.compute_spec import parse_compute
from lowcomm.runtime import timing
from lowcomm.runtime.emulated import emulate, emulation_of, restore, scaled
from lowcomm.sim.profile import LayerProfile, Profile
from lowcomm.sim.profiler import parameter_layers

WAIT_S = 0.001


def _mlp() -> torch.nn.Module:
    from lowcomm import models

    torch.manual_seed(0)
    return models.create("mlp", input_dim=40, num_classes=10)


def _profile(model: torch.nn.Module, *, batch_size: int = 8) -> Profile:
    """A profile of ``model``'s layers (registration order is the MLP's forward order)."""
    layers = [LayerProfile(name, WAIT_S, WAIT_S, [list(p.shape) for p in ps])
              for name, _, ps in parameter_layers(model)]
    return Profile(model="mlp", batch_size=batch_size, layers=layers)


def test_emulated_model_keeps_parameter_names_shapes_and_output_shape() -> None:
    model = _mlp()
    x = torch.randn(8, 40)
    real_out = model(x)
    before = {n: (p, p.shape) for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    emulate(model, _profile(model), x)
    assert {n: (p, p.shape) for n, p in model.named_parameters()} == before
    assert dict(model.named_modules()) == modules
    out = model(x)
    assert out.shape == real_out.shape and out.requires_grad
    restore(model)
    assert torch.equal(model(x), real_out)


def test_gradients_arrive_in_reverse_forward_order_with_the_parameter_shapes() -> None:
    model = _mlp()
    profile = _profile(model)
    emulate(model, profile, torch.randn(1, 40))
    order: list[str] = []
    for name, _, params in parameter_layers(model):
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    torch.nn.functional.cross_entropy(model(torch.randn(8, 40)), torch.randint(0, 10, (8,))).backward()
    layers = [layer.name for layer in profile.layers]
    assert list(dict.fromkeys(order)) == layers[::-1]
    assert all(p.grad is not None and p.grad.shape == p.shape and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_forward_pre_hooks_of_the_layers_fire_in_forward_order() -> None:
    model = _mlp()
    emulate(model, _profile(model), torch.randn(1, 40))
    seen: list[str] = []
    for name, module, _ in parameter_layers(model):
        module.register_forward_pre_hook(lambda m, a, name=name: seen.append(name))
    model(torch.randn(4, 40))
    assert seen == ["fc1", "fc2", "fc"]


def test_compression_reported_as_device_work_pushes_the_remaining_deadlines_back() -> None:
    """A GPU queues the hooks' compression kernels behind backward's: host-side compression
    must delay the emulated layers that follow it, not fill their waits."""
    model = _mlp()
    emulate(model, _profile(model), torch.randn(1, 40))
    clock = emulation_of(model).clock
    before = {p: timing.timer().get(p) for p in ("compress", "comm_wait")}
    clock.start_forward()
    fwd, bwd = clock.forward_deadline(2), clock.backward_deadline(0)
    timing.add("comm_wait", 0.25)  # not device work: the deadlines stay
    assert clock.forward_deadline(2) == fwd and clock.backward_deadline(0) == bwd
    with timing.measure("compress"):
        pass
    timing.add("compress", 0.5)
    assert clock.forward_deadline(2) - fwd >= 0.5
    assert clock.backward_deadline(0) - bwd == pytest.approx(clock.forward_deadline(2) - fwd, abs=1e-9)
    for phase, seconds in before.items():  # the process-wide timer as it was (no fake step kept)
        timing.timer().set(phase, seconds)
    restore(model)


def test_a_sharded_update_reported_from_a_hook_pushes_the_deadlines_back_too() -> None:
    """DeAR's per-group update before a layer's forward and lee18's shard update in backward
    are optimizer kernels on a GPU's stream: reported as ``optimizer``, they delay the layers."""
    model = _mlp()
    emulate(model, _profile(model), torch.randn(1, 40))
    clock = emulation_of(model).clock
    before = timing.timer().get("optimizer")
    clock.start_forward()
    fwd = clock.forward_deadline(2)
    timing.add("optimizer", 0.5)
    assert clock.forward_deadline(2) - fwd == pytest.approx(0.5)
    timing.timer().set("optimizer", before)
    restore(model)


def test_a_layer_waiting_for_its_all_gather_computes_after_it_not_under_it() -> None:
    """DeAR/lee18 wait in a forward pre-hook for the all-gather the layer needs: on a GPU the
    layer's kernels run after that wait, so the remaining deadlines follow the wait's end."""
    model = _mlp()
    emulate(model, _profile(model), torch.randn(1, 40))
    clock = emulation_of(model).clock
    clock.start_forward()
    t0 = clock.forward_t0
    clock.forward_done = 0  # layer 0's forward is over
    late = t0 + clock.forward_end[0] + 5.0  # the next layer's all-gather arrives 5 s late
    clock.waited(late)
    assert clock.forward_deadline(1) == pytest.approx(late + clock.forward_s[1])
    assert clock.forward_deadline(2) == pytest.approx(late + clock.forward_s[1] + clock.forward_s[2])
    clock.waited(t0)  # a wait that ended before the deadlines moves nothing
    assert clock.forward_deadline(1) == pytest.approx(late + clock.forward_s[1])
    clock.start_forward()  # a new pass starts from its own clock
    assert clock.forward_done == -1
    before = clock.forward_deadline(0)
    timing.stream_waited()  # through the process-wide report: the wait ends now
    assert clock.forward_deadline(0) >= before
    restore(model)
    after = clock.forward_deadline(0)
    timing.stream_waited()  # a restored model no longer follows
    assert clock.forward_deadline(0) == after


def test_a_restored_model_no_longer_follows_device_work() -> None:
    model = _mlp()
    emulate(model, _profile(model), torch.randn(1, 40))
    clock = emulation_of(model).clock
    restore(model)
    clock.start_forward()
    compress = timing.timer().get("compress")
    before = clock.forward_deadline(0)
    timing.add("compress", 0.5)
    assert clock.forward_deadline(0) == before
    timing.timer().set("compress", compress)


def test_a_profile_of_another_model_names_the_first_mismatch() -> None:
    model = _mlp()
    profile = _profile(model)
    profile.layers[-1].param_shapes = [[100, 100], [100]]
    with pytest.raises(UsageError, match=r"layer 'fc' has parameter shapes \[\[10, 100\], \[10\]\] in the model"):
        emulate(model, profile, torch.randn(1, 40))
    profile.layers[0].name = "encoder"
    with pytest.raises(UsageError, match="the model's layer 'fc1' is not in the profile"):
        emulate(model, profile, torch.randn(1, 40))


def test_scale_divides_every_time_and_keeps_the_shapes() -> None:
    profile = _profile(_mlp())
    fast = scaled(profile, 20)
    assert fast.forward_s == pytest.approx(profile.forward_s / 20)
    assert fast.backward_s == pytest.approx(profile.backward_s / 20)
    assert [lay.param_shapes for lay in fast.layers] == [lay.param_shapes for lay in profile.layers]


@pytest.mark.parametrize("text, label", [("real", "real"), (None, "real"), ("emulated:scale=20", "emulated:scale=20")])
def test_compute_labels(text: str | None, label: str) -> None:
    assert parse_compute(text).label == label


def _write_profile(tmp_path: Path, batch_size: int = 16) -> Path:
    path = tmp_path / "mlp.json"
    _profile(_mlp(), batch_size=batch_size).save(path)
    return path


@pytest.mark.parametrize("compute, extra, message", [
    ("emulated", ["--no-eval"], "--compute 'emulated' is not valid; valid: real, emulated:PROFILE.json"),
    ("emulated:scale=0", ["--no-eval"], "scale=K needs a finite number K > 0"),
    ("emulated:missing.json", ["--no-eval"], "profile file 'missing.json' does not exist"),
    ("gpu", ["--no-eval"], "is not valid; valid: real"),
    ("PROFILE", [], "add --no-eval"),
    ("PROFILE", ["--no-eval", "--batch-size", "8"], "measured at batch 16 per worker but this run has --batch-size 8"),
    ("PROFILE", ["--no-eval", "--model", "cnn1d"], "does not describe this model"),
    ("emulated:scale=20", ["--no-eval", "--method", "torch_fsdp"], "cannot run torch_fsdp (FSDP gathers"),
])
def test_bad_compute_is_one_line_and_exit_2(tmp_path: Path, compute: str, extra: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    compute = compute.replace("PROFILE", f"emulated:{_write_profile(tmp_path)}")
    argv = ["train", "--model", "mlp", "--data", "mnist1d", "--batch-size", "16", "--steps", "1",
            "--no-progress", "--quiet", "--compute", compute, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_summary_says_which_compute_ran(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path)
    common = ["train", "--model", "mlp", "--data", "mnist1d", "--batch-size", "16", "--steps", "3",
              "--no-eval", "--no-progress", "--quiet", "--method", "nocomm"]
    assert main([*common, "--compute", f"emulated:{profile}", "--json", str(tmp_path / "e.json")]) == 0
    emulated = json.loads((tmp_path / "e.json").read_text())
    assert emulated["compute"] == f"emulated:{profile}"
    assert emulated["compute_profile"]["layers"] == 3 and emulated["compute_profile"]["batch_size"] == 16
    assert main([*common, "--json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["compute"] == "real"


def _train_two_ranks(method: str, profile_path: str) -> dict[str, Any]:
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(model="mlp", data="mnist1d", method=method, nproc=2, batch_size=16, lr=0.05, steps=3,
                      threads=1, progress=False, eval=False)
    cfg.compute = f"emulated:{profile_path}"
    trainer = Trainer(cfg)
    before = torch.cat([p.detach().reshape(-1).clone() for p in trainer.raw.parameters()])
    summary = trainer.run()
    after = torch.cat([p.detach().reshape(-1) for p in trainer.raw.parameters()])
    gathered = [torch.empty_like(after) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, after)
    trainer.close()
    return {"steps": summary["steps"], "compute": summary["compute"], "moved": not torch.equal(before, after),
            "agree": all(torch.equal(gathered[0], g) for g in gathered[1:])}


@pytest.mark.parametrize("method", ["ssgd", "dear"])
def test_two_ranks_train_with_emulated_compute_and_agree(method: str, tmp_path: Path) -> None:
    path = str(_write_profile(tmp_path))
    for result in run_ranks(_train_two_ranks, 2, method, path, timeout=120):
        assert result["steps"] == 3 and result["compute"] == f"emulated:{path}"
        assert result["moved"] and result["agree"], result


def test_nocomm_ranks_drift_apart_because_gradients_differ_per_rank(tmp_path: Path) -> None:
    path = str(_write_profile(tmp_path))
    result = run_ranks(_train_two_ranks, 2, "nocomm", path, timeout=120)[0]
    assert result["moved"] and not result["agree"]


def _bench_launcher(seen: list[list[str]]) -> Any:
    def launch(worker_args: list[str], nproc: int, **kw: Any) -> int:
        seen.append(list(worker_args))
        path = Path(worker_args[worker_args.index("--json") + 1])
        path.write_text(json.dumps({"iter_time_s_median": 0.1, "bytes_per_worker_per_iter": 0.0,
                                    "breakdown_s": {"forward": 0.05, "backward": 0.05}, "history": []}))
        return 0
    return launch


def test_bench_passes_compute_to_every_worker_and_labels_every_row(tmp_path: Path) -> None:
    from lowcomm.bench import cli as bench_cli
    from lowcomm.bench import harness
    from lowcomm.cli import build_parser

    args = build_parser().parse_args(["bench", "--nproc", "2", "--model", "cnn1d", "--methods", "ssgd,dear",
                                      "--net", "none", "--no-predict", "--quiet", "--work-dir", str(tmp_path),
                                      "--compute", "emulated:scale=20"])
    seen: list[list[str]] = []
    result = harness.run_bench(bench_cli.build_config(args), launcher=_bench_launcher(seen))
    assert result["compute"] == "emulated:scale=20"
    assert {r["compute"] for r in result["runs"]} == {"emulated:scale=20"} and len(result["runs"]) == 3
    assert all(a[a.index("--compute") + 1] == "emulated:scale=20" for a in seen)


@pytest.mark.parametrize("extra, message", [
    (["--compute", "emulated:scale=20", "--epochs", "2"], "drop --epochs"),
    (["--compute", "emulated:scale=-1"], "scale=K needs a finite number K > 0"),
    (["--compute", "PROFILE", "--batch-size", "32"], "use --batch-size 16"),
])
def test_bench_refuses_bad_compute_in_one_line(tmp_path: Path, extra: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    extra = [e.replace("PROFILE", f"emulated:{_write_profile(tmp_path)}") for e in extra]
    assert main(["bench", "--nproc", "2", "--methods", "ssgd", "--net", "none", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private cache folder for profiles, with the data set linked in (not generated again)."""
    from lowcomm.data.cache import cache_dir

    for data in cache_dir(None).glob("mnist1d-*.npz"):
        (tmp_path / data.name).symlink_to(data)
    monkeypatch.setenv("LOWCOMM_CACHE_DIR", str(tmp_path))


def test_scale_profiles_the_model_as_the_method_trains_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _own_cache(tmp_path, monkeypatch)
    argv = ["train", "--model", "mlp", "--data", "mnist1d", "--batch-size", "16", "--steps", "2", "--no-eval",
            "--no-progress", "--quiet", "--threads", "1", "--method", "pufferfish:warmup_epochs=0",
            "--compute", "emulated:scale=1000", "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0
    used = json.loads((tmp_path / "p.json").read_text())["compute_profile"]
    layers = json.loads(Path(used["source"]).read_text())["layers"]
    assert used["layers"] == len(layers) == 5 and layers[0]["name"] == "fc1.v"  # the factorized MLP


def test_scale_profile_is_measured_once_by_rank_0_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _own_cache(tmp_path, monkeypatch)
    for _ in range(2):  # the second run reads the cache
        results = run_ranks(_train_two_ranks, 2, "ssgd", "scale=1000", timeout=120)
        assert all(r["agree"] and r["moved"] and r["compute"] == "emulated:scale=1000" for r in results)
    assert len(list((tmp_path / "profiles").glob("mlp-b16-*.json"))) == 1

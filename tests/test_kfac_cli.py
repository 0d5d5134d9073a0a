"""``lowcomm train --optimizer kfac[:key=value,...]``: parsing, refusals, the trainer's wiring
(end-to-end on 2 workers, exact resume with DP-KFAC, Pufferfish's re-wrap, a skipped
non-finite step)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowcomm import methods
from lowcomm.cli import main
from lowcomm.errors import UsageError
from lowcomm.optim.kfac_spec import KFACOptions, option_names
from lowcomm.runtime import checkpoint
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.kfac_hook import KFACRun
from lowcomm.testing import distributed

methods.names()  # load the method modules before forking

FAST = ["--model", "mlp", "--data", "mnist1d", "--nproc", "2", "--batch-size", "128", "--lr", "0.05",
        "--threads", "1", "--quiet", "--no-progress"]


def _resolved(spec: str) -> TrainConfig:
    cfg = TrainConfig(optimizer=spec)
    cfg.validate()
    return cfg


# --- parsing --------------------------------------------------------------------------------
def test_kfac_spec_becomes_the_base_optimizer_plus_kfac_options() -> None:
    cfg = _resolved("kfac:factor_update_steps=1,inv_update_steps=2,damping=0.01,kl_clip=none,"
                    "pipeline=false,compute=inverse,skip_layers=fc1|(fc|xx)2,base=adamw")
    assert cfg.optimizer == "adamw"
    assert cfg.kfac is not None
    expected = {"factor_update_steps": 1, "inv_update_steps": 2, "damping": 0.01, "kl_clip": None,
                "pipeline": False, "compute": "inverse", "skip_layers": ["fc1", "(fc|xx)2"]}
    assert {k: cfg.kfac[k] for k in expected} == expected
    assert set(cfg.kfac) == set(option_names()) - {"base"}  # every key set: the run's record is complete
    cfg.validate()  # idempotent: the trainer resolves again
    assert cfg.optimizer == "adamw" and cfg.kfac["skip_layers"] == ["fc1", "(fc|xx)2"]
    plain = _resolved("kfac")
    assert plain.optimizer == "sgd" and plain.kfac is not None
    assert _resolved("sgd").kfac is None and _resolved("adamw").optimizer == "adamw"


def test_cli_defaults_are_kfacs_own() -> None:
    from lowcomm.optim import KFAC
    from lowcomm.optim.kfac import KFAC as KFACClass

    assert KFAC is KFACClass
    params = inspect.signature(KFAC).parameters
    for f in dataclasses.fields(KFACOptions):
        if f.name == "skip_layers":
            assert params[f.name].default == ()
        elif f.name != "base":
            assert params[f.name].default == f.default, f.name


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("kfac:nosuch=1", ["'nosuch'", "--optimizer kfac", "valid:", "factor_update_steps", "damping"]),
        ("kfac:damping=abc", ["damping", "float"]),
        ("kfac:damping=0", ["--optimizer kfac", "damping", "> 0"]),
        ("kfac:damping=nan", ["damping"]),
        ("kfac:factor_update_steps=0", ["factor_update_steps"]),
        ("kfac:inv_update_steps=2.5", ["inv_update_steps", "int"]),
        ("kfac:factor_decay=1", ["factor_decay"]),
        ("kfac:compute=magic", ["compute", "eigen", "inverse"]),
        ("kfac:placement=random", ["placement", "balanced"]),
        ("kfac:grad_worker_fraction=0", ["grad_worker_fraction"]),
        ("kfac:pipeline=maybe", ["pipeline"]),
        ("kfac:local_inverse_below=-1", ["local_inverse_below"]),
        ("kfac:base=adam", ["base='adam'", "sgd", "adamw", "lars", "lamb"]),
        ("kfac:lr=0.1", ["lr", "--lr"]),
        ("kfac:accumulation_steps=2", ["accumulation_steps", "one batch per optimizer step"]),
        ("kfac:damping", ["key=value"]),
        ("adam", ["--optimizer", "'adam'", "kfac[:key=value,...]"]),
        ("sgd:momentum=0", ["--optimizer sgd takes no options"]),
    ],
)
def test_bad_kfac_specs_are_usage_errors_naming_the_key(spec: str, fragments: list[str]) -> None:
    with pytest.raises(UsageError) as e:
        _resolved(spec)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert "method" not in str(e.value)  # the method parser's wording is rewritten


def test_kfac_options_from_python_are_checked_too() -> None:
    cfg = TrainConfig(kfac={"damping": 0.01, "skip_layers": "fc"})
    cfg.validate()
    assert cfg.kfac is not None and cfg.kfac["damping"] == 0.01 and cfg.kfac["skip_layers"] == ["fc"]
    with pytest.raises(UsageError, match="unknown option 'dampng'"):
        TrainConfig(kfac={"dampng": 0.01}).validate()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--optimizer", "kfac:nosuch=1"], "nosuch"),
        (["--optimizer", "kfac:damping=-1"], "damping"),
        (["--optimizer", "kfac", "--method", "dear"], "dear holds the averaged gradient as shards"),
        (["--optimizer", "kfac", "--method", "lee18"], "lee18 holds the averaged gradient as shards"),
        (["--optimizer", "kfac", "--method", "pufferfish:warmup_epochs=1,then=dear"], "dear holds"),
        (["--optimizer", "kfac", "--method", "torch_fsdp", "--no-eval"], "FSDP"),
        (["--optimizer", "kfac:grad_worker_fraction=0.75"], "--optimizer kfac: grad_worker_fraction=0.75 on 2"),
    ],
)
def test_cli_refuses_in_one_line_exit_2(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *FAST, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_trainer_refuses_sharded_methods_from_python_too() -> None:
    for spec in ("dear", "lee18"):
        with pytest.raises(UsageError, match="K-FAC preconditions"):
            KFACRun(TrainConfig(method=spec, optimizer="kfac"), methods.create(spec))
    for spec in ("ssgd", "wfbp", "mgwfbp", "acpsgd", "pufferfish:then=wfbp"):  # p.grad holds the mean
        assert KFACRun(TrainConfig(method=spec, optimizer="kfac"), methods.create(spec)).active
    assert not KFACRun(TrainConfig(), methods.create("ssgd")).active


# --- the trainer ----------------------------------------------------------------------------
def test_two_worker_run_trains_with_kfac_and_reports_its_phase_and_traffic(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = [*FAST, "--epochs", "1", "--optimizer", "kfac:factor_update_steps=1,inv_update_steps=2",
            "--json", str(out)]
    assert main(["train", *argv]) == 0
    s = json.loads(out.read_text())
    assert s["world_size"] == 2 and s["optimizer"]["name"] == "sgd"
    assert s["optimizer"]["kfac"]["factor_update_steps"] == 1
    assert s["final_test_accuracy"] > 0.2  # 10 classes: chance is 0.1
    assert "kfac" in s["breakdown_s"] and s["breakdown_s"]["kfac"] > 0
    tags = s["traffic"]["by_tag"]
    assert tags["kfac.A"]["wire_bytes"] > 0 and tags["kfac.G"]["wire_bytes"] > 0


def _final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    manifest = checkpoint.latest(str(ckpt_dir))
    assert manifest is not None
    return checkpoint.load_rank(str(ckpt_dir), manifest["step"], 0)["model"]


@distributed(world_size=2)
def test_interrupted_dp_kfac_run_resumes_exactly(tmp_path: Path) -> None:
    """DP-KFAC (fraction 1/2) with every factor owned (local_inverse_below=0): the checkpoint's
    K-FAC state is gathered from the owners on every rank, and the resumed run is bit-equal.
    (The trainer in-process on 2 forked ranks: the CLI path is the test above's.)"""
    from lowcomm.runtime.trainer import Trainer

    def train(ckpt: Path, **kw: object) -> None:
        cfg = TrainConfig(model="mlp", data="mnist1d", nproc=2, batch_size=128, lr=0.05, epochs=1,
                          eval=False, progress=False, threads=1, checkpoint_dir=str(ckpt),
                          optimizer="kfac:factor_update_steps=1,inv_update_steps=3,"
                                    "grad_worker_fraction=0.5,local_inverse_below=0", **kw)  # type: ignore[arg-type]
        trainer = Trainer(cfg)
        trainer.run()
        trainer.close()

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight)
    # 16 steps per epoch: stop at step 7 (not an inverse step), then resume to the end
    train(resumed, stop_after_steps=7)
    saved = checkpoint.load_rank(str(resumed), 7, 1)["kfac"]
    assert saved["steps"] == 7 and set(saved["layers"]) == {"fc1", "fc2", "fc"}
    assert len(saved["decompositions"]) == 6  # every layer's A and G, gathered on rank 1 too
    train(resumed, resume=True)
    a, b = _final_weights(straight), _final_weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@distributed(world_size=2)
def test_pufferfish_switch_rebuilds_kfac_on_the_factorized_layers() -> None:
    from lowcomm.optim.kfac import KFAC
    from lowcomm.runtime.trainer import Trainer

    removed: list[KFAC] = []
    remove = KFAC.remove
    KFAC.remove = lambda self: (removed.append(self), remove(self))[1]  # type: ignore[method-assign]
    cfg = TrainConfig(model="mlp", data="mnist1d", method="pufferfish:warmup_epochs=1", nproc=2,
                      batch_size=256, epochs=2, lr=0.05, optimizer="kfac:factor_update_steps=1,inv_update_steps=2",
                      eval=False, progress=False, threads=1)
    trainer = Trainer(cfg)
    assert trainer.kfac.kfac is not None
    before = [layer.name for layer in trainer.kfac.kfac.layers]
    trainer.run()
    trainer.close()
    after = trainer.kfac.kfac
    assert before == ["fc1", "fc2", "fc"]
    assert len(removed) == 1 and removed[0] is not after and not removed[0]._handles
    names = [layer.name for layer in after.layers]
    assert "fc" in names and any(n.startswith("fc1.") for n in names), names  # each factor its own layer
    assert after.steps == trainer.step - trainer.steps_per_epoch  # fresh at the switch


@distributed(world_size=2)
def test_a_skipped_nonfinite_step_leaves_weights_and_factors_unchanged() -> None:
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(model="mlp", data="mnist1d", method="acpsgd:start_iter=1,rank=2", nproc=2,
                      batch_size=32, steps=5, eval=False, progress=False, threads=1,
                      optimizer="kfac:factor_update_steps=1,inv_update_steps=1,factor_decay=0.5")
    trainer = Trainer(cfg)
    kfac = trainer.kfac.kfac
    assert kfac is not None
    batches = trainer.train_batches.epoch(0)
    bad_step = 3
    for step in range(5):
        x, y = next(batches)
        if step == bad_step and dist.get_rank() == 0:
            x = x.clone()
            x[0, 0] = float("nan")
        weights = [p.detach().clone() for p in trainer.raw.parameters()]
        factors = [t.clone() for t in kfac.state_dict()["factors"]["fc2"].values() if t is not None]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            trainer.train_step(x, y)
        moved = any(not torch.equal(a, b) for a, b in zip(trainer.raw.parameters(), weights))
        assert moved == (step != bad_step), step
        if step > 0:  # the factors exist from the first step on
            kept = all(torch.equal(a, b) for a, b in zip(kfac.state_dict()["factors"]["fc2"].values(), factors))
            assert len(factors) == 2 and kept == (step == bad_step), step
        assert all(torch.isfinite(p).all() for p in trainer.raw.parameters())
    assert kfac.steps == 5  # stepped on the skipped step too
    trainer.close()


@distributed(world_size=2)
def test_fp16_amp_run_with_kfac_stays_finite_and_moves() -> None:
    """Under autocast the factors stay float32 (the forward hook turns autocast off)."""
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(model="mlp", data="mnist1d", nproc=2, batch_size=128, steps=6, amp="fp16",
                      eval=False, progress=False, threads=1,
                      optimizer="kfac:factor_update_steps=1,inv_update_steps=2")
    trainer = Trainer(cfg)
    assert trainer.scaler is not None and trainer.kfac.kfac.grad_scaler is trainer.scaler
    before = [p.detach().clone() for p in trainer.raw.parameters()]
    trainer.run()
    trainer.close()
    after = list(trainer.raw.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    assert all(st.a is None or st.a.dtype == torch.float32 for st in trainer.kfac.kfac._factors.values())

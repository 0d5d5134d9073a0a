"""A method that needs other optimizer settings than the trainer's defaults gets them.

Signum carries its own momentum inside the hook; with the trainer's default SGD momentum 0.9
on top it lost 37 points on MNIST-1D against ``ssgd``. With default settings the trainer now
turns SGD momentum off and scales the learning rate by 1 + momentum (one notice); settings
the user typed are kept, with a warning. Fast: config and optimizer only, no training run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lowcomm import methods
from lowcomm.cli import build_parser
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.errors import UsageError
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.flags import explicit_train_flags
from lowcomm.optim import apply_method_overrides, build_optimizer
from lowcomm.runtime.train_cli import config_from_args


def _cli_config(*argv: str) -> TrainConfig:
    """The TrainConfig that ``lowcomm train ARGV`` gives every worker."""
    args = build_parser().parse_args(["train", *argv])
    args._argv = ["train", *argv]
    return config_from_args(args)


def _optimizer(cfg: TrainConfig) -> tuple[torch.optim.Optimizer, list[str]]:
    lines = apply_method_overrides(cfg, methods.create(cfg.method))
    return build_optimizer(cfg, nn.Linear(4, 2)), lines


def test_signum_with_default_cli_settings_gets_no_sgd_momentum_and_rescaled_lr() -> None:
    default = TrainConfig()
    opt, lines = _optimizer(_cli_config("--method", "signum"))
    group = opt.param_groups[0]
    assert group["momentum"] == 0.0
    assert group["lr"] == pytest.approx(default.lr * (1 + default.momentum))  # same stability limit
    assert len(lines) == 1 and "--momentum 0.9 -> 0" in lines[0] and "inside its hook" in lines[0]


def test_signum_refuses_an_explicit_sgd_momentum_with_the_fix() -> None:
    with pytest.raises(UsageError, match=r"--momentum 0.9: .*compound.*use --momentum 0"):
        _optimizer(_cli_config("--method", "signum", "--momentum", "0.9"))


def test_signum_with_explicit_momentum_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    code = main(["train", "--model", "mlp", "--data", "digits", "--steps", "1", "--method", "signum",
                 "--momentum", "0.5", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "use --momentum 0" in err[0]


def test_signum_with_explicit_lr_turns_momentum_off_but_keeps_the_lr() -> None:
    opt, lines = _optimizer(_cli_config("--method", "signum:momentum=0.8", "--lr", "0.05"))
    assert opt.param_groups[0]["momentum"] == 0.0 and opt.param_groups[0]["lr"] == 0.05
    assert "--momentum 0.9 -> 0" in lines[0] and "momentum 0.8 inside its hook" in lines[0]
    assert lines[1].startswith("warning:") and "keeping --lr 0.05" in lines[1]


def test_signum_with_momentum_zero_or_adamw_changes_nothing() -> None:
    for argv in (("--momentum", "0", "--lr", "0.5"), ("--optimizer", "adamw")):
        cfg = _cli_config("--method", "signum", *argv)
        before = cfg.to_dict()
        assert apply_method_overrides(cfg, methods.create(cfg.method)) == []
        assert cfg.to_dict() == before


def _own_momentum(name: str) -> bool:
    """A codec keeps its own momentum when it declares a ``momentum`` option (what
    :meth:`lowcomm.methods.compression.CompressionMethod.optimizer_overrides` reads)."""
    return any(f.name == "momentum" for f in dataclasses.fields(codec_class(name).Options))


#: ssgd and every registered codec, a codec with its own momentum with it turned off
WITHOUT_OWN_MOMENTUM = ["ssgd", *(f"{n}:momentum=0" if _own_momentum(n) else n for n in CODECS.names())]
WITH_OWN_MOMENTUM = [n for n in CODECS.names() if _own_momentum(n)]


@pytest.mark.parametrize("method", WITHOUT_OWN_MOMENTUM)
def test_methods_without_their_own_momentum_keep_the_trainer_defaults(method: str) -> None:
    cfg = _cli_config("--method", method)
    assert apply_method_overrides(cfg, methods.create(method)) == []
    assert (cfg.lr, cfg.momentum) == (TrainConfig().lr, TrainConfig().momentum)


@pytest.mark.parametrize("method", WITH_OWN_MOMENTUM)
def test_every_codec_with_its_own_momentum_turns_sgd_momentum_off_by_default(method: str) -> None:
    opt, lines = _optimizer(_cli_config("--method", method))
    assert opt.param_groups[0]["momentum"] == 0.0
    assert len(lines) == 1 and "--momentum 0.9 -> 0" in lines[0]


def test_the_momentum_cases_cover_every_codec() -> None:
    assert WITH_OWN_MOMENTUM  # signum's case is checked in detail above
    assert len(WITHOUT_OWN_MOMENTUM) == 1 + len(CODECS.names())


def test_explicit_flags_count_abbreviations_and_equals_forms_like_argparse() -> None:
    assert explicit_train_flags(["train", "--mom", "0.5", "--lr=0.3"]) == ["lr", "momentum"]
    assert explicit_train_flags(["train", "--method", "signum"]) == ["method"]
    assert explicit_train_flags(None) == []


def test_an_unparsable_command_line_counts_every_option_as_typed() -> None:
    flags = explicit_train_flags(["train", "--momentum", "not-a-number"])
    assert "momentum" in flags and "lr" in flags  # nothing would be overridden


def test_pufferfish_with_a_signum_warm_up_gets_signums_settings_for_the_whole_run() -> None:
    opt, lines = _optimizer(_cli_config("--method", "pufferfish:warmup_method=signum,warmup_epochs=1"))
    assert opt.param_groups[0]["momentum"] == 0.0
    assert len(lines) == 1 and "--momentum 0.9 -> 0" in lines[0]


def test_pufferfish_with_a_plain_warm_up_changes_nothing() -> None:
    opt, lines = _optimizer(_cli_config("--method", "pufferfish"))
    assert opt.param_groups[0]["momentum"] == TrainConfig().momentum and lines == []


def test_pufferfish_refuses_a_warm_up_method_without_a_warm_up() -> None:
    with pytest.raises(UsageError, match="no effect without a warm-up"):
        methods.create("pufferfish:warmup_method=signum,warmup_epochs=0")


# --- the update axis: lowcomm.optim -------------------------------------------------------

def test_lowcomm_optim_is_cheap_to_import_and_resolves_every_public_name() -> None:
    import subprocess
    import sys

    code = ("import sys, lowcomm.optim as o; assert 'torch' not in sys.modules, 'torch imported'; "
            "names = sorted(o.__all__); [getattr(o, n) for n in names]; print(' '.join(names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    import lowcomm.optim as optim

    assert set(out) == set(optim.__all__) <= set(dir(optim))
    assert {"build_optimizer", "param_groups", "apply_method_overrides", "lr_factor", "build_scheduler",
            "Rewarmup", "frobenius_decay_"} <= set(out)
    with pytest.raises(AttributeError):
        optim.no_such_name  # noqa: B018


def test_rewarmup_ramps_linearly_from_its_start_and_the_scheduler_multiplies_it_in() -> None:
    from lowcomm.optim import Rewarmup, build_scheduler, lr_factor

    ramp = Rewarmup.epochs(start=4, epochs=0.5, steps_per_epoch=8)
    assert ramp == Rewarmup(4, 4) and Rewarmup.epochs(4, 0.0, 8) is None
    assert [ramp.factor(s) for s in range(10)] == [1, 1, 1, 1, 0.25, 0.5, 0.75, 1, 1, 1]
    cfg = TrainConfig(lr=0.1, schedule="cosine")
    opt = build_optimizer(cfg, nn.Linear(4, 2))
    sched = build_scheduler(cfg, opt, 8, 16, multiplier=ramp.factor)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: changes nothing, keeps torch's order check quiet
        sched.step()
    assert lrs == [0.1 * (lr_factor(cfg, s, 8, 16) * ramp.factor(s)) for s in range(10)]

"""``--schedule poly``: linear warm-up, then ``(1 - t/T) ** power`` to (almost) zero; the
other schedules keep their names and values."""

from __future__ import annotations

import pytest
import torch

from lowcomm.errors import UsageError
from lowcomm.optim.schedules import build_scheduler, lr_factor, poly_factor
from lowcomm.runtime.config import SCHEDULES, TrainConfig


def _factors(cfg: TrainConfig, steps_per_epoch: int, total: int) -> list[float]:
    return [lr_factor(cfg, s, steps_per_epoch, total) for s in range(total)]


def test_poly_decays_from_one_with_the_given_power_and_never_reaches_zero() -> None:
    assert poly_factor(0, 10, 2.0) == 1.0
    assert poly_factor(5, 10, 2.0) == pytest.approx(0.25)
    assert poly_factor(5, 10, 1.0) == pytest.approx(0.5)
    assert poly_factor(9, 10, 2.0) == pytest.approx(0.01)  # the last step still moves
    assert poly_factor(50, 10, 2.0) == pytest.approx(0.01)  # past the end: held, not negative


def test_warm_up_then_poly_is_linear_up_then_monotone_down() -> None:
    cfg = TrainConfig(schedule="poly", lr_warmup_epochs=2, poly_power=2.0)
    f = _factors(cfg, steps_per_epoch=5, total=50)
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == 1.0
    assert all(a > b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx((1 / 40) ** 2)


def test_poly_power_changes_the_curve() -> None:
    lin = _factors(TrainConfig(schedule="poly", poly_power=1.0), 10, 100)
    quad = _factors(TrainConfig(schedule="poly", poly_power=2.0), 10, 100)
    assert lin[50] == pytest.approx(0.5) and quad[50] == pytest.approx(0.25)


def test_existing_schedules_keep_their_names_and_values() -> None:
    assert SCHEDULES[:4] == ("constant", "step", "multistep", "cosine") and "poly" in SCHEDULES
    assert _factors(TrainConfig(schedule="cosine"), 10, 100)[50] == pytest.approx(0.5)
    assert _factors(TrainConfig(schedule="constant"), 10, 100) == [1.0] * 100


def test_scheduler_sets_the_poly_lr_on_the_optimizer() -> None:
    cfg = TrainConfig(schedule="poly", lr=2.0, poly_power=2.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(cfg, opt, steps_per_epoch=10, total_steps=20)
    for _ in range(10):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.25)


@pytest.mark.parametrize("power", [0.0, -1.0, float("nan")])
def test_bad_poly_power_is_refused(power: float) -> None:
    with pytest.raises(UsageError, match="--poly-power"):
        TrainConfig(schedule="poly", poly_power=power).validate()


def test_cli_poly_power_flag_reaches_the_config() -> None:
    import argparse

    from lowcomm.runtime.train_cli import add_train_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    cfg = config_from_args(p.parse_args(["--schedule", "poly", "--poly-power", "3"]))
    assert cfg.schedule == "poly" and cfg.poly_power == 3.0


def test_advancing_after_an_update_made_without_optimizer_step_does_not_warn() -> None:
    """DeAR and lee18 update through their own sharded steps: torch's "scheduler before
    optimizer" warning would be a false alarm there; other warnings still pass."""
    import warnings

    from lowcomm.optim.schedules import advance

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        advance(sched)  # no opt.step() before it, as with a deferred update
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)

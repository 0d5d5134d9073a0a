"""Durations scaled to the run: every codec's ``start_iter`` (and topk's ``sparsity_warmup``)
may be steps (``10``), epochs (``"2ep"``) or a share of the run (``"5%"``).

Parsing and validation live in :mod:`lowcomm.compress.options`; the codec resolves them with
:meth:`~lowcomm.compress.codec.Codec.set_run`, called by the trainer's methods (DDP hook and
engine schedules, through :class:`~lowcomm.methods.base.MethodContext`) and by
``lowcomm.hooks.register(steps_per_epoch=, total_steps=)``. Without run information an
explicit relative value is refused with the fix; a relative *default* falls back silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

from compress_testlib import make_model
from lowcomm import hooks, methods
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.compress.options import Duration, parse_duration, resolve_duration
from lowcomm.compress.sign import SignOptions, SignSGDCodec
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.testing import distributed

methods.names()  # load the method modules before forking

#: every codec with a warm-up
WITH_START = [n for n in CODECS.names() if any(f.name == "start_iter" for f in dataclasses.fields(codec_class(n).Options))]


@pytest.mark.parametrize("value, parsed", [(10, 10), ("12", 12), (0, 0), ("2ep", "2ep"), ("0.5EP", "0.5ep"),
                                           (" 2.0ep ", "2ep"), ("5%", "5%"), ("100%", "100%"), ("0%", "0%"),
                                           ("MIN( 1.5EP , 10% )", "min(1.5ep,10%)"), ("min(24,5%)", "min(24,5%)")])
def test_durations_parse_to_steps_or_a_canonical_relative_form(value: Any, parsed: Any) -> None:
    assert parse_duration("start_iter", value) == parsed


@pytest.mark.parametrize("value", [-1, True, 1.5, "2 epochs", "ep", "nan%", "inf ep", "1e400ep", "101%", "-1ep",
                                   "2.5", None, "min(1ep)", "min(1ep,2ep,3ep)", "min(min(1ep,2ep),3)",
                                   "min(x,2)", "min()", "min(-1,2ep)"])
def test_an_invalid_duration_names_the_option_and_the_valid_forms(value: Any) -> None:
    with pytest.raises(UsageError, match=r"start_iter must be an integer >= 0 \(steps\), 'Nep'.*'N%'"):
        parse_duration("start_iter", value)


def test_epochs_and_percentages_resolve_against_the_run_length() -> None:
    run = {"steps_per_epoch": 30, "total_steps": 1000, "default_steps": None}
    assert resolve_duration("2ep", **run) == 60
    assert resolve_duration("0.5ep", **run) == 15
    assert resolve_duration("5%", **run) == 50
    assert resolve_duration("0.25%", **run) == 3  # 2.5 steps: round half up
    assert resolve_duration(7, **run) == 7


def test_the_shorter_of_two_durations_scales_down_with_a_short_run_and_stops_growing_with_a_long_one() -> None:
    """``min(1.5ep,10%)`` at 16 steps per epoch: 10 % of a short run, 1.5 epochs of a long one."""
    steps = {epochs: resolve_duration("min(1.5ep,10%)", steps_per_epoch=16, total_steps=16 * epochs,
                                      default_steps=None) for epochs in (2, 15, 20, 40, 90)}
    assert steps == {2: 3, 15: 24, 20: 24, 40: 24, 90: 24}
    assert resolve_duration("min(3,1ep)", steps_per_epoch=16, total_steps=None, default_steps=None) == 3
    with pytest.raises(UsageError, match=r"start_iter='1ep'.*steps_per_epoch="):  # explicit: the fix is named
        resolve_duration("min(1ep,5%)", steps_per_epoch=None, total_steps=None, default_steps=None, name="start_iter")
    assert resolve_duration("min(1ep,5%)", steps_per_epoch=None, total_steps=None, default_steps=10) == 10


def test_an_explicit_relative_duration_without_run_information_says_what_to_pass() -> None:
    with pytest.raises(UsageError, match=r"start_iter='2ep'.*steps_per_epoch=.*lowcomm\.hooks\.register"):
        resolve_duration("2ep", steps_per_epoch=None, total_steps=100, default_steps=None, name="start_iter")
    with pytest.raises(UsageError, match=r"total_steps="):
        resolve_duration("5%", steps_per_epoch=10, total_steps=None, default_steps=None, name="start_iter")


@pytest.mark.parametrize("name", WITH_START)
def test_every_codec_resolves_its_start_iter_with_set_run(name: str) -> None:
    cls = codec_class(name)
    by_epochs = cls(cls.Options(start_iter="2ep"))
    by_epochs.set_run(steps_per_epoch=7, total_steps=70)
    assert by_epochs.start_iter == 14 and not by_epochs.active
    by_share = cls(cls.Options(start_iter="10%"))
    by_share.set_run(steps_per_epoch=7, total_steps=70)
    assert by_share.start_iter == 7
    steps = cls(cls.Options(start_iter=3))
    assert steps.start_iter == 3  # steps need no run information
    with pytest.raises(UsageError, match="steps_per_epoch="):
        cls(cls.Options(start_iter="2ep")).set_run(steps_per_epoch=None, total_steps=None)


@dataclasses.dataclass
class _RelativeDefault(SignOptions):
    """signsgd with a relative default warm-up (what the lead may choose)."""

    start_iter: Duration = "1ep"


def test_a_relative_default_falls_back_to_ten_steps_when_the_run_is_unknown() -> None:
    codec = SignSGDCodec(_RelativeDefault())
    codec.set_run(steps_per_epoch=None, total_steps=None)
    assert codec.start_iter == 10
    codec.set_run(steps_per_epoch=4, total_steps=None)
    assert codec.start_iter == 4


@pytest.mark.parametrize("spec, expected", [("topk:start_iter=2ep", "2ep"), ("acpsgd:start_iter=5%", "5%"),
                                            ("powersgd:start_iter=min(2ep,5%)", "min(2ep,5%)"),
                                            ("wfbp:compress=acpsgd,start_iter=(min(1ep,3%))", "min(1ep,3%)"),
                                            ("powersgd:start_iter=12", 12),
                                            ("wfbp:compress=signsgd,start_iter=0.5ep", "0.5ep")])
def test_method_specs_keep_durations_as_typed(spec: str, expected: Any) -> None:
    o = methods.create(spec).options
    assert getattr(o, "codec_options", o).start_iter == expected


def test_a_bad_duration_in_a_method_spec_is_one_usage_error() -> None:
    with pytest.raises(UsageError, match="start_iter must be"):
        methods.create("signsgd:start_iter=2epochs")


def test_engine_schedules_resolve_durations_from_the_methods_context() -> None:
    method = methods.create("wfbp:compress=signsgd,start_iter=2ep")
    method.wrap(make_model(), MethodContext(steps_per_epoch=5, total_steps=50))
    assert method.codec is not None and method.codec.start_iter == 10
    unknown = methods.create("wfbp:compress=signsgd,start_iter=2ep")
    with pytest.raises(UsageError, match="steps_per_epoch="):
        unknown.wrap(make_model(), MethodContext())


@distributed(world_size=2)
def test_hooks_register_resolves_durations_from_its_run_arguments() -> None:
    def ddp() -> nn.Module:
        return nn.parallel.DistributedDataParallel(make_model())

    state = hooks.register(ddp(), "topk", start_iter="2ep", steps_per_epoch=3)
    assert state.codec is not None and state.codec.start_iter == 6
    state = hooks.register(ddp(), "acpsgd:start_iter=25%", total_steps=40)
    assert state.codec is not None and state.codec.start_iter == 10
    with pytest.raises(UsageError, match=r"steps_per_epoch=.*lowcomm\.hooks\.register"):
        hooks.register(ddp(), "signsgd", start_iter="2ep")
    with pytest.raises(UsageError, match="steps_per_epoch must be"):
        hooks.register(ddp(), "signsgd", steps_per_epoch=0)
    assert dist.get_world_size() == 2


@distributed(world_size=2)
def test_the_trainers_hook_methods_resolve_durations_from_the_context() -> None:
    method = methods.create("powersgd:start_iter=50%")
    ctx = MethodContext(rank=dist.get_rank(), world_size=2, steps_per_epoch=4, total_steps=12)
    method.wrap(make_model(), ctx)
    assert method.hook_state is not None and method.hook_state.codec is not None
    assert method.hook_state.codec.start_iter == 6

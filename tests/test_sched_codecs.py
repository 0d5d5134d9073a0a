"""Every engine schedule x every registered codec: the pairs that work match the codec's
central reference on 2 ranks, the pairs that cannot work are refused with their reason.

The pairs come from :data:`lowcomm.compress.codec.CODECS` and
:func:`lowcomm.sched.pairing.pairing_refusal` (no list of codec names here), the references
from ``compress_testlib.reference_for`` (the same central re-computation the DDP comm hooks
are checked against: per-rank state, the paper's formula, float32 like the engine).

One 2-rank run trains the tiny MLP of ``compress_testlib`` for every working pair (a few
plain SGD steps; ``start_iter=1``: one warm-up step of plain averaging, then compressed
steps). Each rank records, per step, its local gradient (a shadow model at the engine's
flushed weights) and the weights before and after. The reference replays the steps from
every rank's local gradients and gives the mean gradient ``g``; the engine's step must be
``w - lr * g``.

Tolerance (tests/tolerance.py): the reference's own round-off model (``ops``, ``cond``,
``dtype`` of the aggregate) at the scale of the summed terms, times ``lr`` for the update,
plus one float32 rounding of the subtraction at the weights' scale.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from compress_testlib import HOOK_CASES, make_model, reference_for, run_ranks
from sgd_testlib import check_sgd_steps, record_sgd_steps
from lowcomm import methods
from lowcomm.compress.codec import CODECS, Aggregation, codec_class
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.sched.pairing import pairing_refusal

methods.names()  # load the method modules before forking
LR = 0.05
STEPS = 4
SCHEDULES = {  # schedule -> its own options for this test (small groups, a regroup in mgwfbp)
    "wfbp": "",
    "mgwfbp": "alpha=1.0,beta=0.0,profile_iters=1",
    "dear": "threshold_mb=0",
    "lee18": "",
    "hier": "threshold_mb=0",  # 2 ranks are one node here: the flat fallback (4-rank tests: test_hierarchical.py)
}
OPTIONS = dict(HOOK_CASES)  # the hooks' small test options: compress from step 1


def codec_options(codec: str) -> dict[str, Any]:
    return dict(OPTIONS.get(codec, {"start_iter": 1}))


def spec_of(schedule: str, codec: str) -> str:
    parts = [f"compress={codec}", SCHEDULES[schedule]]
    parts += [f"{k}={v}" for k, v in codec_options(codec).items()]
    return f"{schedule}:" + ",".join(p for p in parts if p)


PAIRS = [(s, c) for s in SCHEDULES for c in CODECS.names()]
WORKING = [(s, c) for s, c in PAIRS if pairing_refusal(s, c) is None]
REFUSED = [(s, c) for s, c in PAIRS if pairing_refusal(s, c) is not None]


def _train(spec: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model, shadow = make_model(), make_model()
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=dist.get_world_size()))
    rec = record_sgd_steps(method, model, shadow, wrapped, steps=STEPS, lr=LR, rank=rank)
    rec["state"] = method.state_dict()
    return rec


def _train_all() -> dict[str, Any]:
    return {f"{s}+{c}": _train(spec_of(s, c)) for s, c in WORKING}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Every working pair trained once, in one 2-rank run (cheap: one spawn)."""
    return run_ranks(_train_all, 2, timeout=240)


@pytest.mark.parametrize("schedule, codec", WORKING)
def test_schedule_carrying_codec_matches_central_reference_on_two_ranks(
    runs: list[dict[str, Any]], schedule: str, codec: str
) -> None:
    recs = [r[f"{schedule}+{codec}"] for r in runs]
    names = list(recs[0]["local"][0])
    opts = codec_options(codec)
    ref = reference_for(codec, opts, len(recs))
    warm = reference_for("ssgd", {}, len(recs))
    start = int(opts.get("start_iter", 0))
    compressed = check_sgd_steps(recs, names, ref, warm, start, steps=STEPS, lr=LR, label=f"{schedule}+{codec}")
    if codec_class(codec).stateful:  # a stateless cast may round these values exactly
        assert compressed >= 1, f"{schedule}+{codec}: the reference never differed from the mean"
    assert "codec" in recs[0]["state"]  # the codec's state is part of the method's checkpoint


@pytest.mark.parametrize("schedule, codec", REFUSED)
def test_impossible_pair_is_refused_with_its_reason(schedule: str, codec: str) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(spec_of(schedule, codec))
    reason = pairing_refusal(schedule, codec)
    assert str(e.value) == reason
    assert codec in reason and schedule in reason and "'wfbp:compress=" in reason


def test_every_schedule_carries_every_gathered_codec_and_the_known_refusals_stay() -> None:
    for schedule, codec in PAIRS:
        cls = codec_class(codec)
        if schedule == "hier":  # sums only: its point is the hierarchical all-reduce
            assert ((schedule, codec) in WORKING) == (cls.aggregation is Aggregation.SUM)
        elif cls.aggregation is Aggregation.GATHER or schedule in ("wfbp", "mgwfbp"):
            assert (schedule, codec) in WORKING
    assert ("dear", "powersgd") in REFUSED and ("lee18", "acpsgd") in REFUSED and ("lee18", "powersgd") in REFUSED
    assert ("dear", "fp16") in WORKING and ("dear", "acpsgd") in WORKING and ("lee18", "bf16") in WORKING


def test_codec_options_are_validated_and_unknown_keys_list_both_sets() -> None:
    m = methods.create("wfbp:compress=topk,density=0.1")
    assert m.options.codec_options.density == 0.1
    with pytest.raises(UsageError) as e:
        methods.create("dear:compress=fp16,rank=4")
    assert "rank" in str(e.value) and "threshold_mb" in str(e.value) and "fp16" in str(e.value)
    with pytest.raises(UsageError) as e:
        methods.create("mgwfbp:compress=topk,density=0")
    assert "density" in str(e.value)

"""Compression comm hooks on 2-4 gloo ranks with many DDP buckets: results equal a central
reference, counted bytes equal the analytic payload, state survives no_sync / unused
parameters / NaN / checkpoint-resume."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from compress_testlib import (
    HOOK_CASES,
    check_against_reference,
    has_reference,
    make_model,
    recorded_run,
    resume_run,
    run_ranks,
)
from tolerance import assert_close_eps
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.compress.lowrank import effective_rank, matrix_shape, should_compress
from lowcomm.hooks import methods, options_for

CASES = HOOK_CASES
STATEFUL = [c for c in CASES if c[0] in CODECS and codec_class(c[0]).stateful]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method, opts", CASES, ids=[c[0] for c in CASES])
def test_aggregated_gradient_matches_central_reference_with_many_buckets(
    method: str, opts: dict[str, Any], world: int
) -> None:
    results = run_ranks(recorded_run, world, method, opts, steps=5)
    buckets = check_against_reference(method, opts, results)
    assert buckets >= 4
    for s in range(5):  # every rank ends up with bit-identical gradients
        for n, g in results[0]["log"][s]["out"].items():
            assert all(torch.equal(g, r["log"][s]["out"][n]) for r in results[1:])


def test_gtopk_on_three_ranks_uses_the_fold_in_fallback() -> None:
    opts = {"start_iter": 1, "density": 0.1}
    results = run_ranks(recorded_run, 3, "gtopk", opts, steps=4)
    check_against_reference("gtopk", opts, results)
    # rank 2 (extra) sends its k once per bucket; rank 0 also returns the result to it
    assert results[2]["ledger"]["wire_bytes"] < results[0]["ledger"]["wire_bytes"]


@pytest.mark.parametrize("method, opts", [c for c in STATEFUL], ids=[c[0] for c in STATEFUL])
def test_compressing_from_step_zero_survives_ddp_bucket_rebuild(method: str, opts: dict[str, Any]) -> None:
    opts = {**opts, "start_iter": 0}  # step 0 runs on DDP's initial single bucket
    results = run_ranks(recorded_run, 2, method, opts, steps=4)
    layouts = [len(step["buckets"]) for step in results[0]["log"]]
    assert layouts[0] == 1 and layouts[-1] >= 4
    check_against_reference(method, opts, results)


def _ar(b: int, p: int) -> int:
    return 2 * (p - 1) * b // p


def expected_wire_bytes(method: str, opts: dict[str, Any], log: list[dict[str, Any]], world: int) -> int:
    """Analytic per-worker wire bytes (the formulas of docs/compression.md)."""
    o = options_for(method, **opts)
    shapes = {n: p.shape for n, p in make_model().named_parameters()}
    start = getattr(o, "start_iter", 0)
    total = 0
    for s, step in enumerate(log):
        for names, _ in step["buckets"]:
            sizes = [math.prod(shapes[n]) for n in names]
            n = sum(sizes)
            if s < start or method == "ssgd":
                total += _ar(4 * n, world)
            elif method in ("fp16", "bf16"):
                total += _ar(2 * n, world)
            elif method in ("signsgd", "signum"):
                total += (world - 1) * ((n + 7) // 8 + 4 * len(names))
            elif method in ("topk", "gtopk"):
                k = sum(max(1, math.ceil(o.density * m)) for m in sizes)
                rounds = world - 1 if method == "topk" else int(math.log2(world))
                total += rounds * 8 * k
            else:
                comp = [shapes[x] for x in names if should_compress(shapes[x], o.rank, o.min_compression_rate)]
                unc = n - sum(math.prod(sh) for sh in comp)
                ps = sum(matrix_shape(sh)[0] * effective_rank(sh, o.rank) for sh in comp)
                qs = sum(matrix_shape(sh)[1] * effective_rank(sh, o.rank) for sh in comp)
                if not comp:
                    total += _ar(4 * n, world)
                elif method == "powersgd":
                    total += _ar(4 * (unc + ps), world) + _ar(4 * qs, world)
                else:
                    p_step = (s - start) % 2 == 0
                    total += _ar(4 * (unc + (ps if p_step else qs)), world)
    return total


#: the methods whose formulas docs/compression.md states in closed form (checked below
#: independently of the codecs' own cost(); every codec's cost() is checked further down)
DOCUMENTED = [c for c in CASES if c[0] in ("ssgd", "fp16", "bf16", "signsgd", "signum", "topk", "gtopk",
                                           "powersgd", "acpsgd")]


@pytest.mark.parametrize("method, opts", DOCUMENTED, ids=[c[0] for c in DOCUMENTED])
def test_counted_bytes_equal_the_analytic_payload(method: str, opts: dict[str, Any]) -> None:
    world = 4
    results = run_ranks(recorded_run, world, method, opts, steps=4)
    for res in results:
        assert res["ledger"]["wire_bytes"] == expected_wire_bytes(method, opts, res["log"], world)
        assert res["ledger"]["wire_bytes"] > 0


CODEC_CASES = [c for c in CASES if c[0] in CODECS]


@pytest.mark.parametrize("method, opts", CODEC_CASES, ids=[c[0] for c in CODEC_CASES])
def test_counted_bytes_equal_the_codecs_declared_cost(method: str, opts: dict[str, Any]) -> None:
    """What the accounting layer counts at the collective calls of a 2-rank hook run equals
    the codec's own :meth:`~lowcomm.compress.codec.Codec.cost`, summed over the buckets
    (warm-up steps: the plain all-reduce of 4 bytes per element)."""
    world = 2
    results = run_ranks(recorded_run, world, method, opts, steps=4)
    codec = codec_class(method)(options_for(method, **opts), world=world)
    shapes = {n: p.shape for n, p in make_model().named_parameters()}
    for res in results:
        expected = 0
        for s, step in enumerate(res["log"]):
            for names, _ in step["buckets"]:
                fused = [shapes[n] for n in names]
                if s < codec.start_iter:
                    expected += 4 * sum(math.prod(sh) for sh in fused)
                else:
                    expected += codec.cost(fused, world=world, step=s).nbytes
        assert res["ledger"]["payload_bytes"] == expected > 0


def test_every_method_has_a_hook_and_every_codec_a_reference_and_a_cost() -> None:
    """Adding a compressor cannot forget its hook, its central reference or its bytes."""
    assert methods() == sorted(["ssgd", *CODECS.names()])
    for name in CODECS.names():
        assert has_reference(name), f"{name}: no central reference (tests/test_codec_{name}.py: Reference)"
        cost = codec_class(name)(world=4).cost([(16, 8), (16,)], world=4, step=0)
        assert cost.rounds and cost.nbytes > 0, name


@pytest.mark.parametrize("method, opts", STATEFUL, ids=[c[0] for c in STATEFUL])
def test_unused_parameters_and_no_sync_accumulation_keep_state_consistent(method: str, opts: dict[str, Any]) -> None:
    steps = 5
    results = run_ranks(recorded_run, 2, method, opts, steps=steps, find_unused=True, accumulate=2)
    check_against_reference(method, opts, results)
    for res in results:
        assert res["state"]["step"] == steps  # no_sync micro-steps are not counted
        assert res["log"][-1]["out"]["unused.weight"] is None
        for name, mem in res["state"].get("memory", {}).items():
            assert torch.isfinite(mem).all()
            if name.startswith("unused."):
                assert not mem.any()


@pytest.mark.parametrize("method, opts", STATEFUL, ids=[c[0] for c in STATEFUL])
def test_checkpoint_resume_gives_the_same_next_updates(method: str, opts: dict[str, Any]) -> None:
    straight = run_ranks(resume_run, 2, method, opts, steps=7, split=4, fresh=False)
    resumed = run_ranks(resume_run, 2, method, opts, steps=7, split=4, fresh=True)
    # Same arithmetic on both sides, except that the resumed DDP starts from its initial
    # bucket layout (rebuilt after one step), which may order each 2-rank sum and the
    # batched low-rank products differently: world terms per sum, 3 steps carried forward.
    for a_rank, b_rank in zip(straight, resumed):
        for a, b in zip(a_rank, b_rank):
            for name in a:
                assert_close_eps(a[name], b[name], torch.float32, ops=2 * 3, msg=(method, name))


@pytest.mark.parametrize("method, opts", STATEFUL, ids=[c[0] for c in STATEFUL])
def test_nonfinite_gradient_on_one_rank_is_not_folded_into_state(method: str, opts: dict[str, Any]) -> None:
    bad_rank, bad_step = 1, 3
    results = run_ranks(recorded_run, 2, method, opts, steps=5, nan_at=(bad_rank, bad_step))
    poisoned = next(names for names, _ in results[0]["log"][bad_step]["buckets"] if "0.weight" in names)
    for r, res in enumerate(results):
        out = res["log"][bad_step]["out"]
        assert any(not torch.isfinite(out[n]).all() for n in poisoned), "NaN must reach every rank"
        assert all(torch.isfinite(g).all() for g in res["log"][bad_step + 1]["out"].values() if g is not None)
        before, after = res["states"][bad_step - 1], res["states"][bad_step]
        keep = ["p", "q"] if r != bad_rank else ["memory", "p", "q"]
        if method == "powersgd":
            keep = ["memory", "q"]  # its memory uses the aggregate: unchanged on every rank
        for key in keep:
            for n in poisoned:
                if n in before.get(key, {}):
                    assert torch.equal(before[key][n], after[key][n]), (key, n, r)
        for table in ("memory", "p", "q"):
            for t in after.get(table, {}).values():
                assert torch.isfinite(t).all()
    for res in results:  # every rank skips the same step, and says so
        assert [step["finite"] for step in res["log"]] == [s != bad_step for s in range(5)]
        assert res["warnings"] >= 1


@pytest.mark.parametrize("method", ["powersgd", "acpsgd"])
def test_low_rank_groups_left_unstacked_give_the_same_result(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowcomm.compress import lowrank

    monkeypatch.setattr(lowrank, "STACK_MAX_NUMEL", 0)  # every multi-matrix group: list of views
    opts = {"start_iter": 1, "rank": 2}
    results = run_ranks(recorded_run, 2, method, opts, steps=5, bucket_cap_mb=25.0)  # one bucket
    check_against_reference(method, opts, results)

"""``diloco`` and ``streaming_diloco``: 2 ranks against the single-process reference of
tests/test_localsgd.py (the algorithm per parameter, as the papers write it), bytes per
period, pseudo-gradients through a codec, and an exact resume from a checkpoint taken
mid-period with a fragment's sync still in flight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowcomm.compress.codec import CODECS
from diloco_testlib import resume_matches
from lowcomm.testing import distributed, run_distributed
from test_localsgd import WORLD, assert_matches, make_model, rank_run, reference
from tolerance import assert_close_eps


@pytest.mark.parametrize("inner", ["sgd", "sgd_momentum", "adamw"])
def test_diloco_equals_the_reference_outer_nesterov_step(inner: str) -> None:
    steps = 9  # H = 4: two outer steps (momentum carried from the first), one local step after
    runs = run_distributed(rank_run, WORLD, "diloco:sync_every=4", steps, inner)
    assert_matches(runs, reference(steps, h=4, mode="outer", inner=inner), steps)


def test_global_copy_in_host_memory_trains_the_same() -> None:
    steps = 8
    spec = "diloco:sync_every=4,outer_momentum=0.5,nesterov=false,outer_lr=0.9,global_on=cpu"
    runs = run_distributed(rank_run, WORLD, spec, steps, "sgd_momentum")
    expected = reference(
        steps, h=4, mode="outer", inner="sgd_momentum", mu=0.5, nesterov=False, outer_lr=0.9
    )
    assert_matches(runs, expected, steps)


def test_diloco_with_unit_outer_lr_and_no_momentum_is_local_sgd() -> None:
    # global - mean(global - local_r) = mean(local_r): the outer step is the average
    steps = 8
    a = run_distributed(
        rank_run, WORLD, "diloco:sync_every=4,outer_lr=1,outer_momentum=0", steps, "adamw"
    )
    b = run_distributed(rank_run, WORLD, "localsgd:sync_every=4", steps, "adamw")
    for ra, rb in zip(a, b):
        for k, v in rb["state"].items():
            assert_close_eps(ra["state"][k], v, torch.float32, ops=8 * steps, msg=k)


@pytest.mark.parametrize(
    "fragments, delay, alpha", [(2, 0, 0.0), (2, 1, 0.5), (3, 2, 0.5), (3, 1, 0.0)]
)
def test_streaming_diloco_equals_the_reference(fragments: int, delay: int, alpha: float) -> None:
    steps, h = 14, 6
    spec = f"streaming_diloco:sync_every={h},fragments={fragments},delay={delay},alpha={alpha}"
    runs = run_distributed(rank_run, WORLD, spec, steps, "sgd_momentum")
    expected = reference(
        steps,
        h=h,
        mode="outer",
        inner="sgd_momentum",
        fragments=fragments,
        delay=delay,
        alpha=alpha,
    )
    assert_matches(runs, expected, steps)


def test_streaming_with_one_fragment_and_no_delay_is_diloco() -> None:
    steps = 8
    a = run_distributed(
        rank_run, WORLD, "streaming_diloco:sync_every=4,fragments=1,delay=0,alpha=0", steps
    )
    b = run_distributed(rank_run, WORLD, "diloco:sync_every=4", steps)
    for ra, rb in zip(a, b):
        for k, v in rb["state"].items():
            assert torch.equal(ra["state"][k], v), k


def test_bytes_per_period_are_one_all_reduce_of_the_model_spread_over_the_fragments() -> None:
    steps, h = 12, 6
    numel = sum(p.numel() for p in make_model().parameters())
    ring = 2 * (WORLD - 1) * 4 * numel // WORLD
    diloco = run_distributed(rank_run, WORLD, f"diloco:sync_every={h}", steps)
    stream = run_distributed(
        rank_run, WORLD, f"streaming_diloco:sync_every={h},fragments=3,delay=1", steps
    )
    fp16 = run_distributed(rank_run, WORLD, f"diloco:sync_every={h},compress=fp16", steps)
    for d, s, c in zip(diloco, stream, fp16):
        assert d["by_tag"]["diloco"] == (steps // h) * ring
        assert s["by_tag"]["streaming_diloco"] == (steps // h) * ring
        assert c["by_tag"]["diloco"] == (steps // h) * ring // 2  # half precision on the wire


def test_fp16_pseudo_gradients_follow_the_reference_at_half_precision() -> None:
    steps = 8
    runs = run_distributed(rank_run, WORLD, "diloco:sync_every=4,compress=fp16", steps)
    expected = reference(steps, h=4, mode="outer")
    # the pseudo-gradient is rounded to float16 once per sync (relative eps(fp16) of its size,
    # which is below the weights'); the float32 error model below is the same for fp32 parts
    for run, ref in zip(runs, expected):
        for k, v in ref.items():
            assert_close_eps(run["state"][k], v, torch.float16, ops=2 * (steps // 4), msg=k)


def test_top_k_pseudo_gradients_leave_every_rank_with_the_same_weights_after_a_sync() -> None:
    runs = run_distributed(rank_run, WORLD, "diloco:sync_every=4,compress=(topk:density=0.25)", 8)
    for k in runs[0]["state"]:
        assert torch.equal(runs[0]["state"][k], runs[1]["state"][k]), k
    # dense: 2 syncs of a ring all-reduce, P = 2; top-k: a quarter of the values with indices
    dense = 2 * sum(p.numel() for p in make_model().parameters()) * 4
    assert 0 < runs[0]["by_tag"]["diloco"] < dense / 1.5


@pytest.mark.parametrize(
    "compress",
    [
        *CODECS.names(),
        "(powersgd:rank=1,min_compression_rate=1)",
        "(acpsgd:rank=1,min_compression_rate=1)",
    ],
)
def test_every_compressor_carries_the_pseudo_gradient_and_ranks_agree_after_a_sync(
    compress: str,
) -> None:
    # 8 steps, H = 4: the last step is a sync, so both ranks hold the decoded global weights;
    # the low-rank codecs with min_compression_rate=1 really send their P and Q rounds
    runs = run_distributed(rank_run, WORLD, f"diloco:sync_every=4,compress={compress}", 8)
    for k, v in runs[0]["state"].items():
        assert torch.equal(v, runs[1]["state"][k]) and bool(torch.isfinite(v).all()), k
    assert sum(b for tag, b in runs[1]["by_tag"].items() if tag.startswith("diloco")) > 0
    if "min_compression_rate" in compress:
        assert {"diloco.P", "diloco.Q"} <= set(runs[1]["by_tag"])


@distributed(world_size=WORLD, timeout=240)
def test_resume_mid_period_with_a_sync_in_flight_matches_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # 16 steps (one epoch); H = 4, fragments at offsets 0 and 2, delay 1: the checkpoint at
    # step 10 is mid-period with fragment 1's sync (started at step 10) not yet merged, and
    # the top-k error feedback of both fragments is state too
    method = "streaming_diloco:sync_every=4,fragments=2,delay=1,compress=(topk:density=0.2)"
    mid = resume_matches(tmp_path, method, 10, nproc=WORLD, batch_size=128)
    assert mid["sync"]["pending"][1]  # the in-flight fragment was saved
    assert mid["sync"]["codecs"][0]  # the codec's state (error feedback) too

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU; `make test-gpu` on a GPU machine")
@pytest.mark.parametrize(
    "spec",
    [
        "diloco:sync_every=2,global_on=cpu,compress=fp16",
        "streaming_diloco:sync_every=4,fragments=2,delay=1,compress=(topk:density=0.5)",
        "localsgd:sync_every=2",
    ],
)
def test_on_cuda_every_collective_runs_on_the_device_and_ranks_agree_after_a_sync(
    spec: str,
) -> None:
    # two ranks on one GPU share it over gloo (NCCL refuses that); with two GPUs, NCCL alone:
    # a CPU tensor handed to a collective would fail there
    backend = "gloo" if GPUS < 2 else "nccl"
    runs = run_distributed(
        rank_run, WORLD, spec, 8, "sgd", True, "cuda", device="cuda", backend=backend
    )
    for k in runs[0]["state"]:
        assert torch.equal(runs[0]["state"][k], runs[1]["state"][k]) or "streaming" in spec, k
    assert all(v > 0 for v in runs[0]["by_tag"].values())

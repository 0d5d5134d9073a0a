"""gloo's reduce-scatter runs as a ring of point-to-point steps off the caller's thread."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm import accounting, ring
from lowcomm.testing import distributed


def _inputs(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-dependent values whose sums are exact in ``dtype``."""
    rank = dist.get_rank()
    return (torch.arange(n, dtype=torch.float64) % 7 + 10 * rank).to(dtype)


def _expected(n: int, dtype: torch.dtype) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    total = sum((torch.arange(n, dtype=torch.float64) % 7 + 10 * r) for r in range(world)).to(dtype)
    return total.view(world, -1)[rank]


@distributed(world_size=3)
def test_ring_sums_each_rank_its_chunk_for_every_dtype() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32):
        x = _inputs(3 * 5, dtype)
        before = x.clone()
        out = torch.empty(5, dtype=dtype)
        accounting.reduce_scatter_tensor(out, x)
        assert torch.equal(out, _expected(15, dtype)), dtype
        assert torch.equal(x, before)  # the input is left as it was


@distributed(world_size=4)
def test_rings_in_flight_complete_in_any_wait_order_and_count_their_bytes() -> None:
    sizes = [4 * 1000, 4 * 3, 4 * 600_000]  # the last travels in three segments per step
    xs = [_inputs(n, torch.float32) for n in sizes]
    outs = [torch.empty(n // 4) for n in sizes]
    works = [accounting.reduce_scatter_tensor(o, x, async_op=True, tag="rs") for o, x in zip(outs, xs)]
    for w in reversed(works):
        w.wait()
    for o, n in zip(outs, sizes):
        assert torch.equal(o, _expected(n, torch.float32))
    assert all(w.is_completed() for w in works)
    led = accounting.ledger().as_dict()["by_tag"]["rs"]
    assert led["wire_bytes"] == sum(3 * 4 * n // 4 for n in sizes)


@distributed(world_size=2)
def test_output_that_is_not_contiguous_receives_the_sum() -> None:
    x = _inputs(8, torch.float64)
    base = torch.zeros(4, 2, dtype=torch.float64)
    out = base[:, 0]  # stride 2
    accounting.reduce_scatter_tensor(out, x)
    assert torch.equal(out, _expected(8, torch.float64))
    assert torch.equal(base[:, 1], torch.zeros(4, dtype=torch.float64))


@distributed(world_size=4)
def test_ring_on_a_subgroup_uses_the_groups_ranks() -> None:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = pairs[rank % 2]
    x = torch.full((6,), float(rank))
    out = torch.empty(3)
    accounting.reduce_scatter_tensor(out, x, group=group)
    assert torch.equal(out, torch.full((3,), float(rank % 2 + rank % 2 + 2)))


@distributed(world_size=2)
def test_ring_keeps_nan_where_one_rank_has_it() -> None:
    x = torch.ones(4)
    if dist.get_rank() == 1:
        x[0] = float("nan")
    out = torch.empty(2)
    accounting.reduce_scatter_tensor(out, x)
    assert torch.isnan(out[0]).item() == (dist.get_rank() == 0)


@distributed(world_size=2)
def test_sizes_that_do_not_split_are_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="does not split"):
        ring.start(torch.empty(3), torch.ones(5))


def test_ring_error_reaches_the_waiting_caller() -> None:
    class Failing:
        def run(self) -> None:
            raise OSError("peer went away")

    driver = ring._Driver()
    work = driver.submit(Failing())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="peer went away"):
        work.wait()
    assert work.is_completed()


@distributed(world_size=2)
def test_a_device_tensor_on_gloo_travels_through_a_host_copy_and_lands_on_wait() -> None:
    # CPU-only machine: pretend the tensors are on a device so the staging path runs
    real = accounting._stage_through_host
    accounting._stage_through_host = lambda backend, tensor: backend == "gloo"  # type: ignore[assignment]
    try:
        x = _inputs(8, torch.float32)
        out = torch.full((4,), -1.0)
        work = accounting.reduce_scatter_tensor(out, x, async_op=True)
        assert isinstance(work, accounting._CopyBackWork)
        work.wait()
        assert torch.equal(out, _expected(8, torch.float32))
    finally:
        accounting._stage_through_host = real  # type: ignore[assignment]


def test_a_group_runs_two_rings_at_once_never_more() -> None:
    import threading
    import time

    class Blocking:  # stands in for a ring: records its start, finishes when released
        def __init__(self, name: str) -> None:
            self.name, self.release = name, threading.Event()

        def run(self) -> None:
            with lock:
                started.append(self.name)
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            self.release.wait(30)
            with lock:
                running[0] -= 1

    def until(cond: Any) -> None:
        deadline = time.monotonic() + 30
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.005)

    lock, started, running, peak = threading.Lock(), [], [0], [0]
    driver = ring._Driver()
    rings = [Blocking(f"r{i}") for i in range(3)]
    works = [driver.submit(r) for r in rings]  # type: ignore[arg-type]
    until(lambda: len(started) == 2)
    time.sleep(0.2)  # a third thread, if there were one, would have started r2 by now
    assert sorted(started) == ["r0", "r1"] and peak[0] == ring.IN_FLIGHT == 2
    rings[0].release.set()  # a finished ring frees its thread for the next one
    until(lambda: len(started) == 3)
    assert started[2] == "r2" and peak[0] == 2
    for r in rings:
        r.release.set()
    for w in works:
        w.wait()

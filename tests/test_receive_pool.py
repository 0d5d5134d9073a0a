"""Receive buffers are reused across steps once nothing holds them, and never while something does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowcomm.comm import buffers, transport
from lowcomm.comm.buffers import BufferPool
from lowcomm.compress.codec import Message
from lowcomm.testing import distributed

needs_use_count = pytest.mark.skipif(buffers._use_count is None, reason="this torch cannot count a storage's holders")


@needs_use_count
def test_a_buffer_nothing_holds_is_handed_out_again() -> None:
    pool = BufferPool()
    like = torch.zeros(3)
    first = pool.take(100, like)
    ptr = first.data_ptr()
    del first
    again = pool.take(100, like)
    assert again.data_ptr() == ptr
    assert again.numel() == 100 and again.dtype == torch.float32


@needs_use_count
def test_a_buffer_still_held_through_a_view_or_a_slice_is_not_reused() -> None:
    pool = BufferPool()
    like = torch.zeros(1)
    first = pool.take(64, like)
    first.fill_(7.0)
    view = first.view(8, 8)
    row = view[3]
    del first, view
    second = pool.take(64, like)
    second.fill_(-1.0)
    assert torch.equal(row, torch.full((8,), 7.0))  # the holder's data is untouched
    del row
    assert pool.take(64, like).data_ptr() in {t.data_ptr() for t in pool._buffers}


def test_other_sizes_and_dtypes_get_their_own_buffers() -> None:
    pool = BufferPool()
    a = pool.take(10, torch.zeros(1))
    b = pool.take(11, torch.zeros(1))
    c = pool.take(10, torch.zeros(1, dtype=torch.int8))
    assert (a.numel(), b.numel(), c.numel()) == (10, 11, 10)
    assert c.dtype == torch.int8
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3


def test_the_pool_stays_within_its_limit_when_sizes_keep_changing() -> None:
    pool = BufferPool(limit=4)
    for n in range(1, 20):
        pool.take(n, torch.zeros(1))
    assert len(pool) == 4


def test_a_tensor_off_the_cpu_is_never_pooled() -> None:
    pool = BufferPool()
    t = pool.take(5, torch.zeros(1, device="meta"))
    assert t.device.type == "meta" and len(pool) == 0


@distributed(world_size=2)
def test_a_held_gather_result_survives_the_next_gather_of_the_same_size() -> None:
    rank = dist.get_rank()
    first = transport.start(Message(torch.full((4,), float(rank)), "all_gather"), tag="g").wait()
    second = transport.start(Message(torch.full((4,), 10.0 + rank), "all_gather"), tag="g").wait()
    assert torch.equal(first, torch.tensor([[0.0] * 4, [1.0] * 4]))
    assert torch.equal(second, torch.tensor([[10.0] * 4, [11.0] * 4]))


@needs_use_count
@distributed(world_size=2)
def test_gathers_and_reduce_scatters_receive_into_pooled_buffers() -> None:
    """Whether a later step gets the same buffer depends on when gloo drops its own references
    (just after the wait, on its thread), so this checks where the buffers come from; reuse
    itself is checked on the pool above."""
    rank = dist.get_rank()
    got = transport.start(Message(torch.full((1000,), float(rank)), "all_gather"), tag="g").wait()
    summed = transport.start(Message(torch.full((1000,), 1.0 + rank), "reduce_scatter"), tag="r").wait()
    assert torch.equal(got[1 - rank], torch.full((1000,), float(1 - rank)))
    assert torch.equal(summed, torch.full((500,), 3.0))
    pooled = {t.data_ptr() for t in buffers.POOL._buffers}
    assert got.data_ptr() in pooled and summed.data_ptr() in pooled


@needs_use_count
def test_the_tensor_handed_out_itself_keeps_its_buffer_taken() -> None:
    """A consumer holding exactly what it was given (no view) must keep the buffer: a scratch
    buffer of the received output's size once took that output's own buffer."""
    pool = BufferPool()
    held = pool.take(32, torch.zeros(1))
    held.fill_(5.0)
    other = pool.take(32, torch.zeros(1))
    other.fill_(-5.0)
    assert held.data_ptr() != other.data_ptr()
    assert torch.equal(held, torch.full((32,), 5.0))

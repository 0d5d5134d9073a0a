"""The sign decode's two-elements-per-lookup paths give the per-element lookup's result (issue 18).

:func:`lowcomm.compress.signbits.decode` maps each element's sign pattern (or vote count) to
``table[segment, code]``; for float32 with codes below 16 it looks up two elements at once
(patterns of up to 4 payloads and counts of up to 15 come straight from the packed bytes;
counts of 16 to 29 payloads are clamped to 15, all meaning "+"). Each is compared bit for
bit with the definition computed element by element in torch, on segment boundaries at odd
positions, an odd element count, chunks cut small, a misaligned output and float64 tables.
"""

from __future__ import annotations

import pytest
import torch

from lowcomm.compress import signbits

SEG = [1, 3, 8, 5, 2, 7, 64, 9, 1, 30]


def _reference(table: torch.Tensor, packed: list[torch.Tensor], seg: list[int], count: bool) -> torch.Tensor:
    """``table[segment of i, code of i]`` with the codes built element by element."""
    numel = sum(seg)
    code = torch.zeros(numel, dtype=torch.int64)
    for p, buf in enumerate(packed):
        bits = ((buf.reshape(-1, 1).long() >> torch.arange(8)) & 1).reshape(-1)[:numel]
        code += bits if count else bits << p
    segment = torch.repeat_interleave(torch.arange(len(seg)), torch.tensor(seg))
    return table[segment, code]


def _case(world: int, count: bool, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    numel = sum(SEG)
    packed = [torch.randint(0, 256, ((numel + 7) // 8,), generator=g, dtype=torch.uint8) for _ in range(world)]
    if count:
        table = signbits.vote_table(torch.rand(len(SEG), generator=g, dtype=dtype), world, dtype)
    else:
        table = signbits.sum_table([torch.rand(len(SEG), generator=g, dtype=dtype) for _ in range(world)], dtype)
    return table, packed


@pytest.mark.parametrize("chunk", [3, 1 << 15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world, count", [(1, False), (2, False), (3, False), (4, False), (5, False), (8, False),
                                          (1, True), (2, True), (3, True), (4, True), (15, True), (16, True),
                                          (17, True), (29, True), (30, True)])
def test_decode_equals_the_per_element_definition_bit_for_bit(world: int, count: bool, dtype: torch.dtype,
                                                               chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signbits, "CHUNK_BYTES", chunk)
    table, packed = _case(world, count, dtype, seed=world * 2 + count)
    want = _reference(table, packed, SEG, count)
    got = signbits.decode(table, packed, SEG, sum(SEG), count=count)
    assert torch.equal(got, want)
    odd = torch.empty(sum(SEG) + 1, dtype=dtype)[1:]  # an output not aligned for pairs
    assert torch.equal(signbits.decode(table, packed, SEG, sum(SEG), odd, count=count), want)


@pytest.mark.parametrize("seg", [[1], [2], [7], [8, 1], [1, 1, 1]])
@pytest.mark.parametrize("world, count", [(1, False), (4, False), (3, True), (16, True)])
def test_decode_of_tiny_buffers(seg: list[int], world: int, count: bool) -> None:
    g = torch.Generator().manual_seed(len(seg) + world)
    numel = sum(seg)
    packed = [torch.randint(0, 256, ((numel + 7) // 8,), generator=g, dtype=torch.uint8) for _ in range(world)]
    if count:
        table = signbits.vote_table(torch.rand(len(seg), generator=g), world, torch.float32)
    else:
        table = signbits.sum_table([torch.rand(len(seg), generator=g) for _ in range(world)], torch.float32)
    assert torch.equal(signbits.decode(table, packed, seg, numel, count=count), _reference(table, packed, seg, count))


def test_pair_table_holds_two_consecutive_elements() -> None:
    table = torch.randn(3, 256)
    pairs = signbits.pair_table(table).view(torch.float32).reshape(3, 256, 2)
    lo, hi = torch.arange(256) & 15, torch.arange(256) >> 4
    assert torch.equal(pairs[:, :, 0], table[:, lo]) and torch.equal(pairs[:, :, 1], table[:, hi])

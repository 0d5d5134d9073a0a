"""fp16/bf16's CPU encode (chunked divide-and-cast, reused message buffers): the same message
as the device path, poisoned exactly when it must be, and no buffer shared by two messages
in flight."""

from __future__ import annotations

import pytest
import torch

from lowcomm.compress import cast
from lowcomm.compress.codec import Layout, codec_class

N = 3 * cast.CHUNK + 17  # several chunks and a short last one
LAYOUT = Layout.of(["a", "b"], [(N - 5,), (5,)], {"a": 0, "b": 1})
TRUE = torch.tensor(True)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("pad_to", [1, 4, 1000])
def test_cpu_encode_equals_the_device_path_bit_for_bit(name: str, pad_to: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 100
    bufs = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
        msg = codec_class(name)(world=3).encode(x.clone(), LAYOUT, TRUE, pad_to=pad_to)
        bufs[fast] = (msg.buf.clone(), msg.numel)
    assert bufs["1"][1] == bufs["0"][1] == N
    assert torch.equal(bufs["1"][0], bufs["0"][0])


@pytest.mark.parametrize("where", [0, cast.CHUNK + 3, N - 1])
def test_a_value_overflowing_fp16_after_the_division_poisons_the_whole_message(where: int) -> None:
    x = torch.zeros(N)
    x[where] = 70_000.0 * 2  # finite in fp32, inf in fp16 once divided by 2
    msg = codec_class("fp16")(world=2).encode(x, LAYOUT, TRUE, pad_to=8)
    assert bool(torch.isnan(msg.buf).all())
    ok = codec_class("fp16")(world=2).encode(torch.full((N,), 1000.0), LAYOUT, TRUE)
    assert not bool(torch.isnan(ok.buf).any())
    flagged = codec_class("fp16")(world=2).encode(torch.ones(N), LAYOUT, torch.tensor(False))
    assert bool(torch.isnan(flagged.buf).all())  # the caller's flag poisons it too


def test_a_message_buffer_is_reused_only_once_nothing_references_it() -> None:
    codec = codec_class("fp16")(world=2)
    x = torch.randn(N)
    first = codec.encode(x, LAYOUT, TRUE)
    second = codec.encode(x, LAYOUT, TRUE)  # first still held: its buffer is not taken
    assert first.buf.data_ptr() != second.buf.data_ptr()
    out = torch.empty(N)
    codec.decode(first, first.buf, out)
    assert torch.equal(out, x.div(2).half().float())
    shard = first.buf[:10]  # decoded, but a view of its buffer is still alive
    ptr = first.buf.data_ptr()
    del first
    third = codec.encode(x, LAYOUT, TRUE)
    assert third.buf.data_ptr() not in (ptr, second.buf.data_ptr())
    del shard, second
    fourth = codec.encode(x * 2, LAYOUT, TRUE)
    assert fourth.buf.data_ptr() == ptr  # nothing references it any more: reused
    assert torch.equal(third.buf, x.div(2).half())  # untouched by the later encode
    assert torch.equal(fourth.buf, (x * 2).div(2).half())

"""The bucket-layout replay behind exact resume: a bucket made of recorded buckets is synced as
those buckets, in the recorded order and buffer layout, and its results land where they belong."""

from __future__ import annotations

from typing import Any

import torch

from lowcomm.comm.hooks.replay import BucketReplay, VirtualBucket, sync_as_parts


class FakeBucket:
    """What the hook reads of a ``dist.GradBucket``: the buffer, the parameters, last or not."""

    def __init__(self, params: list[torch.Tensor], last: bool = True) -> None:
        self._params = params
        self._buffer = torch.cat([p.detach().reshape(-1) for p in params])
        self._last = last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def index(self) -> int:
        return 0


def _params() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(0.0, 6.0).reshape(2, 3), "b": torch.tensor([10.0, 11.0]),
            "c": torch.tensor([[20.0], [21.0], [22.0]])}


def _replay(params: dict[str, torch.Tensor]) -> BucketReplay:
    names = {id(p): n for n, p in params.items()}
    return BucketReplay(lambda p: names[id(p)])


def test_nothing_is_split_before_a_load_or_when_layouts_agree() -> None:
    ps = _params()
    replay = _replay(ps)
    assert replay.split(["a", "b", "c"]) is None  # nothing loaded
    replay.load([["a", "b", "c"]])
    assert replay.split(["a", "b", "c"]) is None  # the same layout: synced as it is


def test_a_bucket_holding_recorded_buckets_is_split_into_them_in_recorded_order() -> None:
    ps = _params()
    replay = _replay(ps)
    replay.load([["c", "b"], ["a"]])
    assert replay.split(["a", "b", "c"]) == [["c", "b"], ["a"]]
    replay.load([["b", "a", "c"]])  # one recorded bucket in another order: replayed too
    assert replay.split(["a", "b", "c"]) == [["b", "a", "c"]]


def test_layouts_that_do_not_fit_together_are_not_split() -> None:
    ps = _params()
    replay = _replay(ps)
    replay.load([["c", "a"], ["b"]])
    assert replay.split(["a", "b"]) is None  # "c" is missing here
    replay.load([["c", "x"], ["a", "b"]])  # a recorded name this model does not have
    assert replay.split(["a", "b", "c"]) is None


def test_parts_are_synced_as_buckets_of_their_own_and_copied_back_in_place() -> None:
    ps = _params()
    bucket = FakeBucket([ps["a"], ps["b"], ps["c"]])
    seen: list[tuple[int, list[float], bool]] = []

    def hook(vb: Any) -> torch.futures.Future[torch.Tensor]:
        assert isinstance(vb, VirtualBucket)
        seen.append((vb.index(), vb.buffer().tolist(), vb.is_last()))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(vb.buffer() * (vb.index() + 2))  # part 0 doubled, part 1 tripled
        return fut

    out = sync_as_parts(bucket, ["a", "b", "c"], [["c", "b"], ["a"]], hook).wait()
    # each part's buffer holds its tensors in the recorded order; only the last part is last
    assert seen == [(0, [20.0, 21.0, 22.0, 10.0, 11.0], False), (1, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], True)]
    assert out is bucket.buffer()
    assert out.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0, 20.0, 22.0, 40.0, 42.0, 44.0]


def test_the_recorded_layout_is_the_last_completed_step_and_a_replay_lasts_one_step() -> None:
    ps = _params()
    replay = _replay(ps)
    replay.note(["c"], first=True)
    replay.note(["a", "b"], first=False)
    replay.end_step()
    assert replay.state_dict() == [["c"], ["a", "b"]]
    replay.load(replay.state_dict())
    assert replay.pending == [["c"], ["a", "b"]]
    replay.note(["c"], first=True)
    replay.end_step()
    assert replay.pending is None and replay.state_dict() == [["c"]]

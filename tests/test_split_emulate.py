"""``lowcomm split --compute emulated:scale=K``: what the replayed steps wait for and send.

The waits are checked by recording what the replay asks to wait (never by timing), and the
link by a stub that records each call; the end-to-end run is in ``test_split_cli``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lowcomm.errors import UsageError
from lowcomm.split import emulate
from lowcomm.split.config import PROFILE_STEPS, PROFILE_WARMUP, split_compute
from lowcomm.split.transport import ForwardMessage, Kind


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    asked: list[float] = []
    monkeypatch.setattr(emulate, "_wait", asked.append)
    return asked


class _Link:
    def __init__(self, messages: list[ForwardMessage] | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.messages = list(messages or [])

    def send_forward(self, tensors: list[torch.Tensor], mask: torch.Tensor, labels: Any, *, train: bool) -> None:
        self.calls.append(("send_forward", (tensors, mask, labels, train)))

    def recv_backward(self) -> list[torch.Tensor]:
        self.calls.append(("recv_backward", None))
        return []

    def recv_forward(self, widths: Any, *, device: Any) -> ForwardMessage:
        self.calls.append(("recv_forward", widths))
        return self.messages.pop(0)

    def send_backward(self, grads: list[torch.Tensor]) -> None:
        self.calls.append(("send_backward", grads))


def test_the_edge_waits_its_median_measured_computation_divided_by_the_scale(waits: list[float]) -> None:
    replay = emulate.EdgeReplay(scale=4.0)
    z, mask = torch.ones(2, 3, 5, requires_grad=True), torch.ones(2, 3, dtype=torch.int64)
    # the warm-up steps are left out of the medians
    steps = [(90.0, 90.0)] * PROFILE_WARMUP + [(1.0, 10.0), (2.0, 30.0), (3.0, 20.0)]
    steps += [(2.0, 20.0)] * (PROFILE_STEPS - len(steps))
    for fwd, bwd in steps:
        assert replay.measuring
        replay.record(fwd, bwd, fwd + bwd, [z * 2], mask, None)
    assert not replay.measuring
    link = _Link()
    replay.replay(SimpleNamespace(link=link))  # type: ignore[arg-type]
    assert waits == [2.0 / 4.0, 20.0 / 4.0]
    (name, (sent, sent_mask, _, train)), (after, _) = link.calls
    assert (name, after, train) == ("send_forward", "recv_backward", True)
    assert torch.equal(sent[0], torch.full((2, 3, 5), 2.0)) and not sent[0].requires_grad
    assert sent_mask is mask
    assert replay.measured(7.0)["edge_forward_s"] == 2.0 and replay.measured(7.0)["cloud_s"] == 7.0


def test_the_cloud_waits_before_and_after_sending_a_gradient_shaped_like_the_activations(
        waits: list[float]) -> None:
    replay = emulate.CloudReplay(scale=2.0)
    steps = [(50.0, 50.0)] * PROFILE_WARMUP + [(4.0, 1.0), (6.0, 3.0), (8.0, 2.0)]
    steps += [(6.0, 2.0)] * (PROFILE_STEPS - len(steps))
    for before, after in steps:
        replay.record(before, after)
    x = torch.randn(2, 3, 4, requires_grad=True)
    link = _Link([ForwardMessage(Kind.TRAIN, [x], torch.ones(2, 3, dtype=torch.int64)), ForwardMessage(Kind.STOP)])
    replay.serve(SimpleNamespace(link=link, plan=SimpleNamespace(widths=[4])), torch.device("cpu"))  # type: ignore[arg-type]
    assert waits == [6.0 / 2.0, 2.0 / 2.0]
    names = [name for name, _ in link.calls]
    assert names == ["recv_forward", "send_backward", "recv_forward"]
    grad = link.calls[1][1][0]
    assert grad.shape == x.shape and not grad.requires_grad


def test_an_evaluation_batch_during_the_replay_is_refused(waits: list[float]) -> None:
    replay = emulate.CloudReplay(scale=1.0)
    link = _Link([ForwardMessage(Kind.EVAL, [torch.zeros(1, 1, 1)], torch.ones(1, 1, dtype=torch.int64))])
    with pytest.raises(UsageError, match="evaluation batch"):
        replay.serve(SimpleNamespace(link=link, plan=SimpleNamespace(widths=[1])), torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("text, unsplit, steps, words", [
    ("emulated:profile.json", False, 10, "real or emulated:scale=K"),
    ("emulated:scale=0", False, 10, "K > 0"),
    ("emulated:scale=3", True, 10, "--unsplit"),
    ("emulated:scale=3", False, None, f"N > {PROFILE_STEPS}"),
    ("emulated:scale=3", False, PROFILE_STEPS, f"N > {PROFILE_STEPS}"),
])
def test_what_cannot_be_emulated_is_refused_with_the_reason(text: str, unsplit: bool, steps: int | None,
                                                            words: str) -> None:
    with pytest.raises(UsageError, match=words.replace("+", r"\+")):
        split_compute(text, unsplit=unsplit, steps=steps)


def test_real_compute_and_a_scale_parse() -> None:
    assert not split_compute(None, unsplit=True, steps=None).emulated
    spec = split_compute("emulated:scale=30", unsplit=False, steps=PROFILE_STEPS + 1)
    assert spec.scale == 30.0 and spec.label == "emulated:scale=30"

"""Emulated compute for split fine-tuning: ``lowcomm split --compute emulated:scale=K``.

Why: on a CPU a split step computes for about a second whatever crosses the link, so the
link's share of the step, which the compression shrinks, is hidden. On the hardware split
fine-tuning is meant for (a GPU server as the cloud, an accelerator at the edge) the same step
computes in milliseconds. This mode shows what such a machine would see, as the bench's
``--compute emulated:scale=K`` (:mod:`lowcomm.runtime.emulated`) does for data-parallel
training: the first :data:`~lowcomm.split.config.PROFILE_STEPS` training steps run for real and time each side's
computation (the median after a few warm-up steps) (wall-clock minus the time blocked on the link); every later step *waits* that
time divided by ``K`` instead of computing, and then sends the real message through the real
link (same header, same wire dtype, same bytes, counted by the accounting layer). Only the
computation is emulated; the link, its shaping and its bytes are real.

What the replayed messages carry: the edge re-sends the last measured step's cut activations,
mask and labels; the cloud answers with a same-shaped stand-in for their gradient (the
received tensor itself). Values do not matter for timing, so nothing trains in the replayed
steps and no accuracy is reported (the summary says ``compute emulated``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from lowcomm.errors import UsageError
from lowcomm.split.config import PROFILE_STEPS, PROFILE_WARMUP
from lowcomm.split.model import SplitCloud, SplitEdge
from lowcomm.split.transport import Kind

def _median(values: list[float]) -> float:
    """The median after the warm-up steps (of all, when there are no others)."""
    return statistics.median(values[PROFILE_WARMUP:] or values)


def _wait(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


@dataclass
class EdgeReplay:
    """The edge's side: records the measured steps, then replays scaled ones."""

    scale: float
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    message: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None] | None = None

    @property
    def measuring(self) -> bool:
        """Whether the next step still runs for real."""
        return len(self.forward_s) < PROFILE_STEPS

    def record(self, forward_s: float, backward_s: float, step_s: float, sent: list[torch.Tensor],
               mask: torch.Tensor, labels: torch.Tensor | None) -> None:
        """One real step: its computation before and after the link, and the message it sent."""
        self.forward_s.append(max(0.0, forward_s))
        self.backward_s.append(max(0.0, backward_s))
        self.step_s.append(step_s)
        self.message = ([t.detach() for t in sent], mask, labels)

    def replay(self, split: SplitEdge) -> float:
        """One emulated step: wait, send the recorded message, receive the gradient, wait."""
        assert self.message is not None, "replay before any measured step"
        tensors, mask, labels = self.message
        start = time.perf_counter()
        _wait(_median(self.forward_s) / self.scale)
        split.link.send_forward(tensors, mask, labels, train=True)
        split.link.recv_backward()
        _wait(_median(self.backward_s) / self.scale)
        return time.perf_counter() - start

    def measured(self, cloud_s: float) -> dict[str, float]:
        """The medians the replay waits for (before division by the scale)."""
        return {"edge_forward_s": _median(self.forward_s), "edge_backward_s": _median(self.backward_s),
                "cloud_s": cloud_s, "real_step_time_s_median": _median(self.step_s)}


class CloudReplay:
    """The cloud's side: records its measured computation, then answers replayed steps.

    Its computation has two parts: before the gradient is sent (forward and backward) and
    after (the optimizer step), which runs while the edge runs its own backward.
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.before_s: list[float] = []
        self.after_s: list[float] = []

    @property
    def measuring(self) -> bool:
        """Whether the next training step still runs for real."""
        return len(self.before_s) < PROFILE_STEPS

    def record(self, before_s: float, after_s: float) -> None:
        """One real training step's computation before and after sending the gradient (its
        time minus the time blocked on the link)."""
        self.before_s.append(max(0.0, before_s))
        self.after_s.append(max(0.0, after_s))

    @property
    def median_s(self) -> tuple[float, float]:
        """The computation each replayed step waits for before and after sending the gradient
        (before division by the scale)."""
        if not self.before_s:
            return 0.0, 0.0
        return _median(self.before_s), _median(self.after_s)

    def serve(self, split: SplitCloud, device: torch.device) -> None:
        """Answer replayed steps until the edge stops: receive, wait, send a gradient's worth, wait."""
        before, after = self.median_s
        while True:
            msg = split.link.recv_forward(split.plan.widths, device=device)
            if msg.kind is Kind.STOP:
                return
            if msg.kind is not Kind.TRAIN:
                raise UsageError("compute emulated: the edge sent an evaluation batch during the replay")
            _wait(before / self.scale)
            split.link.send_backward([t.detach() for t in msg.tensors])
            _wait(after / self.scale)

"""Measurements of a step that the phase timers cannot see: when backward's compute ended,
and what the network interface really sent.

Why: exposed communication is the wait *after* the last gradient is ready; the accounting
layer counts payload bytes, the interface counter what actually left the host.
"""

from __future__ import annotations

import os
import time
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class LastGradClock:
    """Time at which the last gradient of backward was accumulated (compute end)."""

    def __init__(self) -> None:
        self.last = 0.0
        self._handles: list[RemovableHandle] = []

    def attach(self, model: nn.Module) -> None:
        """Watch every trainable parameter of ``model`` (replacing any earlier model)."""
        self.detach()
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._tick))

    def _tick(self, _: torch.Tensor) -> None:
        self.last = time.perf_counter()

    def detach(self) -> None:
        """Stop watching (before the model is rebuilt)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class InterfaceCounter:
    """Bytes this host really transmitted on one network interface (Linux sysfs).

    Set ``LOWCOMM_MEASURE_IFACE`` (the benchmark sets it to each worker's emulated link) to
    record, next to the bytes counted by the accounting layer, what actually left the
    worker, TCP/IP headers and any collective-algorithm overhead included.
    """

    def __init__(self, iface: str | None) -> None:
        self.path = f"/sys/class/net/{iface}/statistics/tx_bytes" if iface else None
        if self.path and not os.path.exists(self.path):
            self.path = None

    def read(self) -> int | None:
        """Bytes sent so far on the interface; None when not measured."""
        if self.path is None:
            return None
        with open(self.path) as f:
            return int(f.read())

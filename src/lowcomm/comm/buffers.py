"""Buffers reused across steps on the CPU, so a collective does not page-fault its output (or
a codec its message) in every step: the transport's receives (:data:`POOL`) and the fp16/bf16
codecs' messages (:class:`~lowcomm.compress.cast.CastCodec`, a pool of its own).

Why: an all-gather of compressed payloads receives P payloads into a fresh tensor every step
(QSGD on ResNet-50 at 8 workers: 190 MB per worker per step). glibc serves every allocation
above 32 MiB with a fresh ``mmap`` and gives it back on free, and below that its adaptive
threshold and heap trimming often do the same, so each step's receive pays first-touch page
faults on memory the previous step just returned: measured on a 2-vCPU VM, filling a fresh
50 MB tensor took 45-50 ms against 6-8 ms for the same copy into a reused one. On shared cores
those faults are taken by gloo's receiving threads and slow the transfer itself (emulated
ResNet-50, 8 workers, 1 Gbit/s: ``qsgd`` 3.23-3.63 s per step with fresh buffers, 2.75-2.87 s
reused; docs/benchmarks.md, "Receive buffers reused"). CUDA tensors come from PyTorch's
caching allocator, which reuses memory already, and keep a fresh ``new_empty``. The gloo ring's
scratch (:mod:`lowcomm.comm.ring`, under 32 MiB a ring on the models here) is not pooled: in
paired runs of ``lee18`` (8 emulated workers, 500 Mbit/s) pooling it gained nothing (3.98 and
4.39 s per step against 3.88 and 3.95 s).

When a buffer may be reused: when no tensor but the pool's own holds its storage, checked
through the storage's reference count (``torch._C._storage_Use_Count``). The pool hands out an
alias of its buffer, never the buffer object itself (the count counts tensors, not Python
references to one tensor), so a consumer that still holds the received tensor, a view or a
slice of it, or an unfinished collective that writes it, keeps it out of reach, and the pool
hands out a new buffer instead. Without that function (a torch that lacks it) nothing is
reused, which is the old behaviour.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

#: Buffers the pool keeps at most; a full pool forgets its least recently used free buffer
#: (bounded, so payload sizes that change between steps cannot make it grow without end).
LIMIT = 64

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t: torch.Tensor) -> int:
    """References to ``t``'s storage (``t`` itself and the temporary storage object included)."""
    assert _use_count is not None
    return _use_count(t.untyped_storage()._cdata)


class BufferPool:
    """Flat CPU buffers handed out again once nothing else holds them (module docstring)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._buffers: list[torch.Tensor] = []  # least recently used first
        self._lock = threading.Lock()  # callers may take buffers from several threads
        self._alone = _holders(torch.empty(1)) if _use_count is not None else 0

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``like``'s dtype on its device, contents
        undefined: a free buffer of that size from an earlier step, else a new one."""
        if like.device.type != "cpu" or _use_count is None:
            return like.new_empty(numel)
        with self._lock:
            for i, t in enumerate(self._buffers):
                if t.numel() == numel and t.dtype == like.dtype and self._free(t):
                    self._buffers.append(self._buffers.pop(i))
                    return t.view(numel)
            t = like.new_empty(numel)
            self._buffers.append(t)
            if len(self._buffers) > self.limit:
                victim = next((j for j, b in enumerate(self._buffers[:-1]) if self._free(b)), 0)
                del self._buffers[victim]
            return t.view(numel)  # an alias, so the storage counts this holder (module docstring)

    def _free(self, t: torch.Tensor) -> bool:
        return _holders(t) <= self._alone

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Forget every buffer (their memory goes once their last holder drops them)."""
        with self._lock:
            self._buffers.clear()


#: The process's pool, used by :mod:`lowcomm.comm.transport` for what its collectives receive.
POOL = BufferPool()

"""Exact resume under DDP's bucket rebuild: the first step after a resume replays the bucket
layout of the run that wrote the checkpoint.

Why: DDP builds its first step's buckets from ``model.parameters()`` order (with
``find_unused_parameters=False``: one bucket holding every parameter), then rebuilds them
once, after that step, in the order backward produced the gradients (the last layer first).
A run resumed at step ``k`` therefore syncs step ``k`` in the *initial* layout, while the run
it continues synced step ``k`` in the *rebuilt* one. The values are the same, their positions
in the buffer are not, and a ring all-reduce over three or more ranks adds each element in an
order that depends on its position: the resumed run drifts from the straight one by float
round-off (measured: 7e-9 on a 4-worker ``ssgd`` mlp after one resumed step, 1.5e-8 with the
low-rank codecs; two ranks are exact, ``a + b`` being commutative).

What this does: the hook records each step's bucket layout (parameter names per bucket, in
buffer order) and checkpoints the last one. After a load, a bucket that holds several of the
recorded buckets (DDP's initial bucket does) is synced as those buckets, one after another in
the recorded order: each is copied into a buffer of its own, runs through the hook exactly as
the original run's bucket did (same collective on the same bytes, same codec calls), and is
copied back. DDP then rebuilds its buckets from the resumed step's backward, which follows the
same graph, so later steps match as they are. Cost: one copy of the gradients on that one step.

A checkpoint written after the very first step cannot record the rebuilt layout (DDP has not
rebuilt yet), so for that step the hook records the layout DDP is about to build instead:
DDP's own assignment (``torch.distributed._compute_bucket_assignment_by_size`` with its bucket
caps) over the order backward readied the gradients in, observed with post-accumulate-grad
hooks during that step only (then removed). Where DDP's settings cannot be read, the observed
layout is recorded (round-off again, never a wrong result: any split syncs the same values).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Future = torch.futures.Future


class VirtualBucket:
    """A recorded bucket carved out of a larger DDP bucket: the ``dist.GradBucket`` methods the
    hook uses (``buffer``, ``parameters``, ``is_last``, ``index``), on a buffer of its own."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list[torch.Tensor], last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._params = params
        self._last = last

    def index(self) -> int:
        """Position of this bucket in the recorded layout."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """This bucket's own flat gradient buffer (the recorded order)."""
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the buffer holds, in buffer order."""
        return self._params

    def is_last(self) -> bool:
        """True for the last bucket of the step (the real bucket was the last one)."""
        return self._last


class BucketReplay:
    """Records the hook's bucket layouts and, after a load, splits a bucket into them."""

    def __init__(self, param_name: Callable[[torch.Tensor], str]) -> None:
        self._name = param_name
        self._current: list[list[str]] = []
        #: the last completed step's layout (checkpointed)
        self.layout: list[list[str]] = []
        #: the layout to replay on the first step after a load (None: nothing to replay)
        self.pending: list[list[str]] | None = None
        self._ready: list[torch.Tensor] = []
        self._ready_ids: set[int] = set()
        self._handles: list[Any] = []
        self._caps: tuple[int, int] | None = None

    def watch(self, ddp: nn.Module) -> None:
        """Observe the order backward readies ``ddp``'s gradients in until the first step ends
        (DDP's first step runs in its initial layout; :meth:`end_step` records the rebuilt one
        it predicts from that order). No-op for anything but DDP or where its bucket caps are
        not readable."""
        config = getattr(ddp, "_bucket_config", None)
        first, cap = getattr(config, "first_bucket_bytes_cap", None), getattr(config, "bucket_bytes_cap", None)
        if not isinstance(ddp, nn.parallel.DistributedDataParallel) or first is None or cap is None \
                or os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":
            return
        self._caps = (int(first), int(cap))
        seen: set[int] = set()
        for p in ddp.module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_ready))

    def _on_ready(self, p: torch.Tensor) -> None:
        if id(p) in self._ready_ids:  # a new backward (no_sync steps come first)
            self._ready, self._ready_ids = [], set()
        self._ready.append(p)
        self._ready_ids.add(id(p))

    def _predicted(self) -> list[list[str]] | None:
        """The buckets DDP rebuilds from the observed order (its own assignment function)."""
        if self._caps is None or not self._ready:
            return None
        n = len(self._ready)
        buckets, _ = dist._compute_bucket_assignment_by_size(self._ready, list(self._caps), [False] * n, list(range(n)))
        return [[self._name(self._ready[i]) for i in b] for b in buckets]

    def names(self, bucket: Any) -> list[str]:
        """The bucket's parameter names, in buffer order."""
        return [self._name(p) for p in bucket.parameters()]

    def note(self, names: Sequence[str], *, first: bool) -> None:
        """Record one bucket of the current step (``first``: the step's first bucket)."""
        if first:
            self._current = []
        self._current.append(list(names))

    def end_step(self) -> None:
        """The step's last bucket was synced: its layout becomes the recorded one (after the
        first step: the one DDP rebuilds, when it could be predicted) and a pending replay is
        done (DDP rebuilds its buckets before the next step)."""
        self.layout, self._current = self._current, []
        self.pending = None
        if self._handles:
            predicted = self._predicted()
            names = sorted(n for b in self.layout for n in b)
            if predicted is not None and sorted(n for b in predicted for n in b) == names:
                self.layout = predicted  # the same parameters, as DDP will bucket them from now on
            for h in self._handles:
                h.remove()
            self._handles, self._ready, self._ready_ids = [], [], set()

    def state_dict(self) -> list[list[str]]:
        """The recorded layout (plain lists of names)."""
        return [list(b) for b in self.layout]

    def load(self, layout: Sequence[Sequence[str]] | None) -> None:
        """Replay ``layout`` on the next step (None or empty: nothing to replay)."""
        self.pending = [list(b) for b in layout] if layout else None
        self.layout = list(self.pending or [])

    def split(self, names: Sequence[str]) -> list[list[str]] | None:
        """The recorded buckets a bucket holding ``names`` (in buffer order) is made of, when it
        holds two or more of them exactly, or one in another order; None when there is nothing
        to replay or the layouts do not fit together (then the bucket is synced as it is)."""
        if self.pending is None:
            return None
        have = set(names)
        parts = [b for b in self.pending if have.issuperset(b)]
        if sum(len(b) for b in parts) != len(names) or set().union(*map(set, parts)) != have:
            return None
        if len(parts) == 1 and parts[0] == list(names):
            return None
        return parts


def sync_as_parts(bucket: Any, names: Sequence[str], parts: list[list[str]],
                  hook: Callable[[Any], Future[torch.Tensor]]) -> Future[torch.Tensor]:
    """Sync ``bucket`` (its parameters called ``names``) as the recorded ``parts``: copy each
    part's gradients into a buffer of its own, in the recorded order, run ``hook`` on it as a
    :class:`VirtualBucket` (the last part is the step's last when the bucket is), then copy
    the results back into the bucket's buffer."""
    buf = bucket.buffer()
    params = bucket.parameters()
    offsets: dict[int, tuple[int, int]] = {}
    start = 0
    for p in params:
        offsets[id(p)] = (start, p.numel())
        start += p.numel()
    by_name = dict(zip(names, params))
    futures: list[Future[torch.Tensor]] = []
    pieces: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for i, names in enumerate(parts):
        ps = [by_name[n] for n in names]
        own = torch.cat([buf[offsets[id(p)][0]: offsets[id(p)][0] + offsets[id(p)][1]] for p in ps])
        last = bucket.is_last() and i == len(parts) - 1
        futures.append(hook(VirtualBucket(i, own, ps, last)))
        pieces.append((own, ps))

    def copy_back(_: Any) -> torch.Tensor:
        for fut, (_own, ps) in zip(futures, pieces):
            out = fut.value()
            pos = 0
            for p in ps:
                s, n = offsets[id(p)]
                buf[s: s + n].copy_(out[pos: pos + n])
                pos += n
        return buf

    return torch.futures.collect_all(futures).then(copy_back)


"""Batches read by DataLoader worker processes (``--data-workers``, ``--prefetch``).

Why the batches are planned in the training process and only *read* in the workers: the
order (which samples, in which batch, on which rank) must stay exactly the one the
in-process path gives, so that a run with workers trains on bit-identical batches and a
mid-epoch resume continues where it stopped. The plan of an epoch (this rank's index lists,
from the resume batch on) is set on a :class:`BatchPlan`, the DataLoader's batch sampler;
skipped batches are never handed to a worker, so nothing skipped is decoded. A worker reads
a whole batch with :func:`fetch_batch` (the same function the in-process path calls), so
both paths stack the same samples the same way.

Workers are persistent (started once, reused every epoch: a memory cache shared with them
and their import cost survive the epoch) and the loader draws its workers' seeds from its own
generator, not from the global RNG, so turning workers on does not shift the random
augmentation or anything else drawn in the training process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

Batch = tuple[Tensor, Tensor]


def fetch_batch(dataset: Dataset[Any], tensors: Sequence[Tensor] | None, idx: list[int]) -> Batch:
    """The samples at ``idx`` as one batch (indexing tensors directly when the data is held
    as tensors, else stacking ``dataset[i]``)."""
    if tensors is not None:
        t = torch.as_tensor(idx)
        return tensors[0][t], tensors[1][t]
    items = [dataset[i] for i in idx]
    xs, ys = zip(*items)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.stack([torch.as_tensor(y) for y in ys])


class BatchPlan(Sampler[list[int]]):
    """The index lists of the current epoch, set before each epoch by the training process
    (a persistent loader re-iterates its batch sampler there at every new epoch)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


class _BatchReader(Dataset[Batch]):
    """What a worker holds: reads one planned batch with :func:`fetch_batch`."""

    def __init__(self, dataset: Dataset[Any], tensors: Sequence[Tensor] | None) -> None:
        self.dataset = dataset
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Batch:
        return fetch_batch(self.dataset, self.tensors, [i])

    def __getitems__(self, idx: list[int]) -> Batch:
        return fetch_batch(self.dataset, self.tensors, idx)


def _as_read(batch: Any) -> Any:
    """The reader already returns a stacked batch: nothing left to collate."""
    return batch


def batch_loader(dataset: Dataset[Any], tensors: Sequence[Tensor] | None, plan: BatchPlan, *,
                 workers: int, prefetch: int | None = None, pin_memory: bool = False) -> DataLoader[Batch]:
    """A loader of ``plan``'s batches read by ``workers`` (>= 1) persistent processes, each
    with up to ``prefetch`` batches prepared ahead (torch's default 2 when None), pinned for
    an asynchronous host-to-GPU copy when ``pin_memory``."""
    if workers < 1:
        raise ValueError("batch_loader needs at least one worker; 0 workers read in process")
    return DataLoader(_BatchReader(dataset, tensors), batch_sampler=plan, num_workers=workers,
                      collate_fn=_as_read, pin_memory=pin_memory, persistent_workers=True,
                      prefetch_factor=prefetch, generator=torch.Generator())

"""The ``--data`` namespace: datasets as :class:`DataBundle` objects the trainer can consume.

``lowcomm.data.create("cifar10", data_dir="~/data")`` returns train/test datasets yielding
``(x, y)`` pairs plus what the trainer needs to pick model and loss (task, classes or
vocabulary, per-sample input shape, the users of federated data) and an optional
*batch-level* training augmentation.

Datasets: ``mnist1d`` (the embedded default: generated offline, cached), ``digits``
(scikit-learn), ``cifar10``/``cifar100`` (python pickle batches), ``imagefolder`` (PNG/JPEG
class folders, loaded lazily), ``wikitext2`` (word-level LM), ``leaf`` (LEAF's federated
JSON, with users) and ``synthetic`` (random tensors, for timing only). File formats and
locations: ``docs/data.md``.

Why augmentation is a batch function and not a per-sample transform: in-memory datasets are
indexed in bulk, and tensor ops on a whole batch run on the training device (CUDA included)
instead of in Python per sample.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from lowcomm.errors import UsageError
from lowcomm.registry import Registry

Task = Literal["classification", "language_model", "stereo"]


@dataclass
class DataBundle:
    """A dataset ready for training.

    ``train``/``test`` yield ``(x, y)``: for classification ``x`` float of ``input_shape``
    and ``y`` an int64 scalar; for language models ``x`` and ``y`` int64 ``(T,)`` (targets
    are inputs shifted by one token). ``train_transform`` (if set) maps a training batch
    ``x`` to an augmented batch of the same shape on the same device; evaluation uses the
    datasets as they are (any normalization is already inside both datasets).
    """

    name: str
    train: Dataset
    test: Dataset
    task: Task
    input_shape: tuple[int, ...]
    num_classes: int | None = None
    vocab_size: int | None = None
    synthetic: bool = False
    train_transform: Callable[[Tensor], Tensor] | None = None
    valid: Dataset | None = None
    classes: list[str] | None = None
    #: one int user index per training sample where the data has users (``leaf``), for
    #: ``lowcomm fl --partition natural``; ``None`` for data without users
    users: np.ndarray | None = None

    @property
    def label(self) -> str:
        """Name for tables and JSON; synthetic data is always marked as such."""
        if not self.synthetic:
            return self.name
        tag = "synthetic (timing only)"
        return tag if self.name == "synthetic" else f"{self.name}: {tag}"

    @property
    def output_size(self) -> int:
        """Width of the model's output layer: classes, or the vocabulary for language models."""
        size = self.num_classes if self.task == "classification" else self.vocab_size
        assert size is not None
        return size


DATASETS: Registry[DataBundle] = Registry(
    "dataset",
    modules=[
        "lowcomm.data.embedded",
        "lowcomm.data.cifar",
        "lowcomm.data.imagefolder",
        "lowcomm.data.wikitext",
        "lowcomm.data.stereo",
        "lowcomm.data.synthetic",
        "lowcomm.data.leaf",
        "lowcomm.data.stdlib_corpus",
    ],
)




def register_dataset(name: str) -> Callable[[Callable[..., DataBundle]], Callable[..., DataBundle]]:
    """Decorator for a factory ``(*, data_dir: Path | None, seed: int, **kw) -> DataBundle``."""
    return DATASETS.register(name)


def create(name: str, *, data_dir: str | Path | None = None, seed: int = 0, **kwargs: Any) -> DataBundle:
    """Build dataset ``name``.

    ``data_dir`` is where the files are (or, for ``mnist1d``, where its cache goes);
    ``seed`` drives randomly generated data (``synthetic``). Real datasets and their splits
    do not depend on ``seed``, so runs with different seeds train on the same data.
    Unknown names, unknown options and missing files raise :class:`UsageError`.
    """
    factory = DATASETS.get(name)
    params = inspect.signature(factory).parameters
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        valid = ", ".join(k for k in params if k not in ("data_dir", "seed")) or "none"
        raise UsageError(f"dataset {name!r} has no option {', '.join(unknown)}; valid: {valid}")
    path = Path(data_dir).expanduser() if data_dir is not None else None
    return factory(data_dir=path, seed=seed, **kwargs)


def names() -> list[str]:
    """All registered dataset names, sorted."""
    return DATASETS.names()


__all__ = ["DATASETS", "DataBundle", "create", "names", "register_dataset"]

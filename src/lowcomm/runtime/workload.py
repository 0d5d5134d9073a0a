"""What is trained on what: seeding, the model sized to the data, the loss, per-rank batches.

Why apart from the loop: these are decided from the config and the dataset alone, and the
evaluation needs the same loss and batching as the training step.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from lowcomm import models as model_registry
from lowcomm.data import DataBundle
from lowcomm.data.cache import cache_dir
from lowcomm.data.pipeline import BatchPlan, batch_loader, fetch_batch
from lowcomm.data.sample_cache import with_cache
from lowcomm.errors import UsageError
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.input_spec import parse_data_cache


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch: identical initial weights on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _accepted_kwargs(factory: Callable[..., nn.Module], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``factory`` accepts (all of them for ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def build_model(cfg: TrainConfig, bundle: DataBundle) -> nn.Module:
    """Create the model sized to the data (classes / vocabulary / input width)."""
    return model_for_data(cfg.model, cfg.model_args, bundle)


def model_for_data(model: str, model_args: dict[str, Any], bundle: DataBundle) -> nn.Module:
    """Model ``model`` sized to ``bundle`` (classes / vocabulary / input width); ``model_args``
    win over what the data implies. Shared by ``train``, ``fl`` and ``elastic``."""
    kwargs = model_kwargs_for_data(model, model_args, bundle)
    try:
        return model_registry.create(model, **kwargs)
    except TypeError as e:
        raise UsageError(f"model {model!r} does not accept these arguments: {e}") from None


def model_kwargs_for_data(model: str, model_args: dict[str, Any], bundle: DataBundle) -> dict[str, Any]:
    """The keyword arguments :func:`model_for_data` builds ``model`` with (recorded by files
    that must rebuild the same model later)."""
    factory = model_registry.MODELS.get(model)
    implied: dict[str, Any] = {}
    if bundle.task == "classification" and bundle.num_classes:
        implied["num_classes"] = bundle.num_classes
    if bundle.vocab_size:
        implied["vocab_size"] = bundle.vocab_size
    if bundle.task == "stereo":  # the model's disparity range follows the data's
        implied["max_disp"] = getattr(bundle.train, "max_disp", None)
    if bundle.input_shape and len(bundle.input_shape) == 3 and bundle.task == "classification":
        implied["in_channels"], implied["image_size"] = bundle.input_shape[0], bundle.input_shape[1]
    if bundle.input_shape:
        implied["input_dim"] = bundle.input_shape[0] if len(bundle.input_shape) == 1 else None
        implied = {k: v for k, v in implied.items() if v is not None}
    return {**_accepted_kwargs(factory, implied), **model_args}


def task_of(model_name: str, bundle: DataBundle) -> str:
    """The task ``bundle`` is for, refused when the model is built for another one."""
    info = getattr(model_registry, "info", None)
    model_task = info(model_name).task if info else bundle.task
    if model_task != bundle.task:
        raise UsageError(
            f"model {model_name!r} is a {model_task} model but data {bundle.name!r} is "
            f"{bundle.task} data"
        )
    return str(bundle.task)


def loss_fn(task: str, logits: Any, y: torch.Tensor, *, max_disp: float | None = None) -> torch.Tensor:
    """Cross-entropy, over every token for a language model; for stereo the multi-scale
    smooth-L1 loss over the valid pixels (``logits``: the list of disparity predictions in
    training, one map in evaluation; ``max_disp`` from the model)."""
    if task == "stereo":
        from lowcomm.elastic.stereo.loss import multiscale_loss

        preds = list(logits) if isinstance(logits, (list, tuple)) else [logits]
        return multiscale_loss(preds, y, max_disp=float(max_disp or 192.0))
    if task == "language_model":
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(logits, y)


class Batches:
    """Deterministic per-rank batches for an epoch, resumable at any batch index.

    Same permutation as ``DistributedSampler(shuffle=True, seed, drop_last=False)`` after
    ``set_epoch(epoch)``: every rank gets the same number of batches, so collectives match.
    With ``workers`` > 0 the planned batches are read by DataLoader worker processes
    (:mod:`lowcomm.data.pipeline`); the batches are the same, bit for bit, as with 0 workers
    (read here, in the training process).
    """

    def __init__(self, dataset: Dataset[Any], batch_size: int, rank: int, world: int, seed: int,
                 shuffle: bool = True, *, workers: int = 0, prefetch: int | None = None,
                 pin_memory: bool = False) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler: DistributedSampler[int] = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
        )
        self.tensors = getattr(dataset, "tensors", None)
        self.workers = workers
        self._plan = BatchPlan()
        self._loader = (batch_loader(dataset, self.tensors, self._plan, workers=workers, prefetch=prefetch,
                                     pin_memory=pin_memory) if workers > 0 else None)

    def __len__(self) -> int:
        """Batches per epoch on this rank (the last one may be short)."""
        return math.ceil(len(self.sampler) / self.batch_size)

    def plan(self, epoch: int, start_batch: int = 0) -> list[list[int]]:
        """This rank's index lists of ``epoch`` from ``start_batch`` on."""
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)
        return [indices[b * self.batch_size : (b + 1) * self.batch_size] for b in range(start_batch, len(self))]

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of ``epoch`` from ``start_batch`` on (resume mid-epoch: the
        skipped samples are not read)."""
        batches = self.plan(epoch, start_batch)
        if self._loader is None:
            for idx in batches:
                yield self.fetch(idx)
            return
        self._plan.batches = batches
        yield from self._loader

    def fetch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples at ``idx`` as one batch (indexing tensors directly when possible)."""
        return fetch_batch(self.dataset, self.tensors, idx)

    def close(self) -> None:
        """Stop the (persistent) worker processes now rather than at garbage collection;
        later epochs, if any, are read in the training process."""
        loader, self._loader = self._loader, None
        running = getattr(loader, "_iterator", None)  # DataLoader keeps its persistent workers there
        if running is not None and hasattr(running, "_shutdown_workers"):
            running._shutdown_workers()


def cache_samples(cfg: TrainConfig, bundle: DataBundle) -> DataBundle:
    """``bundle`` with its train and test sets behind the ``--data-cache`` store (unchanged for
    ``none`` and for data held as tensors). A disk cache without a folder goes to the data
    cache folder (``$LOWCOMM_CACHE_DIR`` or ``~/.cache/lowcomm``), under ``samples/``."""
    spec = parse_data_cache(cfg.data_cache)
    if spec.kind == "none":
        return bundle
    root = Path(spec.directory).expanduser() if spec.directory else cache_dir(None) / "samples"
    base = {"data": cfg.data, "data_dir": os.path.abspath(cfg.data_dir) if cfg.data_dir else None,
            "data_args": cfg.data_args, "seed": cfg.seed if bundle.synthetic else None}
    train = with_cache(bundle.train, spec.kind, directory=root, identity={**base, "split": "train"})
    test = with_cache(bundle.test, spec.kind, directory=root, identity={**base, "split": "test"})
    return dataclasses.replace(bundle, train=train, test=test)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP-style wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model

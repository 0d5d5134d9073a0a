"""What a federated run trains on: the data sized to the clients, the partition, the initial model.

Why apart from the engine: the Flower side of ``benchmarks/fl_vs_flower.py`` calls these same
functions, so both simulators see identical data, clients and initial weights.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from lowcomm import data as data_registry
from lowcomm.data import DataBundle
from lowcomm.errors import UsageError
from lowcomm.fl.partition import Partition, make_partition

#: training samples per client that ``mnist1d`` is generated for when not told otherwise
#: (the issue's anchor: 1000 clients x 40 samples)
DEFAULT_SAMPLES_PER_CLIENT = 40
#: mnist1d's own train fraction (``train_split`` in its arguments)
MNIST1D_TRAIN_SPLIT = 0.8
#: mnist1d's own ``num_samples``
MNIST1D_DEFAULT_SAMPLES = 5000


def load_data(data: str, *, data_dir: str | None, data_args: dict[str, Any], clients: int,
              samples_per_client: int | None = None) -> DataBundle:
    """Dataset ``data``; generated data (``mnist1d``) is made large enough for the clients.

    ``mnist1d`` without ``num_samples`` in ``data_args`` is generated with
    ``clients * samples_per_client`` training samples (default 40 each, at least mnist1d's own
    5,000 in all): MNIST-1D can be any size, and 1000 clients of 4 samples would not be FL.
    """
    args = dict(data_args)
    if data == "mnist1d" and "num_samples" not in args:
        per_client = samples_per_client or DEFAULT_SAMPLES_PER_CLIENT
        needed = math.ceil(clients * per_client / MNIST1D_TRAIN_SPLIT)
        if needed > MNIST1D_DEFAULT_SAMPLES:  # else mnist1d's own size (and its cached file)
            args["num_samples"] = needed
    elif samples_per_client is not None and data != "mnist1d":
        raise UsageError(f"--samples-per-client applies to generated data (mnist1d), not {data!r}")
    bundle = data_registry.create(data, data_dir=data_dir, **args)
    if bundle.task != "classification":
        raise UsageError(f"lowcomm fl trains classifiers; data {data!r} is {bundle.task} data")
    return bundle


def train_labels(bundle: DataBundle) -> np.ndarray:
    """The training labels as an int64 array (for partitioning by label)."""
    x, y = train_tensors(bundle)
    del x
    return y.numpy().astype(np.int64)


def train_tensors(bundle: DataBundle) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole training set as two tensors (in-memory datasets hand theirs over uncopied)."""
    return _as_tensors(bundle.train)


def test_tensors(bundle: DataBundle) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole test set as two tensors."""
    return _as_tensors(bundle.test)


def _as_tensors(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and len(tensors) == 2:
        return tensors[0], tensors[1].long()
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.as_tensor(ys, dtype=torch.long)


def build_partition(bundle: DataBundle, spec: str, *, clients: int, seed: int) -> Partition:
    """Clients of ``bundle``'s training set under ``spec`` (identical on every rank and in Flower)."""
    return make_partition(spec, labels=train_labels(bundle), num_clients=clients, seed=seed,
                          users=bundle.users)


def initial_model(model: str, model_args: dict[str, Any], bundle: DataBundle, *, seed: int) -> nn.Module:
    """The global model before round 0: ``torch.manual_seed(seed)``, then the model sized to the data."""
    from lowcomm.runtime.workload import model_for_data

    torch.manual_seed(seed)
    return model_for_data(model, model_args, bundle)

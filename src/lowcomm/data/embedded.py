"""Datasets that need no download: MNIST-1D (generated, the default) and sklearn's digits.

Both are small enough to live in memory as tensors and identical on every rank: MNIST-1D is
generated with the ``mnist1d`` package's default arguments (its own fixed seed 42; 4,000
train and 1,000 test sequences of 40 floats), digits uses a fixed stratified 80/20 split.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.data.cache import cache_dir, load_or_create_npz

MNIST1D_CACHE_VERSION = 2


def _mnist1d_args(num_samples: int | None) -> object:
    from mnist1d.data import get_dataset_args

    args = get_dataset_args()
    if num_samples is not None:
        args.num_samples = num_samples
    return args


def _generate_mnist1d(args: object) -> dict[str, np.ndarray]:
    from mnist1d.data import make_dataset

    # make_dataset reseeds the global numpy/random generators; keep the caller's state.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {
        "x": d["x"].astype(np.float32), "y": d["y"].astype(np.int64),
        "x_test": d["x_test"].astype(np.float32), "y_test": d["y_test"].astype(np.int64),
    }


def mnist1d_cache_path(data_dir: Path | None, num_samples: int | None = None) -> Path:
    """Where the generated arrays for these arguments are cached.

    The key is the installed mnist1d release and ``num_samples`` (the only argument we
    change; a release fixes its defaults), read without importing mnist1d: its import pulls
    scipy and matplotlib (~3 s, ~75 MB per process), which every worker of a run paid just
    to find the cached file.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("mnist1d")
    except PackageNotFoundError:
        release = "unknown"
    key = {"mnist1d": release, "num_samples": num_samples}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir(data_dir) / f"mnist1d-v{MNIST1D_CACHE_VERSION}-{digest}.npz"


@register_dataset("mnist1d")
def mnist1d(*, data_dir: Path | None, seed: int, num_samples: int | None = None) -> DataBundle:
    """MNIST-1D, generated offline and cached as .npz (``num_samples`` defaults to 5000)."""
    arrays = load_or_create_npz(mnist1d_cache_path(data_dir, num_samples),
                                lambda: _generate_mnist1d(_mnist1d_args(num_samples)))
    train = TensorDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]))
    test = TensorDataset(torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"]))
    return DataBundle(name="mnist1d", train=train, test=test, task="classification",
                      input_shape=(int(arrays["x"].shape[1]),), num_classes=10)


@register_dataset("digits")
def digits(*, data_dir: Path | None, seed: int) -> DataBundle:
    """sklearn's 8x8 digits as 64 standardized features; stratified 80/20 split, fixed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y)
    mean = x_train.mean(0)
    std = x_train.std(0)
    std[std == 0] = 1.0  # always-blank border pixels
    def as_tensors(xs: np.ndarray, ys: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(((xs - mean) / std).astype(np.float32)),
                             torch.from_numpy(ys.astype(np.int64)))

    return DataBundle(name="digits", train=as_tensors(x_train, y_train),
                      test=as_tensors(x_test, y_test), task="classification",
                      input_shape=(64,), num_classes=10)

"""LEAF benchmark data (FEMNIST, Synthetic, ...) in LEAF's own JSON layout, with its users.

LEAF (Caldas et al. 2018) ships each split as ``train/*.json`` and ``test/*.json``, every
file ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``.
Why keep the users: federated runs partition by writer (``--partition natural``), which is
the non-IID-ness the benchmark was built for; :attr:`DataBundle.users` carries one user index
per training sample, users numbered in sorted-name order so every rank numbers them alike.
Only numeric features are read (FEMNIST's 784 pixels, Synthetic's vectors); LEAF sets whose
``x`` is text or file names (Shakespeare, Sent140, CelebA) are refused with that reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.errors import UsageError

_LAYOUT = ("train/*.json and test/*.json, each {\"users\": [...], \"num_samples\": [...], "
           "\"user_data\": {user: {\"x\": [[floats]...], \"y\": [ints]}}}")


def _split_files(data_dir: Path | None, split: str) -> list[Path]:
    where = str(data_dir) if data_dir is not None else "--data-dir (none given)"
    files = sorted((data_dir / split).glob("*.json")) if data_dir is not None else []
    if not files:
        raise UsageError(f"leaf: expected {_LAYOUT} under {where}; found no {split}/*.json; see docs/data.md")
    return files


def read_split(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``user -> (x float32 (n, d), y int64 (n,))`` over all files of a split (a user's
    data split over several files is concatenated in file order)."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"leaf: cannot read {path} as JSON ({e}); expected {_LAYOUT}") from None
        user_data = doc.get("user_data") if isinstance(doc, dict) else None
        if not isinstance(user_data, dict) or not isinstance(doc.get("users"), list):
            raise UsageError(f"leaf: {path} lacks the keys 'users' and 'user_data'; expected {_LAYOUT}")
        for name in doc["users"]:
            user = str(name)  # JSON object keys are strings, so user_data is keyed by str
            x, y = _user_arrays(path, user, user_data.get(user))
            if user in out:
                prev_x, prev_y = out[user]
                x = np.concatenate([prev_x, x]) if len(x) and len(prev_x) else (x if len(x) else prev_x)
                y = np.concatenate([prev_y, y])
            out[user] = (x, y)
    return out


def _user_arrays(path: Path, user: str, record: Any) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise UsageError(f"leaf: {path}: user {user!r} needs user_data[{user!r}] with keys 'x' and 'y'")
    try:
        x = np.asarray(record["x"], dtype=np.float32)
        y_raw = np.asarray(record["y"])
    except (TypeError, ValueError):
        raise UsageError(f"leaf: {path}: user {user!r}: 'x' must be equal-length lists of numbers (this "
                         "loader reads numeric features, not text or file names)") from None
    if len(x) == 0:
        x = x.reshape(0, 0)
    if x.ndim != 2 or y_raw.shape != (len(x),):
        raise UsageError(f"leaf: {path}: user {user!r}: expected x as (samples, features) and one y per "
                         f"sample, got x {x.shape} and y {y_raw.shape}")
    if len(y_raw) and (not np.issubdtype(y_raw.dtype, np.number)
                       or not np.all(np.mod(y_raw, 1) == 0) or y_raw.min() < 0):
        raise UsageError(f"leaf: {path}: user {user!r}: y must be integer class ids >= 0")
    return x, y_raw.astype(np.int64)


def _stack(split: dict[str, tuple[np.ndarray, np.ndarray]], users: list[str], dim: int,
           where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate the users' samples in ``users`` order; also the user index of each sample."""
    parts = [split[u] for u in users if u in split]
    for x, _ in parts:
        if len(x) and x.shape[1] != dim:
            raise UsageError(f"leaf: {where}: samples have {x.shape[1]} features, others have {dim}")
    xs = [x for x, _ in parts if len(x)]
    x = np.concatenate(xs) if xs else np.zeros((0, dim), dtype=np.float32)
    y = np.concatenate([y for _, y in parts]) if parts else np.zeros(0, dtype=np.int64)
    sizes = [len(split[u][1]) if u in split else 0 for u in users]
    owner = np.repeat(np.arange(len(users), dtype=np.int64), sizes)
    return x, y, owner


@register_dataset("leaf")
def leaf(*, data_dir: Path | None, seed: int, max_users: int | None = None) -> DataBundle:
    """LEAF JSON from ``data_dir``; ``max_users`` keeps the first users in sorted-name order
    (and their test samples), e.g. to run a small slice of FEMNIST's 3,550 writers."""
    train = read_split(_split_files(data_dir, "train"))
    test = read_split(_split_files(data_dir, "test"))
    users = sorted(u for u, (_, y) in train.items() if len(y))
    if not users:
        raise UsageError(f"leaf: the train files under {data_dir} hold no samples; expected {_LAYOUT}")
    if max_users is not None:
        if isinstance(max_users, bool) or not isinstance(max_users, int) or max_users < 1:
            raise UsageError(f"leaf: max_users must be an integer >= 1, got {max_users!r}")
        users = users[:max_users]
    dim = int(train[users[0]][0].shape[1])
    x_train, y_train, owner = _stack(train, users, dim, "train")
    test_users = users if max_users is not None else sorted(test)
    x_test, y_test, _ = _stack(test, test_users, dim, "test")
    if len(y_test) == 0:
        raise UsageError(f"leaf: the test files under {data_dir} hold no samples of the chosen users")
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return DataBundle(
        name="leaf", train=TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
        test=TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)),
        task="classification", input_shape=(dim,), num_classes=num_classes, users=owner)

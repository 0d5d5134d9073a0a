"""CIFAR-10/100 from the python pickle batches of https://www.cs.toronto.edu/~kriz/cifar.html.

Images stay uint8 in memory (150 MB for the 50k training images, instead of 600 MB as
float) and are normalized per sample when read, for train *and* test. The training
augmentation (random 32x32 crop of the 4-pixel padded image, horizontal flip) is a batch
function in ``DataBundle.train_transform``; it pads with the normalized value of black, which
is what torchvision's pad-then-normalize pipeline does.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.data.augment import CropFlip
from lowcomm.errors import UsageError

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


class NormalizedImages(Dataset):
    """uint8 images ``(N, C, H, W)`` + labels; yields ``((x/255 - mean)/std, label)``."""

    #: nothing to decode: the sample cache (``--data-cache``) leaves it alone
    held_in_memory = True

    def __init__(self, images: Tensor, labels: Tensor, *, mean: Sequence[float],
                 std: Sequence[float]) -> None:
        if images.dtype != torch.uint8:
            raise TypeError("images must be uint8")
        self.images = images
        self.labels = labels
        c = images.shape[1]
        self._scale = (1.0 / (255.0 * torch.tensor(std, dtype=torch.float32))).view(c, 1, 1)
        self._shift = (torch.tensor(mean, dtype=torch.float32)
                       / torch.tensor(std, dtype=torch.float32)).view(c, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.images[i].float() * self._scale - self._shift, self.labels[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[Tensor, Tensor]]:
        # DataLoader fast path: normalize the whole batch in one op.
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self.images[idx].float() * self._scale - self._shift
        return list(zip(x.unbind(0), self.labels[idx].unbind(0)))


def _resolve(data_dir: Path | None, folder: str, required: list[str], expected: str,
             name: str) -> Path:
    """The folder holding ``required`` files: ``data_dir/folder`` or ``data_dir`` itself."""
    def hint(where: str) -> str:
        return f"{name}: expected {expected} under {where}; see docs/data.md"

    if data_dir is None:
        raise UsageError(hint("--data-dir (none given)"))
    for candidate in (data_dir / folder, data_dir):
        if all((candidate / f).is_file() for f in required):
            return candidate
    raise UsageError(hint(str(data_dir)))


def _load_batch(path: Path, label_key: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d: dict[Any, Any] = pickle.load(f, encoding="bytes")
        d = {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}
        data = np.asarray(d["data"], dtype=np.uint8)
        labels = np.asarray(d[label_key], dtype=np.int64)
        images = data.reshape(len(data), 3, 32, 32)
    except Exception as exc:  # any unpickling/shape problem is a bad file, not a crash
        raise UsageError(
            f"{name}: {path} is not a CIFAR python batch (dict with b'data' (N, 3072) uint8 "
            f"and b'{label_key}'): {type(exc).__name__}: {exc}"
        ) from None
    if len(labels) != len(images):
        raise UsageError(f"{name}: {path} has {len(images)} images but {len(labels)} labels")
    return images, labels


def _bundle(name: str, train_files: list[Path], test_file: Path, label_key: str,
            num_classes: int, mean: Sequence[float], std: Sequence[float]) -> DataBundle:
    parts = [_load_batch(p, label_key, name) for p in train_files]
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    x_test, y_test = _load_batch(test_file, label_key, name)
    for y in (y_train, y_test):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise UsageError(f"{name}: labels must be in [0, {num_classes}), got {y.min()}..{y.max()}")

    def ds(x: np.ndarray, y: np.ndarray) -> NormalizedImages:
        return NormalizedImages(torch.from_numpy(x), torch.from_numpy(y), mean=mean, std=std)

    black = [-m / s for m, s in zip(mean, std)]
    return DataBundle(name=name, train=ds(x_train, y_train), test=ds(x_test, y_test),
                      task="classification", input_shape=(3, 32, 32), num_classes=num_classes,
                      train_transform=CropFlip(padding=4, fill=black))


@register_dataset("cifar10")
def cifar10(*, data_dir: Path | None, seed: int) -> DataBundle:
    """CIFAR-10: ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``."""
    train = [f"data_batch_{i}" for i in range(1, 6)]
    root = _resolve(data_dir, "cifar-10-batches-py", train + ["test_batch"],
                    "cifar-10-batches-py/data_batch_1..5 and test_batch", "cifar10")
    return _bundle("cifar10", [root / f for f in train], root / "test_batch", "labels", 10,
                   CIFAR10_MEAN, CIFAR10_STD)


@register_dataset("cifar100")
def cifar100(*, data_dir: Path | None, seed: int) -> DataBundle:
    """CIFAR-100 (fine labels): ``cifar-100-python/train`` and ``test``."""
    root = _resolve(data_dir, "cifar-100-python", ["train", "test"],
                    "cifar-100-python/train and test", "cifar100")
    return _bundle("cifar100", [root / "train"], root / "test", "fine_labels", 100,
                   CIFAR100_MEAN, CIFAR100_STD)

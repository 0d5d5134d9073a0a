"""Image class folders (ImageNet layout): ``train/<class>/*.png|jpg``, ``val/<class>/...``.

Images are decoded lazily with Pillow (installed with matplotlib), resized so the shorter
side is ``image_size * 256/224`` and center-cropped to ``image_size`` (the standard ImageNet
evaluation crop, used for both splits so that samples have a fixed shape), then normalized
with the ImageNet mean/std. Training augmentation is a random horizontal flip on the batch.
Class indices are the sorted training folder names; ``val`` may hold a subset of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.data.augment import Flip
from lowcomm.errors import UsageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EXTENSIONS = (".png", ".jpg", ".jpeg")

_EXPECTED = "train/<class>/*.png|jpg and val/<class>/*.png|jpg"


def _scan(split_dir: Path, classes: dict[str, int] | None) -> tuple[list[tuple[Path, int]], dict[str, int]]:
    folders = sorted(p for p in split_dir.iterdir() if p.is_dir())
    if classes is None:
        classes = {p.name: i for i, p in enumerate(folders)}
    samples = []
    for folder in folders:
        if folder.name not in classes:
            raise UsageError(
                f"imagefolder: class {folder.name!r} in {split_dir} has no training folder; "
                f"classes: {', '.join(classes)}"
            )
        for f in sorted(folder.iterdir()):
            if f.suffix.lower() in EXTENSIONS:
                samples.append((f, classes[folder.name]))
    return samples, classes


class ImageFiles(Dataset):
    """Lazily decoded, resized, center-cropped, normalized images ``(3, S, S)``.

    ``__getitem__`` is ``assemble(*decode(i))``: ``decode`` (Pillow: read, resize, crop, to
    uint8 ``(S, S, 3)``) is the costly part a sample cache keeps (:mod:`.sample_cache`),
    ``assemble`` (to float, normalize) runs after it, so a cached sample is bit-identical.
    """

    def __init__(self, samples: list[tuple[Path, int]], *, image_size: int) -> None:
        self.samples = samples
        self.image_size = image_size
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.assemble(*self.decode(i))

    def decode(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Image ``i`` as uint8 ``(S, S, 3)`` pixels (resized, center-cropped) and its label."""
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as opened:
            img = opened.convert("RGB")
            s = self.image_size
            short = round(s * 256 / 224)
            w, h = img.size
            scale = short / min(w, h)
            img = img.resize((max(s, round(w * scale)), max(s, round(h * scale))),
                             Image.Resampling.BILINEAR)
            w, h = img.size
            left, top = (w - s) // 2, (h - s) // 2
            img = img.crop((left, top, left + s, top + s))
            arr = np.asarray(img, dtype=np.uint8).copy()
        return arr, np.asarray(label, dtype=np.int64)

    def assemble(self, pixels: np.ndarray, label: np.ndarray) -> tuple[Tensor, Tensor]:
        """The normalized float sample ``(3, S, S)`` and int64 label of decoded pixels."""
        x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).float().div_(255.0)
        return (x - self._mean) / self._std, torch.tensor(int(label), dtype=torch.int64)

    def cache_fingerprint(self) -> list[object]:
        """What a disk cache entry depends on: the crop size and every file's path, label,
        size and modification time (an edited or replaced image is decoded again)."""
        files: list[object] = [self.image_size]
        for path, label in self.samples:
            st = path.stat()
            files.append((str(path.absolute()), label, st.st_size, st.st_mtime_ns))
        return files


@register_dataset("imagefolder")
def imagefolder(*, data_dir: Path | None, seed: int, image_size: int = 224) -> DataBundle:
    """ImageNet-style folders under ``data_dir`` (``train/`` and ``val/``)."""
    where = str(data_dir) if data_dir is not None else "--data-dir (none given)"
    if data_dir is None or not (data_dir / "train").is_dir() or not (data_dir / "val").is_dir():
        raise UsageError(f"imagefolder: expected {_EXPECTED} under {where}; see docs/data.md")
    if image_size <= 0:
        raise UsageError(f"imagefolder: image_size must be > 0, got {image_size}")
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise UsageError("imagefolder needs Pillow (pip install pillow)") from None
    train, classes = _scan(data_dir / "train", None)
    test, _ = _scan(data_dir / "val", classes)
    if not train or not test:
        raise UsageError(
            f"imagefolder: no .png/.jpg images found in {data_dir / ('train' if not train else 'val')}; "
            f"expected {_EXPECTED}"
        )
    return DataBundle(name="imagefolder", train=ImageFiles(train, image_size=image_size),
                      test=ImageFiles(test, image_size=image_size), task="classification",
                      input_shape=(3, image_size, image_size), num_classes=len(classes),
                      train_transform=Flip(), classes=list(classes))

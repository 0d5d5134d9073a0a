"""Stereo-matching data: a procedural generator with exact disparity and a Scene Flow loader.

Both datasets yield ``(x, y)``: ``x`` float32 ``(6, H, W)`` = left and right RGB images on the
channel axis, normalized with the ImageNet mean/std (what AANet and EASNet use on Scene Flow),
``y`` float32 ``(H, W)`` = the left view's disparity in pixels. Horizontal flips are not a valid
stereo augmentation (they swap which view is left), so neither bundle has a train_transform.

* ``stereo`` (embedded default): scenes from :mod:`.stereo_render`, rendered exactly in both
  views; every pixel has ground truth, occluded ones included (as in Scene Flow). Images are
  held as uint8 and normalized when read (4x less memory than float). The scenes depend on
  ``data_seed`` (fixed, default 0), never on the run's ``--seed``: like mnist1d, runs with
  different seeds train on the same data. Generated once and cached as .npz.
* ``sceneflow`` (``--data-dir``): the published Scene Flow layout, read lazily with Pillow.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.data.cache import cache_dir, load_or_create_npz
from lowcomm.data.pfm import read_pfm, write_pfm
from lowcomm.data.stereo_render import KINDS, generate
from lowcomm.errors import UsageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: bump when the generator's output for the same arguments changes (old caches are then unused)
STEREO_CACHE_VERSION = 1

_SCENEFLOW_LAYOUT = (
    "<dir>/frames_cleanpass|frames_finalpass/[TRAIN|TEST/]<...>/left|right/NNNN.png and "
    "<dir>/disparity/[TRAIN|TEST/]<...>/left/NNNN.pfm (or several such roots in sub-folders, "
    "e.g. FlyingThings3D/, Driving/, Monkaa/)"
)


class _Normalize:
    """uint8 ``(..., 6, H, W)`` -> ImageNet-normalized float32, both views alike."""

    def __init__(self) -> None:
        mean = torch.tensor(IMAGENET_MEAN * 2, dtype=torch.float32).view(6, 1, 1)
        std = torch.tensor(IMAGENET_STD * 2, dtype=torch.float32).view(6, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.shift = mean / std

    def __call__(self, pixels: Tensor) -> Tensor:
        return pixels.float() * self.scale - self.shift


class StereoPairs(Dataset):
    """In-memory pairs: ``images`` uint8 ``(N, 6, H, W)``, ``disparity`` float32 ``(N, H, W)``."""

    #: nothing to decode: the sample cache (``--data-cache``) leaves it alone
    held_in_memory = True

    def __init__(self, images: Tensor, disparity: Tensor, *, max_disp: float) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 6:
            raise TypeError("images must be uint8 (N, 6, H, W)")
        self.images = images
        self.disparity = disparity
        self.max_disp = max_disp
        self._normalize = _Normalize()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self._normalize(self.images[i]), self.disparity[i]

    def __getitems__(self, indices: list[int]) -> list[tuple[Tensor, Tensor]]:
        # DataLoader fast path: normalize the whole batch in one op.
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self._normalize(self.images[idx])
        return list(zip(x.unbind(0), self.disparity[idx].unbind(0)))


def _generated(data_dir: Path | None, *, height: int, width: int, max_disp: float,
               min_disp: float, train_size: int, test_size: int, kind: str,
               data_seed: int) -> dict[str, np.ndarray]:
    """Train/test arrays for these arguments, from the cache or generated (keyed by all of them)."""
    key = {"height": height, "width": width, "max_disp": max_disp, "min_disp": min_disp,
           "train_size": train_size, "test_size": test_size, "kind": kind, "data_seed": data_seed}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir(data_dir) / f"stereo-v{STEREO_CACHE_VERSION}-{digest}.npz"

    def make() -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for split, n, stream in (("train", train_size, 0), ("test", test_size, 1)):
            # train and test come from different streams: no test scene is a training scene
            arrays = generate(n, height=height, width=width, max_disp=max_disp, min_disp=min_disp,
                              kind=kind, seed=data_seed * 2 + stream)
            out[f"{split}_images"] = np.concatenate([arrays["left"], arrays["right"]], axis=1)
            out[f"{split}_disparity"] = arrays["disparity"]
        return out

    return load_or_create_npz(path, make)


@register_dataset("stereo")
def stereo(*, data_dir: Path | None, seed: int, height: int = 64, width: int = 128,
           max_disp: float = 32, min_disp: float = 1.0, train_size: int = 2000,
           test_size: int = 200, kind: str = "mixed", data_seed: int = 0) -> DataBundle:
    """Procedural stereo pairs with exact disparity in ``[min_disp, max_disp)``; ``kind`` is
    ``mixed`` (default), ``dots`` (random-dot stereograms), ``planes`` or ``shapes``.
    ``data_dir`` is only where the generated arrays are cached."""
    if kind not in KINDS:
        raise UsageError(f"stereo: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    for name, value in (("height", height), ("width", width), ("train_size", train_size),
                        ("test_size", test_size)):
        if int(value) != value or value < (1 if name in ("height", "width") else 0):
            raise UsageError(f"stereo: {name} must be a {'positive' if name in ('height', 'width') else 'non-negative'} "
                             f"integer, got {value!r}")
    if int(data_seed) != data_seed or data_seed < 0:
        raise UsageError(f"stereo: data_seed must be a non-negative integer, got {data_seed!r}")
    if not 0 <= min_disp < max_disp:
        raise UsageError(f"stereo: need 0 <= min_disp < max_disp, got min_disp={min_disp}, max_disp={max_disp}")
    arrays = _generated(data_dir, height=int(height), width=int(width), max_disp=float(max_disp),
                        min_disp=float(min_disp), train_size=int(train_size),
                        test_size=int(test_size), kind=kind, data_seed=int(data_seed))

    def ds(split: str) -> StereoPairs:
        return StereoPairs(torch.from_numpy(arrays[f"{split}_images"]),
                           torch.from_numpy(arrays[f"{split}_disparity"]), max_disp=float(max_disp))

    return DataBundle(name="stereo", train=ds("train"), test=ds("test"), task="stereo",
                      input_shape=(6, int(height), int(width)))


# ---------------------------------------------------------------------------------------
# Scene Flow


def _stable_fraction(text: str) -> float:
    """A fixed number in [0, 1) per string (same on every machine, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") / 2.0 ** 64


def _frame_key(left_png: Path) -> str:
    """The frame's path below its ``frames_*pass`` folder (``TRAIN/A/0000/left/0006.png``):
    the same wherever the data lives and for both passes, so crops are too."""
    parts = left_png.parts
    for j in range(len(parts) - 1, -1, -1):
        if parts[j].startswith("frames_") and parts[j].endswith("pass"):
            return "/".join(parts[j + 1:])
    return "/".join(parts[-3:])


def _roots(data_dir: Path, frames: str) -> list[Path]:
    """Dataset roots under ``data_dir``: itself if it holds ``frames``, else its sub-folders that do."""
    if (data_dir / frames).is_dir():
        return [data_dir]
    return sorted(p for p in data_dir.iterdir() if p.is_dir() and (p / frames).is_dir())


def _has_splits(root: Path, frames: str) -> bool:
    return (root / frames / "TRAIN").is_dir() or (root / frames / "TEST").is_dir()


def _scan_root(root: Path, frames: str, unsplit: str) -> dict[str, list[tuple[Path, Path, Path]]]:
    """(left png, right png, left pfm) triples of one root, by split. A root without
    ``TRAIN``/``TEST`` folders goes to ``unsplit`` ("train", or "hash": a fixed 90/10 split
    by a stable hash of each frame's path)."""
    splits: dict[str, list[tuple[Path, Path, Path]]] = {"train": [], "test": []}
    top = root / frames
    has_splits = _has_splits(root, frames)
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        here = Path(folder)
        if here.name != "left":
            continue
        for name in sorted(files):
            if not name.lower().endswith(".png"):
                continue
            left = here / name
            right = here.parent / "right" / name
            rel = left.relative_to(top)
            pfm = (root / "disparity" / rel).with_suffix(".pfm")
            if not (right.is_file() and pfm.is_file()):
                continue
            if has_splits:
                split = {"TRAIN": "train", "TEST": "test"}.get(rel.parts[0])
                if split is None:
                    continue
            elif unsplit == "train":
                split = "train"
            else:
                split = "test" if _stable_fraction(str(rel)) < 0.1 else "train"
            splits[split].append((left, right, pfm))
    return splits


class SceneFlowPairs(Dataset):
    """Scene Flow pairs read lazily, cropped to ``height x width``.

    ``__getitem__`` is ``assemble(*decode(i))``: ``decode`` reads the PNGs and the PFM and
    crops (uint8 ``(6, h, w)`` and float32 ``(h, w)``, what a sample cache keeps), ``assemble``
    normalizes. Crops are deterministic so that a cached sample equals a decoded one:
    ``center`` for evaluation, ``fixed`` for training = a crop position derived from a stable
    hash of the frame's path (different per frame, the same every epoch; a per-epoch random
    crop would need the trainer to pass the epoch in). Non-finite or negative disparities
    become 0, which the stereo loss and metrics treat as "no ground truth".
    """

    def __init__(self, samples: list[tuple[Path, Path, Path]], *, height: int | None,
                 width: int | None, crop: str, max_disp: float) -> None:
        self.samples = samples
        self.height, self.width = height, width
        self.crop = crop
        self.max_disp = max_disp
        self._normalize = _Normalize()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.assemble(*self.decode(i))

    def _window(self, i: int, h: int, w: int) -> tuple[int, int, int, int]:
        ch, cw = self.height or h, self.width or w
        if ch > h or cw > w:
            raise UsageError(f"sceneflow: {self.samples[i][0]} is {h}x{w}, smaller than the crop {ch}x{cw}")
        if self.crop == "center":
            top, left = (h - ch) // 2, (w - cw) // 2
        else:
            key = _frame_key(self.samples[i][0])
            top = int(_stable_fraction(f"top:{key}") * (h - ch + 1))
            left = int(_stable_fraction(f"left:{key}") * (w - cw + 1))
        return top, left, ch, cw

    def decode(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``i`` as uint8 ``(6, h, w)`` (left, right) and float32 disparity ``(h, w)``, cropped."""
        from PIL import Image

        left_path, right_path, pfm_path = self.samples[i]
        views = []
        for path in (left_path, right_path):
            with Image.open(path) as img:
                views.append(np.asarray(img.convert("RGB"), dtype=np.uint8))
        disparity = read_pfm(pfm_path)
        if disparity.ndim == 3:     # a 3-channel PF: disparity is the first channel
            disparity = disparity[..., 0]
        h, w = views[0].shape[:2]
        if views[1].shape[:2] != (h, w) or disparity.shape != (h, w):
            raise UsageError(f"sceneflow: sizes differ: {left_path} {views[0].shape[:2]}, "
                             f"{right_path} {views[1].shape[:2]}, {pfm_path} {disparity.shape}")
        top, left, ch, cw = self._window(i, h, w)
        pixels = np.concatenate(views, axis=2)[top:top + ch, left:left + cw].transpose(2, 0, 1)
        d = disparity[top:top + ch, left:left + cw].astype(np.float32)
        d = np.where(np.isfinite(d) & (d > 0), d, np.float32(0))
        return np.ascontiguousarray(pixels), np.ascontiguousarray(d)

    def assemble(self, pixels: np.ndarray, disparity: np.ndarray) -> tuple[Tensor, Tensor]:
        """The normalized ``(6, h, w)`` float32 input and the disparity tensor."""
        return self._normalize(torch.from_numpy(np.ascontiguousarray(pixels))), torch.from_numpy(
            np.ascontiguousarray(disparity, dtype=np.float32))

    def cache_fingerprint(self) -> list[object]:
        """What a disk cache entry depends on: crop and every file's path, size and mtime."""
        out: list[object] = [self.height, self.width, self.crop]
        for triple in self.samples:
            for path in triple:
                st = path.stat()
                out.append((str(path.absolute()), st.st_size, st.st_mtime_ns))
        return out


@register_dataset("sceneflow")
def sceneflow(*, data_dir: Path | None, seed: int, pass_: str = "clean", height: int | None = 256,
              width: int | None = 512, max_disp: float = 192) -> DataBundle:
    """Scene Flow (FlyingThings3D / Driving / Monkaa) from ``data_dir``: ``pass_`` picks
    ``frames_cleanpass`` or ``frames_finalpass``; ``height``/``width`` the crop (None: whole
    frames); ``max_disp`` (AANet's 192) is exposed as ``dataset.max_disp`` for the loss:
    larger disparities stay in the data and the loss skips them. ``data_dir`` is one root
    (holding ``frames_*pass/`` and ``disparity/``) or a folder of roots; with FlyingThings3D's
    TRAIN/TEST present, roots without them (Driving, Monkaa) are training data, as in PSMNet
    and AANet; without it they are split 90/10 by a stable hash of each frame's path."""
    if pass_ not in ("clean", "final"):
        raise UsageError(f"sceneflow: pass_ must be 'clean' or 'final', got {pass_!r}")
    for name, value in (("height", height), ("width", width)):
        if value is not None and (int(value) != value or value < 1):
            raise UsageError(f"sceneflow: {name} must be a positive integer or None, got {value!r}")
    if max_disp <= 0:
        raise UsageError(f"sceneflow: max_disp must be > 0, got {max_disp}")
    frames = f"frames_{pass_}pass"
    if data_dir is None or not data_dir.is_dir():
        where = "--data-dir (none given)" if data_dir is None else f"{data_dir} (not a folder)"
        raise UsageError(f"sceneflow: expected {_SCENEFLOW_LAYOUT} under {where}; see docs/data.md")
    roots = _roots(data_dir, frames)
    if not roots:
        raise UsageError(f"sceneflow: no {frames} folder in {data_dir}; expected {_SCENEFLOW_LAYOUT}")
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise UsageError("sceneflow needs Pillow (pip install 'lowcomm[elastic]')") from None
    train: list[tuple[Path, Path, Path]] = []
    test: list[tuple[Path, Path, Path]] = []
    # the published protocol (PSMNet, AANet): FlyingThings3D TEST is the test set, Driving and
    # Monkaa (no TRAIN/TEST folders) are training data; alone they are split 90/10 by hash
    unsplit = "train" if any(_has_splits(r, frames) for r in roots) else "hash"
    for root in roots:
        found = _scan_root(root, frames, unsplit)
        train += found["train"]
        test += found["test"]
    if not train or not test:
        raise UsageError(
            f"sceneflow: found {len(train)} training and {len(test)} test pairs with right image and "
            f"disparity in {data_dir} ({frames}); need both; expected {_SCENEFLOW_LAYOUT}")
    h = int(height) if height is not None else None
    w = int(width) if width is not None else None
    if h is None or w is None:   # whole frames: the shape is the first frame's
        from PIL import Image

        with Image.open(train[0][0]) as img:
            fw, fh = img.size
        h, w = h or fh, w or fw
    return DataBundle(
        name="sceneflow",
        train=SceneFlowPairs(train, height=h, width=w, crop="fixed", max_disp=float(max_disp)),
        test=SceneFlowPairs(test, height=h, width=w, crop="center", max_disp=float(max_disp)),
        task="stereo", input_shape=(6, h, w))


__all__ = ["SceneFlowPairs", "StereoPairs", "read_pfm", "sceneflow", "stereo", "write_pfm"]

"""Decoded-sample cache: the first epoch decodes and fills, later epochs read (``--data-cache``).

A dataset that decodes per sample (ImageFolder: PNG/JPEG through Pillow) pays the decode every
epoch. :class:`CachedDataset` puts a store in front of it. What is stored is the output of the
dataset's *decode stage*: a dataset may split ``__getitem__`` into ``decode(i) -> (array,
label)`` (the costly, deterministic part, e.g. uint8 pixels after resize and crop) and
``assemble(array, label) -> (x, y)`` (cheap: to float, normalize), so the cache holds the
compact form (uint8 images: 4x less than float) and returns bit-identical samples. Datasets
without the split are cached as their ``__getitem__`` output. Random augmentation is never
cached: it is the bundle's batch-level ``train_transform``, applied after the cache, on the
training device.

Two stores, and how each is really read in epoch 2 with DataLoader worker processes
(workers are separate processes, so a plain dict filled in a worker dies with it or stays
invisible to the other workers):

* :class:`MemoryStore` (``memory``): one slot per sample in **shared-memory tensors**
  allocated in the rank's process before its workers start. Workers write decoded samples
  into the shared slots and set the slot's flag last; whichever worker gets the sample in
  epoch 2 sees it. Per rank (each rank holds the samples it was given): with W ranks the
  distributed sampler deals every epoch anew, so a rank's epoch-2 hit rate starts near 1/W
  and grows each epoch; use a disk store (``disk:/dev/shm/...`` for RAM) to share across the
  ranks of a node. Needs ``len(dataset) x sample bytes`` of RAM per rank.
* :class:`DiskStore` (``disk[:DIR]``): one file per sample under ``DIR/<key>/``,
  shared by every rank and worker on the machine (epoch 1 of all local ranks together fills
  it). Each file is written under a temporary name in its folder and renamed into place
  (``os.replace``), so a reader never sees a partial file; a file that cannot be read is a
  miss and is written again. The key hashes the dataset's identity (name, split, folder,
  options, and for ImageFolder every file's path, size and mtime), so changed data never
  reads an old entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lowcomm.errors import UsageError

#: bump when the stored form of any dataset changes (old entries are then never read)
FORMAT_VERSION = 1
#: first bytes of every disk entry (and its format version)
MAGIC = b"LCS1"
#: samples per sub-folder of a disk store (keeps folders listable at ImageNet scale)
FILES_PER_FOLDER = 1000

Sample = tuple[np.ndarray, np.ndarray]


class SampleStore(Protocol):
    """Where decoded samples are kept: ``get`` returns None on a miss."""

    def get(self, i: int) -> Sample | None:
        """The stored sample ``i``, or None."""

    def put(self, i: int, x: np.ndarray, y: np.ndarray) -> None:
        """Keep sample ``i`` (best effort: a store may decline, the sample is then decoded again)."""


def decode(dataset: Dataset[Any], i: int) -> Sample:
    """Sample ``i`` in the form the cache keeps (the dataset's decode stage if it has one)."""
    stage = getattr(dataset, "decode", None)
    if stage is not None:
        x, y = stage(i)
        return np.asarray(x), np.asarray(y)
    x, y = dataset[i]
    return _to_numpy(x), _to_numpy(y)


def assemble(dataset: Dataset[Any], x: np.ndarray, y: np.ndarray) -> tuple[Tensor, Tensor]:
    """The sample ``dataset[i]`` would return, from its decoded form."""
    stage = getattr(dataset, "assemble", None)
    if stage is not None:
        out: tuple[Tensor, Tensor] = stage(x, y)
        return out
    return torch.from_numpy(x), torch.from_numpy(y)


def _to_numpy(v: Any) -> np.ndarray:
    return v.detach().cpu().numpy().copy() if isinstance(v, Tensor) else np.array(v)


def _shared_zeros(shape: tuple[int, ...], dtype: np.dtype[Any]) -> Tensor:
    torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return torch.zeros(shape, dtype=torch_dtype).share_memory_()


class MemoryStore:
    """One slot per sample in shared-memory tensors, shared with the DataLoader workers.

    Allocated from a probe sample (shape and dtype of every slot); a sample of another shape
    or dtype is not stored (decoded each time). The flag of a slot is written after its data,
    so a reader that sees the flag sees the whole sample.
    """

    def __init__(self, size: int, probe: Sample) -> None:
        x, y = probe
        self.x = _shared_zeros((size, *x.shape), x.dtype)
        self.y = _shared_zeros((size, *y.shape), y.dtype)
        self.filled = torch.zeros(size, dtype=torch.uint8).share_memory_()
        self._views: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _np(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # numpy views of the shared tensors, made in the process that uses them: under the
        # spawn start method the tensors travel as shared memory, numpy arrays would be copied
        if self._views is None or self._views[0] != os.getpid():
            self._views = (os.getpid(), self.x.numpy(), self.y.numpy(), self.filled.numpy())
        return self._views[1], self._views[2], self._views[3]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_views"] = None
        return state

    def get(self, i: int) -> Sample | None:
        """A copy of slot ``i`` if filled."""
        x, y, filled = self._np()
        if not filled[i]:
            return None
        return x[i].copy(), y[i].copy()

    def put(self, i: int, x: np.ndarray, y: np.ndarray) -> None:
        """Fill slot ``i`` (data first, flag last); a sample that does not fit is skipped."""
        xs, ys, filled = self._np()
        if x.shape != xs.shape[1:] or x.dtype != xs.dtype or y.shape != ys.shape[1:] or y.dtype != ys.dtype:
            return
        xs[i] = x
        ys[i] = y
        filled[i] = 1


def _pack(x: np.ndarray, y: np.ndarray) -> bytes:
    """One sample as bytes: magic, header length, a JSON header (dtype and shape of each
    array), then the raw arrays. Why not ``np.save``: reading its header (a Python literal)
    costs as much as a small image's pixels; this one is parsed with ``json``."""
    header = json.dumps([[x.dtype.str, list(x.shape)], [y.dtype.str, list(y.shape)]]).encode()
    return b"".join([MAGIC, len(header).to_bytes(4, "little"), header, x.tobytes(), y.tobytes()])


def _unpack(buf: bytearray) -> Sample | None:
    """The arrays of :func:`_pack`'s bytes (views of ``buf``), or None if they are not whole."""
    try:
        if buf[:4] != MAGIC:
            return None
        n = int.from_bytes(buf[4:8], "little")
        (xd, xs), (yd, ys) = json.loads(bytes(buf[8 : 8 + n]))
        xdt, ydt = np.dtype(xd), np.dtype(yd)
        start = 8 + n
        xn, yn = xdt.itemsize * math.prod(xs), ydt.itemsize * math.prod(ys)
        if len(buf) != start + xn + yn:
            return None
        x = np.frombuffer(buf, dtype=xdt, count=math.prod(xs), offset=start).reshape(tuple(xs))
        y = np.frombuffer(buf, dtype=ydt, count=math.prod(ys), offset=start + xn).reshape(tuple(ys))
    except (ValueError, TypeError):
        return None
    return x, y


class DiskStore:
    """One file per sample (``x`` then ``y``, :func:`_pack`), written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._warned = False

    def path(self, i: int) -> Path:
        """Where sample ``i`` lives."""
        return self.directory / f"{i // FILES_PER_FOLDER:05d}" / f"{i}.sample"

    def get(self, i: int) -> Sample | None:
        """The stored sample, or None if absent or unreadable (then it is decoded and rewritten)."""
        try:
            with open(self.path(i), "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)  # writable: torch.from_numpy wants that
                f.readinto(buf)
        except FileNotFoundError:
            return None
        except OSError:
            return None
        return _unpack(buf)

    def put(self, i: int, x: np.ndarray, y: np.ndarray) -> None:
        """Write to a temporary name in the sample's folder, then rename into place."""
        final = self.path(i)
        tmp = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{i}.", suffix=".tmp", dir=final.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(_pack(x, y))
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; other users' ranks may share the cache
            os.replace(tmp, final)
            tmp = None
        except OSError as e:  # disk full, read-only: train on, decoding what is not stored
            if not self._warned:
                self._warned = True
                warnings.warn(f"--data-cache: cannot write {final} ({e}); such samples are decoded each epoch",
                              RuntimeWarning, stacklevel=2)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


class CachedDataset(Dataset):
    """``dataset`` behind a :class:`SampleStore`: the same samples, decoded once.

    ``decodes`` counts the decodes done in *this* process (tests and benchmarks read it with
    0 workers; workers count their own).
    """

    def __init__(self, dataset: Dataset[Any], store: SampleStore) -> None:
        self.dataset = dataset
        self.store = store
        self.decodes = 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        i = int(i)
        hit = self.store.get(i)
        if hit is None:
            hit = decode(self.dataset, i)
            self.decodes += 1
            self.store.put(i, *hit)
        return assemble(self.dataset, *hit)


def check_room(size: int, probe: Sample) -> None:
    """Refuse a memory cache larger than the machine's RAM or free shared memory (``/dev/shm``,
    64 MiB in a default Docker container), in one line instead of a failed allocation."""
    need = size * (probe[0].nbytes + probe[1].nbytes + 1)
    room = {"RAM": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        room["free shared memory (/dev/shm)"] = st.f_bavail * st.f_frsize
    for what, have in room.items():
        if need > have:
            raise UsageError(f"--data-cache memory needs {need / 2**30:.2f} GiB per rank for {size} samples, "
                             f"more than the {what} of {have / 2**30:.2f} GiB; use --data-cache disk[:DIR]")


def cache_key(identity: dict[str, Any], dataset: Dataset[Any]) -> str:
    """A short hash naming a dataset's disk entries: ``identity`` (name, split, folder,
    options) plus the dataset's own ``cache_fingerprint()`` if it has one."""
    fingerprint = getattr(dataset, "cache_fingerprint", None)
    payload = {"version": FORMAT_VERSION, "len": len(dataset), **identity,  # type: ignore[arg-type]
               "fingerprint": fingerprint() if fingerprint is not None else None}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cacheable(dataset: Dataset[Any]) -> bool:
    """Whether caching can help: not for datasets held as tensors (indexed in bulk already) or
    marked ``held_in_memory`` (decoded already, e.g. CIFAR's uint8 arrays)."""
    if getattr(dataset, "tensors", None) is not None or getattr(dataset, "held_in_memory", False):
        return False
    return not isinstance(dataset, CachedDataset)


def with_cache(dataset: Dataset[Any], kind: str, *, directory: Path | None = None,
               identity: dict[str, Any] | None = None) -> Dataset[Any]:
    """``dataset`` behind a ``kind`` cache (``none``, ``memory``, ``disk``); unchanged for
    ``none``, for an empty dataset, and for datasets held as tensors.

    ``directory`` is the disk store's root (entries go to ``directory/<key>``); ``identity``
    names the data for the key. A memory store decodes sample 0 here (its slot shape) and
    keeps it.
    """
    if kind == "none" or not cacheable(dataset) or len(dataset) == 0:  # type: ignore[arg-type]
        return dataset
    if kind == "memory":
        probe = decode(dataset, 0)
        check_room(len(dataset), probe)  # type: ignore[arg-type]
        mem = MemoryStore(len(dataset), probe)  # type: ignore[arg-type]
        mem.put(0, *probe)
        cached = CachedDataset(dataset, mem)
        cached.decodes = 1
        return cached
    if kind == "disk":
        if directory is None:
            raise ValueError("a disk cache needs a directory")
        return CachedDataset(dataset, DiskStore(Path(directory) / cache_key(identity or {}, dataset)))
    raise ValueError(f"unknown cache kind {kind!r}")

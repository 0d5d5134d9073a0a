"""``stdlib``: a byte-level language-model corpus that is on every machine with Python: the
standard library's own ``.py`` source files.

Why: an LM workload (``transformer_lm``, ``lstm_lm``) that needs no download and no
``--data-dir``. The files are found under ``sysconfig.get_paths()["stdlib"]`` (third-party
``site-packages``/``dist-packages`` below it are left out), in sorted order of their path
relative to that directory. Each file goes whole to one split, chosen by a hash of that
relative path (SHA-1; 90 % train, 5 % valid, 5 % test), so the split is fixed and does not
depend on the seed, the order of reading, or ``max_bytes``; the text itself is the one of the
running Python's version (the label records it). Tokens are bytes (vocabulary 256); each
split's byte stream (files concatenated in order) is cut into non-overlapping windows of
``bptt`` bytes, sample ``i`` = ``(b[i*bptt:(i+1)*bptt], b[i*bptt+1:(i+1)*bptt+1])``, as
:mod:`lowcomm.data.wikitext` does for words.

Size: ``max_bytes`` caps the training stream (default 2 MB), ``eval_bytes`` each of valid and
test (default ``max_bytes // 10``): files are read in order until a split is full (the last
one truncated), so a small slice loads in milliseconds. Nothing is cached on disk.
``eval_split=valid`` makes the trainer's evaluation (which reads the bundle's ``test``) use
the validation split instead (model selection and benchmarks; ``test`` stays untouched).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.errors import UsageError

#: per-mille thresholds of the path hash: [0, 900) train, [900, 950) valid, [950, 1000) test
SPLITS = (("train", 900), ("valid", 950), ("test", 1000))
_SKIP = ("site-packages", "dist-packages")


def stdlib_root() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside third-party package directories, sorted by
    relative path (POSIX form, so the order is the same on every OS)."""
    files: list[Path] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP and d != "__pycache__"]  # pruned, not walked
        files.extend(Path(folder) / n for n in names if n.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(relative: str) -> str:
    """The split a file belongs to, from the SHA-1 of its relative path."""
    bucket = int(hashlib.sha1(relative.encode("utf-8")).hexdigest()[:8], 16) % 1000
    return next(name for name, limit in SPLITS if bucket < limit)


def read_splits(root: Path, caps: dict[str, int]) -> dict[str, bytes]:
    """Each split's byte stream, files in order, up to ``caps[split]`` bytes."""
    parts: dict[str, list[bytes]] = {name: [] for name, _ in SPLITS}
    sizes = dict.fromkeys(parts, 0)
    for path in source_files(root):
        split = split_of(path.relative_to(root).as_posix())
        room = caps[split] - sizes[split]
        if room <= 0:
            if all(sizes[s] >= caps[s] for s in sizes):
                break
            continue
        try:
            data = path.read_bytes()[:room]
        except OSError:  # an unreadable file is skipped (the same on every run of this machine)
            continue
        parts[split].append(data)
        sizes[split] += len(data)
    return {name: b"".join(chunks) for name, chunks in parts.items()}


def byte_windows(stream: bytes, bptt: int, split: str) -> TensorDataset:
    """Non-overlapping ``(input, target)`` windows of ``bptt`` bytes (target = next byte)."""
    n = (len(stream) - 1) // bptt
    if n < 1:
        raise UsageError(
            f"stdlib: the {split} split has {len(stream)} bytes, fewer than bptt+1={bptt + 1}; "
            "raise max_bytes/eval_bytes or lower bptt"
        )
    ids = torch.frombuffer(bytearray(stream[: n * bptt + 1]), dtype=torch.uint8).to(torch.int64)
    return TensorDataset(
        ids[: n * bptt].view(n, bptt).clone(), ids[1 : n * bptt + 1].view(n, bptt).clone()
    )


@register_dataset("stdlib")
def stdlib_corpus(
    *,
    data_dir: Path | None,
    seed: int,
    bptt: int = 128,
    max_bytes: int = 2_000_000,
    eval_bytes: int | None = None,
    eval_split: str = "test",
) -> DataBundle:
    """Byte-level LM data from the Python standard library's sources (see module docstring);
    ``data_dir`` and ``seed`` are not used (the corpus is local and the split fixed)."""
    for key, value in (("bptt", bptt), ("max_bytes", max_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"stdlib: {key} must be an integer >= 1, got {value!r}")
    if eval_bytes is None:
        eval_bytes = max(max_bytes // 10, bptt + 1)
    if isinstance(eval_bytes, bool) or not isinstance(eval_bytes, int) or eval_bytes < 1:
        raise UsageError(f"stdlib: eval_bytes must be an integer >= 1, got {eval_bytes!r}")
    if eval_split not in ("test", "valid"):
        raise UsageError(f"stdlib: eval_split must be test or valid, got {eval_split!r}")
    root = stdlib_root()
    if not root.is_dir():
        raise UsageError(f"stdlib: the standard library directory {root} does not exist")
    streams = read_splits(root, {"train": max_bytes, "valid": eval_bytes, "test": eval_bytes})
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return DataBundle(
        name=f"stdlib (Python {version} sources, bytes)",
        train=byte_windows(streams["train"], bptt, "train"),
        test=byte_windows(streams[eval_split], bptt, eval_split),
        valid=byte_windows(streams["valid"], bptt, "valid"),
        task="language_model",
        input_shape=(bptt,),
        vocab_size=256,
    )

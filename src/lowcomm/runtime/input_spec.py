"""The input-pipeline settings (``--data-workers``, ``--prefetch``, ``--data-cache``), checked.

Why a module of its own, torch-free: the configuration is validated in the launching process
before any worker starts, and that path must not import torch (usage errors stay instant).
The pipeline itself lives in :mod:`lowcomm.data.pipeline` and :mod:`lowcomm.data.sample_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowcomm.errors import UsageError, check_count

CACHE_KINDS = ("none", "memory", "disk")
#: DataLoader worker processes per rank; each is a full Python process, more is a typo
MAX_DATA_WORKERS = 64
#: batches each worker may have prepared ahead (DataLoader's prefetch_factor)
MAX_PREFETCH = 1024

_CACHE_FORMS = "none, memory, disk or disk:DIR"


@dataclass(frozen=True)
class CacheSpec:
    """A parsed ``--data-cache``: ``kind`` is none/memory/disk; ``directory`` is the folder
    given with ``disk:DIR`` (None: the default cache folder, resolved by the trainer)."""

    kind: str
    directory: str | None = None


def parse_data_cache(text: str) -> CacheSpec:
    """``none`` | ``memory`` | ``disk`` | ``disk:DIR``; anything else is a :class:`UsageError`."""
    value = str(text).strip()
    kind, sep, rest = value.partition(":")
    kind = kind.lower()
    if kind not in CACHE_KINDS:
        raise UsageError(f"--data-cache {text!r}: expected {_CACHE_FORMS}")
    if sep and kind != "disk":
        raise UsageError(f"--data-cache {text!r}: only disk takes a folder; expected {_CACHE_FORMS}")
    if sep and not rest.strip():
        raise UsageError(f"--data-cache {text!r}: disk: needs a folder after the colon; expected {_CACHE_FORMS}")
    return CacheSpec(kind, rest.strip() if sep else None)


def check_input_options(workers: int, prefetch: int | None, cache: str) -> CacheSpec:
    """Refuse bad pipeline settings in one line; returns the parsed cache spec."""
    check_count("--data-workers", workers, minimum=0, maximum=MAX_DATA_WORKERS)
    if prefetch is not None:
        check_count("--prefetch", prefetch, maximum=MAX_PREFETCH)
        if workers == 0:
            raise UsageError("--prefetch needs --data-workers >= 1 (the worker processes prefetch; "
                             "with 0 workers batches are read in the training process)")
    spec = parse_data_cache(cache)
    if spec.directory is not None:
        from lowcomm.runtime.config import check_writable

        check_writable("--data-cache disk:", spec.directory, is_dir=True)
    return spec

"""A small on-disk cache for generated arrays, safe when several ranks race to fill it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np


def cache_dir(data_dir: Path | None) -> Path:
    """``data_dir`` if given, else ``$LOWCOMM_CACHE_DIR``, else ``~/.cache/lowcomm``."""
    if data_dir is not None:
        return data_dir
    env = os.environ.get("LOWCOMM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lowcomm"


def load_or_create_npz(path: Path, make: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Load ``path``; if absent or unreadable, build the arrays and write them atomically.

    The file is written to a temporary name in the same folder and moved into place with
    ``os.replace``, so a reader never sees a half-written file; ranks that generate at the
    same time produce identical bytes (generation is deterministic), so the last rename wins
    harmlessly.
    """
    if path.exists():
        try:
            with np.load(path) as f:
                return {k: f[k] for k in f.files}
        except (OSError, ValueError, EOFError):
            pass  # corrupt (e.g. from an older, non-atomic writer): regenerate
    arrays = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a shared cache should be readable
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return arrays

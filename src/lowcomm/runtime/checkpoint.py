"""Atomic, per-rank checkpoints that resume exactly and load with ``weights_only=True``.

Layout in the checkpoint directory::

    ckpt-00000120-rank0.pt   model (rank 0 only), optimizer, scheduler, RNG, method state
    ckpt-00000120-rank1.pt   optimizer, RNG and method state of rank 1 (error-feedback
                             memory and optimizer shards differ per rank)
    latest.json              {"step": 120, "world_size": 2, ...} written last

Every file is written to a temporary name, fsynced and renamed, and ``latest.json`` is only
replaced after all ranks have finished theirs (a barrier), so a crash at any point leaves
the previous complete checkpoint in place. Older step files are then removed.

What a kill (SIGKILL, OOM, power loss) at any moment can leave behind, and why none of it is
ever loaded:

* a truncated ``.tmp-*`` file: never read (only final names are), removed by the next commit;
* complete rank files of a step whose ``latest.json`` was not written yet: ignored, since
  :func:`latest` names the step to load, and replaced or removed later;
* ``latest.json`` itself is replaced atomically: the old or the new one, never half of one.

The folder is fsynced after each rename so that, after a power loss, a manifest on disk never
points at rank files whose rename was not yet durable.
"""

from __future__ import annotations

import glob
import json
import os
import random
import tempfile
from typing import Any

import numpy as np
import torch

from lowcomm.errors import UsageError

MANIFEST = "latest.json"
TMP_PREFIX = ".tmp-"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``directory`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write_bytes(path: str, write: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temp file in the same directory, fsync, then rename."""
    _atomic_write_bytes(path, lambda f: torch.save(obj, f))


def atomic_write_json(obj: Any, path: str) -> None:
    """Write ``obj`` as JSON to ``path`` atomically: a reader never sees half a summary."""
    _atomic_write_bytes(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


def rng_state() -> dict[str, Any]:
    """All RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": _python_state_to_list(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _python_state_to_list(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [int(version), torch.tensor(internal, dtype=torch.int64), gauss]


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`: a resumed run draws the same random numbers (dropout,
    augmentation, sampling) as the uninterrupted one."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_path(directory: str, step: int, rank: int) -> str:
    """The file of ``rank``'s state at ``step`` (one file per rank: no gather at save)."""
    return os.path.join(directory, f"ckpt-{step:08d}-rank{rank}.pt")


def save_rank(directory: str, step: int, rank: int, payload: dict[str, Any]) -> None:
    """Save ``rank``'s state at ``step`` atomically (committed later by :func:`commit`)."""
    atomic_save(payload, rank_path(directory, step, rank))


def commit(directory: str, step: int, meta: dict[str, Any]) -> None:
    """Point ``latest.json`` at ``step`` (call after every rank saved), drop older files.

    Also removes temporary files that writers killed mid-write left behind: commit runs
    between two barriers, when no rank is writing, so every ``.tmp-*`` file is stale.
    """
    atomic_write_json({"step": step, **meta}, os.path.join(directory, MANIFEST))
    stale = glob.glob(os.path.join(directory, "ckpt-*-rank*.pt")) + glob.glob(os.path.join(directory, TMP_PREFIX + "*"))
    for path in stale:
        if not os.path.basename(path).startswith(f"ckpt-{step:08d}-"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def latest(directory: str) -> dict[str, Any] | None:
    """The manifest of the last *complete* checkpoint in ``directory``, or None if there is none.

    Rank files of later steps without a manifest (a run killed while checkpointing) are not
    looked at: the manifest alone says which step is whole.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int):
            raise ValueError("no integer 'step'")
    except (OSError, ValueError) as e:
        raise UsageError(f"checkpoint manifest {path} is unreadable ({e}); remove it to start over") from None
    return dict(manifest)


def load_rank(directory: str, step: int, rank: int) -> dict[str, Any]:
    """Load this rank's file with ``weights_only=True`` (no arbitrary code runs).

    A missing or damaged file (copied partially, edited by hand: the writer itself never
    leaves one under a final name) is one clear error naming the file, not a pickle traceback.
    """
    path = rank_path(directory, step, rank)
    if not os.path.exists(path):
        raise UsageError(f"checkpoint file {path} is missing: the checkpoint in {directory} is incomplete")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  any unreadable file: zip, pickle or tensor errors
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"checkpoint file {path} is damaged ({reason}); restore it or remove {directory}") from None
    return dict(state)

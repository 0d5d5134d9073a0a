"""Checkpoints of a federated run: the server's state after each complete round.

Why only rank 0 writes: everything a round leaves behind is the server's (global model,
server optimizer, scheduler observations, history) or the client store's, whose journals are
applied only after this file exists (:mod:`lowcomm.fl.store`). Client batch orders are
seeded by ``(seed, round, client)``, so no random-generator state needs saving. The file is
written atomically and ``latest.json`` names the last complete round, as for ``train``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowcomm.errors import UsageError
from lowcomm.fl.config import FLConfig
from lowcomm.runtime import checkpoint as ckpt

#: settings that must match for a resumed run to continue the same experiment
MUST_MATCH = ("clients", "per_round", "algorithm", "algorithm_modules", "model", "model_args", "data", "data_args",
              "samples_per_client", "partition", "local_epochs", "batch_size", "lr", "momentum",
              "weight_decay", "seed", "schedule", "warmup_rounds", "cross_silo")


def _identity(cfg: FLConfig) -> dict[str, Any]:
    values = dataclasses.asdict(cfg)
    return {k: values[k] for k in MUST_MATCH}


def save(directory: str, completed_rounds: int, state: dict[str, Any], *, config: FLConfig) -> None:
    """Save the server state after ``completed_rounds`` rounds and mark it complete."""
    ckpt.save_rank(directory, completed_rounds, 0, state)
    ckpt.commit(directory, completed_rounds, {"kind": "fl", "completed_rounds": completed_rounds,
                                              "config": _identity(config)})


def load(directory: str, *, config: FLConfig) -> tuple[int, dict[str, Any]] | None:
    """``(completed_rounds, state)`` of the last complete round, or None if there is none.

    A checkpoint of another experiment (other clients, algorithm, data ...) is refused with
    the first difference: continuing it would silently mix two runs.
    """
    manifest = ckpt.latest(directory)
    if manifest is None:
        return None
    if manifest.get("kind") != "fl":
        raise UsageError(f"{directory} holds a checkpoint of `lowcomm train`, not of `lowcomm fl`")
    saved = manifest.get("config", {})
    mine = _identity(config)
    for key in MUST_MATCH:
        if saved.get(key) != mine[key]:
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"--resume: the checkpoint in {directory} was made with {flag} "
                             f"{saved.get(key)!r}, this run has {mine[key]!r}; use the same settings or "
                             "another --checkpoint-dir")
    rounds = int(manifest["step"])
    return rounds, ckpt.load_rank(directory, rounds, 0)

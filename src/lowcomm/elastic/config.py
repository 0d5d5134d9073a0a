"""Settings of ``lowcomm elastic train``: a :class:`TrainConfig` plus the shrinking schedule.

Why a wrapper and not new TrainConfig fields: every phase of progressive shrinking is an
ordinary ``lowcomm train`` run (same method, optimizer, data, checkpoints), so the train
settings travel unchanged; only the phases, distillation and output are elastic's own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from lowcomm.errors import UsageError, check_count, check_positive
from lowcomm.runtime.config import TrainConfig


@dataclass
class ElasticConfig:
    """One ``lowcomm elastic train`` run, sent to every worker as JSON."""

    train: TrainConfig
    phases: list[dict[str, Any]] = field(default_factory=list)  # Phase.to_json() each
    distill: float = 0.0  # OFA's kd_ratio: weight of the loss against the full network (0: off)
    sandwich: bool = False  # also train each phase's smallest sub-network at every step (BigNAS)
    bn_batches: int = 10  # training batches for BN re-calibration before each evaluation
    out: str | None = None  # the trained supernet (or the from-scratch subnet) file
    init: str | None = None  # start from this supernet file's weights
    scratch: dict[str, list[int]] | None = None  # train this sub-network alone, from scratch

    def validate(self) -> None:
        """Refuse bad settings before any worker starts (one line each)."""
        check_count("--bn-batches", self.bn_batches, minimum=0)
        check_positive("--distill", self.distill, allow_zero=True)
        if self.scratch is not None and self.distill:
            raise UsageError("--distill needs the supernet's full network; --scratch trains a sub-network alone")
        if self.scratch is not None and self.sandwich:
            raise UsageError("--sandwich samples sub-networks of a supernet; --scratch trains one sub-network alone")
        if self.train.resume and not self.train.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir")

    def to_json(self) -> str:
        """The settings as one JSON string (how workers receive them)."""
        return json.dumps({**asdict(self), "train": self.train.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> ElasticConfig:
        """The inverse of :meth:`to_json`."""
        data = json.loads(text)
        data["train"] = TrainConfig(**data["train"])
        return cls(**data)

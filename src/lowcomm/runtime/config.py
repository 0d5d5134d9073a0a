"""Training configuration: one dataclass, validated before any process starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lowcomm.errors import UsageError, check_positive

SCHEDULES = ("constant", "step", "multistep", "cosine")
OPTIMIZERS = ("sgd", "adamw")


@dataclass
class TrainConfig:
    model: str = "cnn1d"
    data: str = "mnist1d"
    data_dir: str | None = None
    method: str = "ssgd"
    nproc: int = 1
    epochs: int = 1
    steps: int | None = None  # stop after this many optimizer steps in total
    warmup_steps: int | None = None  # steps excluded from timing medians
    batch_size: int = 64  # per worker
    eval_batch_size: int = 512
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    no_decay_norm_bias: bool = False
    schedule: str = "cosine"
    lr_warmup_epochs: float = 0.0
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])  # fractions of training
    gamma: float = 0.1
    step_size_epochs: int = 30
    clip_grad: float | None = None
    amp: bool = False
    seed: int = 0
    threads: int | None = None
    device: str = "auto"
    bucket_cap_mb: float = 25.0
    eval: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps
    resume: bool = False
    stop_after_steps: int | None = None  # leave cleanly (checkpointed) after N steps of this run
    json: str | None = None
    log: str | None = None  # JSONL per-step log (rank 0)
    tensorboard: str | None = None
    progress: bool = True
    model_args: dict[str, Any] = field(default_factory=dict)
    data_args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Refuse bad numbers and names before any worker starts."""
        check_positive("--nproc", self.nproc)
        check_positive("--epochs", self.epochs)
        check_positive("--batch-size", self.batch_size)
        check_positive("--lr", self.lr)
        if self.steps is not None:
            check_positive("--steps", self.steps)
        if self.warmup_steps is not None:
            check_positive("--warmup-steps", self.warmup_steps, allow_zero=True)
        if self.stop_after_steps is not None:
            check_positive("--stop-after-steps", self.stop_after_steps)
            if not self.checkpoint_dir:
                raise UsageError("--stop-after-steps needs --checkpoint-dir (to resume later)")
        if self.checkpoint_every is not None:
            check_positive("--checkpoint-every", self.checkpoint_every)
        check_positive("--weight-decay", self.weight_decay, allow_zero=True)
        check_positive("--momentum", self.momentum, allow_zero=True)
        check_positive("--bucket-cap-mb", self.bucket_cap_mb)
        if self.clip_grad is not None:
            check_positive("--clip-grad", self.clip_grad)
        if self.threads is not None:
            check_positive("--threads", self.threads)
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"unknown device {self.device!r}; valid: auto, cpu, cuda")
        if self.resume and not self.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir")
        if self.nesterov and self.momentum == 0:
            raise UsageError("--nesterov needs --momentum > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

"""Training configuration: one dataclass, validated before any process starts."""

from __future__ import annotations

import os

from dataclasses import asdict, dataclass, field
from typing import Any

from lowcomm.errors import UsageError, check_count, check_positive, check_range
from lowcomm.optim.kfac_spec import BASE_OPTIMIZERS, resolve_optimizer
from lowcomm.runtime.input_spec import check_input_options

SCHEDULES = ("constant", "step", "multistep", "cosine", "poly")
#: base optimizers; ``--optimizer kfac[:key=value,...]`` puts K-FAC in front of one
#: (:mod:`lowcomm.optim.kfac_spec`: the spec becomes ``optimizer`` plus ``kfac``)
OPTIMIZERS = BASE_OPTIMIZERS
AMP_MODES = ("auto", "fp16", "bf16")
#: Local worker processes one ``lowcomm train --nproc`` may start. Each is a full Python +
#: torch process; beyond this a typo would fork-bomb the machine (use torchrun across nodes).
MAX_LOCAL_WORKERS = 256
#: torch threads per worker; more is a typo (torch itself fails late on absurd counts).
MAX_THREADS = 1024


@dataclass
class TrainConfig:
    """Every setting of one training run; built once (CLI or Python), validated before any
    worker starts, and sent to every worker as JSON, so all ranks train the same thing."""

    model: str = "cnn1d"
    data: str = "mnist1d"
    data_dir: str | None = None
    # input pipeline (lowcomm.runtime.input_spec, docs/input_pipeline.md)
    data_workers: int = 0  # DataLoader worker processes per rank (0: read in the training process)
    prefetch: int | None = None  # batches per worker prepared ahead (None: torch's 2)
    data_cache: str = "none"  # decoded-sample cache: none, memory, disk or disk:DIR
    method: str = "ssgd"
    nproc: int = 1
    #: workers per node (``--gpus-per-node``; None: torchrun's LOCAL_WORLD_SIZE, else one node)
    gpus_per_node: int | None = None
    epochs: int = 1
    steps: int | None = None  # stop after this many optimizer steps in total
    warmup_steps: int | None = None  # steps excluded from timing medians
    batch_size: int = 64  # per worker
    eval_batch_size: int = 512
    lr: float = 0.1
    optimizer: str = "sgd"  # sgd, adamw, lars[:...], lamb[:...] or kfac[:key=value,...] (validate: base name + kfac)
    optimizer_options: dict[str, Any] = field(default_factory=dict)  # lars/lamb keys (lowcomm.optim.adaptive_spec)
    kfac: dict[str, Any] | None = None  # K-FAC's options (None: no K-FAC), see lowcomm.optim.kfac_spec
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    no_decay_norm_bias: bool = False
    schedule: str = "cosine"
    lr_warmup_epochs: float = 0.0
    poly_power: float = 2.0  # --schedule poly: (1 - t/T) ** power after the warm-up
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])  # fractions of training
    gamma: float = 0.1
    step_size_epochs: int = 30
    clip_grad: float | None = None
    amp: bool | str = False  # False / True (= "auto") / "auto" / "fp16" / "bf16"
    seed: int = 0
    threads: int | None = None
    device: str = "auto"
    #: ``real`` or ``emulated:PROFILE|NAME|scale=K`` (lowcomm.runtime.emulated: layers wait instead of computing)
    compute: str = "real"
    #: DDP's bucket cap in MiB; None: DDP's defaults (25 MiB, the first bucket 1 MiB)
    bucket_cap_mb: float | None = None
    eval: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps
    resume: bool = False
    stop_after_steps: int | None = None  # leave cleanly (checkpointed) after N steps of this run
    json: str | None = None
    log: str | None = None  # JSONL per-step log (rank 0)
    log_all_ranks: bool = False  # every rank writes its own --log (records.rank_log_path)
    tensorboard: str | None = None
    progress: bool = True
    model_args: dict[str, Any] = field(default_factory=dict)
    data_args: dict[str, Any] = field(default_factory=dict)
    # options the user typed (``lowcomm.runtime.flags``): a method may adapt the others
    explicit_flags: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """Refuse bad numbers and names before any worker starts."""
        # Every number is checked for what it means (nan and inf included), not only its sign:
        # a worker that starts with lr=nan trains to nan without a word.
        check_count("--nproc", self.nproc, maximum=MAX_LOCAL_WORKERS)
        from lowcomm.runtime.compute_spec import parse_compute

        parse_compute(self.compute)  # torch-free; a bad value is one line before any worker starts
        if self.gpus_per_node is not None:  # that it divides the world: train_cli / the trainer
            check_count("--gpus-per-node", self.gpus_per_node, maximum=MAX_LOCAL_WORKERS)
        check_input_options(self.data_workers, self.prefetch, self.data_cache)
        check_count("--epochs", self.epochs)
        check_count("--batch-size", self.batch_size)
        check_count("--eval-batch-size", self.eval_batch_size)
        check_positive("--lr", self.lr)
        if self.steps is not None:
            check_count("--steps", self.steps)
        if self.warmup_steps is not None:
            check_count("--warmup-steps", self.warmup_steps, minimum=0)
        if self.stop_after_steps is not None:
            check_count("--stop-after-steps", self.stop_after_steps)
            if not self.checkpoint_dir:
                raise UsageError("--stop-after-steps needs --checkpoint-dir (to resume later)")
        if self.checkpoint_every is not None:
            check_count("--checkpoint-every", self.checkpoint_every)
        check_positive("--weight-decay", self.weight_decay, allow_zero=True)
        check_range("--momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_range("--gamma", self.gamma, 0.0, 1.0, low_open=True)  # 0 would zero the LR for good
        check_positive("--lr-warmup-epochs", self.lr_warmup_epochs, allow_zero=True)
        check_positive("--poly-power", self.poly_power)
        for m in self.milestones:
            check_positive("--milestones (fractions of training <= 1, or epochs)", m)
        check_count("--step-size-epochs", self.step_size_epochs)
        if self.bucket_cap_mb is not None:
            check_positive("--bucket-cap-mb", self.bucket_cap_mb)
        if self.clip_grad is not None:
            check_positive("--clip-grad", self.clip_grad)
        if self.threads is not None:
            check_count("--threads", self.threads, maximum=MAX_THREADS)
        check_count("--seed", self.seed, minimum=0, maximum=2**32 - 1)
        resolve_optimizer(self)  # "kfac:..." -> base optimizer + kfac options; bad keys refused
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"unknown device {self.device!r}; valid: auto, cpu, cuda")
        if self.resume and not self.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir")
        if self.log_all_ranks and not self.log:
            raise UsageError("--log-all-ranks needs --log FILE (rank 0 writes FILE, rank N FILE's name with .rankN)")
        self.amp_mode()  # refuses an unknown --amp value
        if self.nesterov and self.momentum == 0:
            raise UsageError("--nesterov needs --momentum > 0")
        for flag, path, is_dir in (("--json", self.json, False), ("--log", self.log, False),
                                   ("--checkpoint-dir", self.checkpoint_dir, True),
                                   ("--tensorboard", self.tensorboard, True)):
            if path:
                check_writable(flag, path, is_dir=is_dir)

    def amp_mode(self) -> str | None:
        """``None`` (no AMP), ``"auto"`` (plain ``--amp``: bf16 on CPU, fp16 + GradScaler on
        CUDA), ``"fp16"`` (+ GradScaler, also on CPU) or ``"bf16"``."""
        if self.amp is False or self.amp is None:
            return None
        if self.amp is True:
            return "auto"
        mode = str(self.amp).strip().lower()
        if mode not in AMP_MODES:
            raise UsageError(f"unknown --amp {self.amp!r}; valid: {', '.join(AMP_MODES)} (or no value: auto)")
        return mode

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain JSON types (for workers and the run's records)."""
        return asdict(self)


def check_writable(flag: str, path: str, *, is_dir: bool) -> None:
    """Refuse, in one line before any worker starts, an output path that cannot be written.

    Checked here rather than found out at the first log line or checkpoint: by then the
    workers have trained for a while, and each would fail with its own ``OSError``
    traceback. Nothing is created: a missing ``--checkpoint-dir`` is made later, so only its
    nearest existing ancestor must be a writable folder; a file's folder must exist.
    """
    target = os.path.abspath(path)
    if is_dir:
        if os.path.exists(target) and not os.path.isdir(target):
            raise UsageError(f"{flag} {path!r} exists and is not a folder")
        probe = target
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
    else:
        if os.path.isdir(target):
            raise UsageError(f"{flag} {path!r} is a folder; give a file path")
        probe = os.path.dirname(target)
        if not os.path.isdir(probe):
            raise UsageError(f"{flag} {path!r}: folder {probe!r} does not exist")
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path!r}: {probe!r} is not a writable folder")

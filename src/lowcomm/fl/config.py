"""One federated run's settings: a dataclass checked before any worker starts.

Why torch-free: ``lowcomm fl`` only starts the workers and watches them; importing torch
there would add ~220 MB to the memory the run reports for nothing. What needs torch or the
registries (algorithm options, model arguments, the partition against the data) is checked
in the workers, whose :class:`~lowcomm.errors.UsageError` the launcher prints once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from lowcomm.errors import UsageError, check_count, check_positive

#: client-to-worker assignment policies (lowcomm.fl.schedule)
SCHEDULE_POLICIES = ("fitted", "even")
#: registered clients one run may have (the state store holds a row per client)
MAX_CLIENTS = 10_000_000


@dataclass
class FLConfig:
    """Every setting of one ``lowcomm fl`` run, sent to every worker as JSON."""

    clients: int = 100
    per_round: int = 10
    nproc: int = 2
    nproc_per_node: int | None = None
    algorithm: str = "fedavg"
    #: user modules (``FILE.py`` or ``dotted.name``) that register algorithms, imported by each worker
    algorithm_modules: list[str] = field(default_factory=list)
    model: str = "mlp"
    model_args: dict[str, Any] = field(default_factory=dict)
    data: str = "mnist1d"
    data_dir: str | None = None
    data_args: dict[str, Any] = field(default_factory=dict)
    samples_per_client: int | None = None
    partition: str = "dirichlet:alpha=0.5"
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"
    schedule: str = "fitted"
    warmup_rounds: int = 2
    slowdown: list[float] | None = None
    cross_silo: bool = False
    eval_every: int = 1
    state_dir: str | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    stop_after_rounds: int | None = None
    json: str | None = None
    log: str | None = None  # one JSON line per round (rank 0)
    plot: str | None = None
    threads: int | None = None
    quiet: bool = False
    no_progress: bool = False

    def validate(self) -> None:
        """Refuse what is wrong on its face, naming the flag and what is valid."""
        check_count("--clients", self.clients, maximum=MAX_CLIENTS)
        check_count("--per-round", self.per_round, maximum=MAX_CLIENTS)
        if self.per_round > self.clients:
            raise UsageError(f"--per-round {self.per_round} is more than --clients {self.clients}; "
                             f"valid: 1..{self.clients}")
        check_count("--nproc", self.nproc, maximum=256)
        check_count("--rounds", self.rounds)
        check_count("--local-epochs", self.local_epochs)
        check_count("--batch-size", self.batch_size)
        check_count("--eval-every", self.eval_every)
        check_count("--warmup-rounds", self.warmup_rounds, minimum=0)
        if self.samples_per_client is not None:
            check_count("--samples-per-client", self.samples_per_client)
        if self.stop_after_rounds is not None:
            check_count("--stop-after-rounds", self.stop_after_rounds)
        if self.threads is not None:
            check_count("--threads", self.threads, maximum=1024)
        check_positive("--lr", self.lr)
        check_positive("--momentum", self.momentum, allow_zero=True)
        check_positive("--weight-decay", self.weight_decay, allow_zero=True)
        if self.momentum >= 1:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.schedule not in SCHEDULE_POLICIES:
            raise UsageError(f"--schedule {self.schedule!r} is not a policy; valid: {', '.join(SCHEDULE_POLICIES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {self.device!r}; valid: auto, cpu, cuda")
        if self.cross_silo and (self.clients != self.per_round):
            raise UsageError(f"--cross-silo trains every client every round, one per worker: "
                             f"--clients and --per-round must both equal the number of workers "
                             f"(got {self.clients} and {self.per_round})")
        if self.resume and not self.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint-dir (where the last complete round was saved)")
        if self.stop_after_rounds is not None and not self.checkpoint_dir:
            raise UsageError("--stop-after-rounds needs --checkpoint-dir (to continue with --resume)")

    def to_json(self) -> str:
        """The settings as JSON (what the launcher hands to its workers)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FLConfig:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))

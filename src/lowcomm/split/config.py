"""One split fine-tuning run's settings, checked before any process starts (torch-free)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from lowcomm.errors import UsageError, check_count, check_positive
from lowcomm.runtime.compute_spec import ComputeSpec, parse_compute

WIRES = ("fp32", "fp16", "bf16")
ROLES = ("edge", "cloud")
#: with ``--compute emulated:scale=K``, the real training steps that run before the replay
#: starts (:mod:`lowcomm.split.emulate`); the first :data:`PROFILE_WARMUP` of them are still
#: warming up (allocations, caches: measured 1.6, 1.1, 1.0 s against 0.7-0.8 s after, MiniLM on
#: 2 cores), so each side's computation is the median of the others
PROFILE_STEPS = 8
PROFILE_WARMUP = 3


def split_compute(text: str | None, *, unsplit: bool, steps: int | None) -> ComputeSpec:
    """Parse ``--compute`` for ``lowcomm split``: ``real`` or ``emulated:scale=K`` (one line on misuse)."""
    what = (text or "real").strip()
    if what.startswith("emulated:") and not what.startswith("emulated:scale="):
        raise UsageError(f"--compute {what!r}: lowcomm split takes real or emulated:scale=K (profiles "
                         "describe a bench model's layers, not the two halves of a split model)")
    spec = parse_compute(what)
    if not spec.emulated:
        return spec
    if unsplit:
        raise UsageError("--unsplit with --compute emulated: nothing crosses a link, so the step time would "
                         "be the measured one divided by K; use --compute real")
    if steps is None or steps <= PROFILE_STEPS:
        raise UsageError(f"--compute {spec.text} needs --steps N with N > {PROFILE_STEPS}: the first "
                         f"{PROFILE_STEPS} steps measure the computation, the rest are timed")
    return spec


@dataclass
class SplitConfig:
    """Every setting of one ``lowcomm split`` run, sent to both processes as JSON."""

    model: str = "minilm"
    split_layer: int = 3
    rank: int = 8
    data: str = "tweets"
    data_dir: str | None = None
    max_train: int | None = None
    max_test: int | None = None
    wire: str = "fp32"
    compress: bool = True
    keep_residual: bool = False
    unsplit: bool = False
    net: str | None = None
    compute: str = "real"  # or emulated:scale=K (lowcomm.split.emulate)
    epochs: int = 1
    steps: int | None = None
    batch_size: int = 32
    eval_batch_size: int = 128
    max_len: int = 64
    lr: float = 5e-5
    weight_decay: float = 0.01
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    json: str | None = None
    log: str | None = None  # one JSON line per training step (the edge)
    quiet: bool = False

    def validate(self) -> None:
        """Refuse what is wrong on its face (the model-dependent ranges are checked on load)."""
        check_count("--split-layer", self.split_layer)
        check_count("--rank", self.rank)
        check_count("--epochs", self.epochs)
        check_count("--batch-size", self.batch_size)
        check_count("--eval-batch-size", self.eval_batch_size)
        check_count("--max-len", self.max_len, minimum=2)
        for name, value in (("--steps", self.steps), ("--max-train", self.max_train),
                            ("--max-test", self.max_test), ("--threads", self.threads)):
            if value is not None:
                check_count(name, value)
        check_positive("--lr", self.lr)
        check_positive("--weight-decay", self.weight_decay, allow_zero=True)
        if self.wire not in WIRES:
            raise UsageError(f"--wire {self.wire!r}; valid: {', '.join(WIRES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device {self.device!r}; valid: auto, cpu, cuda")
        split_compute(self.compute, unsplit=self.unsplit, steps=self.steps)
        if self.unsplit and self.net:
            raise UsageError("--unsplit trains the whole model in one process: nothing crosses a link, "
                             "so --net does not apply")

    def to_json(self) -> str:
        """The settings as JSON (what the launcher hands to both processes)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SplitConfig:
        """Inverse of :meth:`to_json`."""
        values: dict[str, Any] = json.loads(text)
        return cls(**values)

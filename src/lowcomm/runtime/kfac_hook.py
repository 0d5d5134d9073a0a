"""K-FAC in the training loop (``lowcomm train --optimizer kfac[:key=value,...]``).

The trainer keeps one :class:`KFACRun` (inactive without ``kfac``) and calls it at four
points: :meth:`~KFACRun.build` after every wrap (start, resume, Pufferfish's re-wrap: the
layers may have changed, so the old preconditioner is removed and a new one built on every
rank), :meth:`~KFACRun.step` after the gradient is synchronized and unscaled and before
clipping and the optimizer step (also on a step that is then skipped as non-finite, so the
factor all-reduces the hooks started are consumed and the step count follows the LR
schedule), and :meth:`~KFACRun.state_dict` for checkpoints. Its time is the breakdown
phase ``kfac`` (taken out of ``optimizer``).

Which methods it refuses, and why: K-FAC preconditions the averaged gradient in ``p.grad``.
The sharded engine schedules (``dear``, ``lee18``) hold it as shards between
``finish_sync`` and the step, and ``torch_fsdp`` keeps flat sharded gradients, so there is
nothing for it to precondition (a Pufferfish phase running one of them is refused too).
``--amp`` is refused for now: the forward hooks would compute factors in fp16/bf16.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import TYPE_CHECKING, Any

from lowcomm import methods as method_registry
from lowcomm.errors import UsageError
from lowcomm.methods.base import Method
from lowcomm.optim.kfac_spec import resolve_optimizer

if TYPE_CHECKING:
    from lowcomm.optim.kfac import KFAC
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.timing import StepTimer
    from lowcomm.runtime.trainer import Trainer

#: methods refused by name, with the reason (the sharded engine modes are found by their mode)
REFUSED = {"torch_fsdp": "FSDP keeps flat sharded gradients, not each layer's p.grad"}


def _phases(method: Method) -> list[Method]:
    """``method`` and the methods it runs inside (Pufferfish's ``warmup_method`` and ``then``)."""
    found = [method]
    for key in ("warmup_method", "then"):
        spec = getattr(method.options, key, None)
        if isinstance(spec, str) and spec:
            spec = spec if "(" in spec else spec.replace(";", ",")  # Pufferfish's old separator
            found += _phases(method_registry.create(spec))
    return found


def refusal(method: Method) -> str | None:
    """Why K-FAC cannot run with ``method`` (None: it can)."""
    from lowcomm.sched.pairing import Mode

    for m in _phases(method):
        mode = getattr(m, "mode", None)
        if isinstance(mode, Mode) and mode is not Mode.ALLREDUCE:
            return (f"{m.name} holds the averaged gradient as shards ({mode.value} mode), not in p.grad, "
                    "which K-FAC preconditions; use a method that leaves it in p.grad (ssgd, a compression "
                    "method, wfbp, mgwfbp)")
        if m.name in REFUSED:
            return f"{m.name}: {REFUSED[m.name]}"
    return None


def check_method(cfg: TrainConfig, method: Method) -> None:
    """Refuse ``--optimizer kfac`` with a method or setting it cannot work with (a UsageError
    saying why)."""
    if cfg.kfac is None:
        return
    why = refusal(method)
    if why is not None:
        raise UsageError(f"--optimizer kfac with --method {cfg.method}: {why}")


class KFACRun:
    """The trainer's K-FAC: built after each wrap, stepped before the optimizer, checkpointed."""

    def __init__(self, cfg: TrainConfig, method: Method) -> None:
        resolve_optimizer(cfg)  # 'kfac:...' -> base optimizer + cfg.kfac (Python callers too)
        check_method(cfg, method)
        self.options: dict[str, Any] | None = cfg.kfac
        self.kfac: KFAC | None = None

    @property
    def active(self) -> bool:
        """Whether this run uses K-FAC."""
        return self.options is not None

    def build(self, trainer: Trainer, resume_state: dict[str, Any] | None = None) -> None:
        """(Re)build K-FAC on ``trainer.raw`` (collective: every rank), restoring a checkpoint's state."""
        if self.options is None:
            if resume_state is not None and resume_state.get("kfac") and trainer.dist.is_main:
                print("lowcomm: the checkpoint has K-FAC state; this run has no --optimizer kfac, "
                      "so it is ignored", file=sys.stderr, flush=True)
            return
        from lowcomm.optim.kfac import KFAC

        if self.kfac is not None:
            self.kfac.remove()
        options = dict(self.options)
        options["skip_layers"] = tuple(options["skip_layers"])

        def lr(_step: int) -> float:  # the LR this step uses (schedule and re-warm-up applied)
            return max(float(trainer.optimizer.param_groups[0]["lr"]), sys.float_info.min)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.kfac = KFAC(trainer.raw, lr=lr, grad_scaler=trainer.scaler, **options)
        if trainer.dist.is_main:  # layers K-FAC leaves alone: named once, by rank 0, as notices
            for w in caught:
                print(f"lowcomm: warning: {w.message}", file=sys.stderr, flush=True)
        state = resume_state.get("kfac") if resume_state is not None else None
        if state is not None:
            self.kfac.load_state_dict(state)
        elif resume_state is not None and trainer.dist.is_main:
            print("lowcomm: the checkpoint has no K-FAC state; K-FAC starts from scratch",
                  file=sys.stderr, flush=True)

    def step(self, timer: StepTimer) -> None:
        """Precondition ``p.grad`` (every rank), timed as phase ``kfac`` instead of ``optimizer``."""
        if self.kfac is None:
            return
        start = time.perf_counter()
        self.kfac.step()
        seconds = time.perf_counter() - start
        timer.add("kfac", seconds)
        timer.add("optimizer", -seconds)  # called inside the optimizer phase

    def state_dict(self) -> dict[str, Any] | None:
        """K-FAC's state for a checkpoint (collective with DP-KFAC: every rank calls it), or None."""
        return self.kfac.state_dict() if self.kfac is not None else None

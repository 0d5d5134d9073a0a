"""Progressive shrinking on the ordinary trainer: every phase is a ``lowcomm train`` run.

:class:`ElasticTrainer` changes three things of :class:`~lowcomm.runtime.trainer.Trainer`:
the model (the supernet inside :class:`~lowcomm.elastic.shrinking.MultiNet`, or one
sub-network alone for ``--scratch``), the loss (the step's sub-networks summed, plus
distillation from the full network), and evaluation (the largest and the smallest
sub-network, each after BN re-calibration). Methods, optimizers, AMP, checkpoints, timing and
byte counts are the trainer's, so any lowcomm method trains a supernet.

:func:`run_elastic` runs the phases one after another in the same workers and process group;
each phase checkpoints into its own folder and leaves ``final.pt``, so ``--resume`` skips
finished phases and continues the current one exactly.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowcomm.elastic.artifacts import save_subnet, save_supernet
from lowcomm.elastic.config import ElasticConfig
from lowcomm.elastic.shrinking import MultiNet, Phase, step_configs
from lowcomm.elastic.space import Config
from lowcomm.elastic.supernet import Supernet, recalibrate_bn
from lowcomm.errors import UsageError
from lowcomm.methods.base import Method
from lowcomm.runtime import checkpoint
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.evaluation import evaluate
from lowcomm.runtime.trainer import Trainer
from lowcomm.runtime.workload import Batches, build_model, loss_fn, model_kwargs_for_data

__all__ = ["ElasticTrainer", "distill_loss", "run_elastic"]


def distill_loss(task: str, student: Any, teacher: Any) -> torch.Tensor:
    """OFA's knowledge distillation: cross-entropy against the full network's soft labels
    (classification) or smooth-L1 to its final disparity map (stereo)."""
    if task == "stereo":
        s = student[-1] if isinstance(student, (list, tuple)) else student
        t = teacher[-1] if isinstance(teacher, (list, tuple)) else teacher
        return F.smooth_l1_loss(s, t.detach())
    return -(F.softmax(teacher.detach().float(), dim=-1) * F.log_softmax(student.float(), dim=-1)).sum(-1).mean()


def reset_weights(module: nn.Module) -> None:
    """Fresh initial weights (each layer's own ``reset_parameters``): a from-scratch baseline
    starts where a plain network of that shape starts, not from the supernet's initialisation."""
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


class ElasticTrainer(Trainer):
    """One phase of progressive shrinking (or one sub-network from scratch) on the trainer."""

    def __init__(self, cfg: TrainConfig, ecfg: ElasticConfig, phase: Phase, *,
                 init_state: dict[str, torch.Tensor] | None = None,
                 teacher_state: dict[str, torch.Tensor] | None = None, sort_first: bool = False) -> None:
        self.ecfg = ecfg
        self.phase = phase
        self._init_state = init_state
        self._teacher_state = teacher_state
        self._sort_first = sort_first
        self.supernet: Supernet | None = None
        self.model_kwargs: dict[str, Any] = {}
        super().__init__(cfg)

    # --- the model ----------------------------------------------------------------------------
    def build_raw_model(self) -> nn.Module:
        """The supernet (in a :class:`MultiNet`), or ``--scratch``'s sub-network re-initialised."""
        if type(self.method).prepare is not Method.prepare:
            raise UsageError(f"method {self.cfg.method!r} changes the model (model axis); an elastic supernet "
                             "is the model axis itself: use a payload or schedule method (ssgd, fp16, powersgd, "
                             "topk, dear, ...)")
        self.model_kwargs = model_kwargs_for_data(self.cfg.model, self.cfg.model_args, self.bundle)
        net = build_model(self.cfg, self.bundle)
        if not isinstance(net, Supernet):
            raise UsageError(f"model {self.cfg.model!r} is not an elastic supernet; use elastic_cnn1d, "
                             "elastic_cnn2d or elastic_stereo")
        if self._init_state is not None:
            net.load_state_dict(self._init_state)
        if self._sort_first:
            net.sort_channels()  # OFA: before the expansion ratio becomes elastic
        self.supernet = net
        if self.ecfg.scratch is not None:
            sub = net.extract(net.space.validate(self.ecfg.scratch))
            reset_weights(sub)
            if hasattr(net, "max_disp"):
                sub.max_disp = net.max_disp
            return sub
        multi = MultiNet(net)
        if self._teacher_state is not None and self.ecfg.distill > 0:
            teacher = build_model(self.cfg, self.bundle)
            assert isinstance(teacher, Supernet)
            teacher.load_state_dict(self._teacher_state)
            teacher.set_active(teacher.space.max_config())
            multi.set_teacher(teacher)
        return multi

    @property
    def multinet(self) -> MultiNet | None:
        """The :class:`MultiNet` the method wrapped (None for ``--scratch``)."""
        return self.raw if isinstance(self.raw, MultiNet) else None

    # --- the loss -----------------------------------------------------------------------------
    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step's sub-networks' losses summed (OFA accumulates their gradients), plus
        ``--distill`` times each one's distillation loss, in one forward and one backward."""
        multi = self.multinet
        if multi is None:
            return super().compute_loss(x, y)
        assert self.supernet is not None
        multi.configs = step_configs(self.supernet, self.phase, self.cfg.seed, self.step,
                                     sandwich=self.ecfg.sandwich)
        out = self.model(x)
        total: torch.Tensor = out["touch"]
        for o in out["outputs"]:
            total = total + loss_fn(self.task, o, y, max_disp=self.max_disp)
            if out["teacher"] is not None:
                total = total + self.ecfg.distill * distill_loss(self.task, o, out["teacher"])
        return total

    # --- evaluation ---------------------------------------------------------------------------
    def calibration_batches(self) -> Iterator[torch.Tensor]:
        """The first ``--bn-batches`` training batches of a fixed order: the same on every rank,
        so every rank re-calibrates to the same statistics without a collective."""
        batches = Batches(self.bundle.train, self.cfg.batch_size, 0, 1, self.cfg.seed)
        for i, idx in enumerate(batches.plan(0)):
            if i >= self.ecfg.bn_batches:
                return
            yield batches.fetch(idx)[0].to(self.dist.device)

    def evaluate_config(self, config: Config) -> dict[str, float]:
        """Test metrics of one sub-network of the supernet, BN re-calibrated, the supernet's
        own BN statistics restored afterwards (training goes on unchanged)."""
        net = self.supernet
        assert net is not None
        saved = {k: v.clone() for k, v in net.state_dict().items() if "running_" in k or "num_batches" in k}
        before = net.active_config()
        net.set_active(config)
        try:
            if self.ecfg.bn_batches:
                recalibrate_bn(net, self.calibration_batches(), num_batches=self.ecfg.bn_batches)
            return evaluate(net, self.bundle.test, task=self.task, dist_info=self.dist,
                            batch_size=self.cfg.eval_batch_size, amp=self.amp_dtype,
                            target_is_input=False, max_disp=self.max_disp)
        finally:
            net.load_state_dict(saved, strict=False)
            net.set_active(before)

    def evaluate(self) -> dict[str, float]:
        """The largest sub-network's metrics (the keys ``lowcomm train`` reports) and the
        smallest one's with a ``_min`` suffix; ``--scratch``: the sub-network's."""
        self.method.flush()
        if self.multinet is None:
            return super().evaluate()
        assert self.supernet is not None
        result = self.evaluate_config(self.supernet.space.max_config())
        smallest = self.evaluate_config(self.supernet.space.min_config())
        result.update({f"{k}_min": v for k, v in smallest.items()})
        return result


def _phase_dir(root: str | None, index: int, phase: Phase) -> str | None:
    return os.path.join(root, f"phase{index}-{phase.name}") if root else None


def _cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def run_elastic(ecfg: ElasticConfig) -> dict[str, Any]:
    """Worker entry of ``lowcomm elastic train``: every phase in turn; rank 0 writes ``--out``
    and ``--json``. Returns the run's summary (every rank)."""
    phases = [Phase(p["name"], p["epochs"], tuple(p["elastic"]), p["subnets"], p.get("lr")) for p in ecfg.phases]
    root = ecfg.train.checkpoint_dir
    state: dict[str, torch.Tensor] | None = None
    teacher: dict[str, torch.Tensor] | None = None
    if ecfg.init:
        from lowcomm.elastic.artifacts import read

        state = read(ecfg.init, "supernet")["state_dict"]
        teacher = state
    records: list[dict[str, Any]] = []
    previous: str | None = None
    trainer: ElasticTrainer | None = None
    stopped: str | None = None
    budget = ecfg.train.stop_after_steps
    start = time.perf_counter()
    for i, phase in enumerate(phases):
        folder = _phase_dir(root, i, phase)
        final = os.path.join(folder, "final.pt") if folder else None
        if ecfg.train.resume and final and os.path.exists(final):
            blob = torch.load(final, map_location="cpu", weights_only=True)
            state, record = blob["state_dict"], blob["record"]
            teacher = state if phase.name == "full" else teacher
            records.append(record)
            previous = phase.name
            continue
        if budget is not None and budget <= 0:  # --stop-after-steps ran out at a phase boundary
            stopped = phase.name
            break
        # --steps N: N steps per phase (quick runs and tests), else the phase's epochs
        cfg = dataclasses.replace(ecfg.train, epochs=phase.epochs, lr=phase.lr or ecfg.train.lr,
                                  checkpoint_dir=folder, json=None, stop_after_steps=budget,
                                  log=f"{ecfg.train.log}.{phase.name}" if ecfg.train.log else None)
        sort_first = phase.name == "expand" and state is not None and previous != "expand"
        trainer = ElasticTrainer(cfg, ecfg, phase, init_state=state, teacher_state=teacher, sort_first=sort_first)
        first_step = trainer.step
        try:
            summary = trainer.run()
        finally:
            trainer.close()
        if budget is not None:  # --stop-after-steps counts the steps of this invocation, all phases
            budget -= trainer.step - first_step
        if trainer.step < trainer.total_steps:  # --stop-after-steps: checkpointed mid-phase, resume later
            records.append({"phase": phase.to_json(), "summary": summary})
            stopped = phase.name
            break
        assert trainer.supernet is not None
        source = trainer.raw if ecfg.scratch is not None else trainer.supernet
        state = _cpu_state(source)
        teacher = state if phase.name == "full" else teacher
        record = {"phase": phase.to_json(), "summary": summary}
        records.append(record)
        if trainer.dist.is_main and final:
            checkpoint.atomic_save({"state_dict": state, "record": record}, final)
        if dist.is_initialized():
            dist.barrier()
        previous = phase.name
    result = _summary(ecfg, records, time.perf_counter() - start)
    result["stopped_in_phase"] = stopped
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        _write_outputs(ecfg, trainer, state if stopped is None else None, result)
    if dist.is_initialized():
        dist.barrier()
    return result


def _summary(ecfg: ElasticConfig, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The run's JSON: the last phase's ``lowcomm train`` keys plus every phase's record."""
    last = dict(records[-1]["summary"]) if records else {}
    last.pop("history", None)
    phases = []
    for r in records:
        s = r["summary"]
        final = s.get("history", [{}])[-1] if s.get("history") else {}
        phases.append({**r["phase"], "steps": s.get("steps"), "iter_time_s_median": s.get("iter_time_s_median"),
                       "bytes_per_worker_per_iter": s.get("bytes_per_worker_per_iter"),
                       "final": {k: v for k, v in final.items() if k.startswith("test_")},
                       "wall_s": final.get("wall_s")})
    return {**last, "command": "elastic train", "mode": "scratch" if ecfg.scratch is not None else "supernet",
            "scratch_config": ecfg.scratch, "distill": ecfg.distill, "sandwich": ecfg.sandwich,
            "bn_batches": ecfg.bn_batches,
            "phases": phases, "epochs": sum(int(p["epochs"]) for p in ecfg.phases), "wall_s": wall_s,
            "out": ecfg.out}


def _write_outputs(ecfg: ElasticConfig, trainer: ElasticTrainer | None, state: dict[str, torch.Tensor] | None,
                   result: dict[str, Any]) -> None:
    if ecfg.out and state is not None:
        from lowcomm import data as data_registry
        from lowcomm.elastic.artifacts import build_supernet

        cfg = ecfg.train
        if trainer is not None:
            kwargs = trainer.model_kwargs
        else:  # every phase was already done (resume): size the model from the data again
            bundle = data_registry.create(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed, **cfg.data_args)
            kwargs = model_kwargs_for_data(cfg.model, cfg.model_args, bundle)
        meta = {"model": cfg.model, "model_args": kwargs, "data": cfg.data, "data_dir": cfg.data_dir,
                "data_args": cfg.data_args, "seed": cfg.seed, "batch_size": cfg.batch_size,
                "phases": ecfg.phases, "summary": {k: v for k, v in result.items() if k != "traffic"}}
        net = build_supernet(cfg.model, kwargs)
        if ecfg.scratch is not None:
            sub = net.extract(net.space.validate(ecfg.scratch))
            sub.load_state_dict(state)
            save_subnet(ecfg.out, sub, ecfg.scratch, meta)
        else:
            net.load_state_dict(state)
            save_supernet(ecfg.out, net, meta)
    if ecfg.train.json:
        checkpoint.atomic_write_json(result, ecfg.train.json)

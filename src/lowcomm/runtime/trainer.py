"""The training loop every method runs in: short enough to read in one sitting.

One worker per rank, plain DDP-style data parallelism; a :class:`~lowcomm.methods.Method`
decides how the model is wrapped and how gradients travel, and everything is measured the
same way for every method. Beside it: process group (:mod:`.distributed`), AMP
(:mod:`.precision`), model/data/loss (:mod:`.workload`), :mod:`.evaluation`, :mod:`.measure`,
logs (:mod:`.records`), JSON (:mod:`.summary`); optimizers are :mod:`lowcomm.optim`.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm import data as data_registry
from lowcomm import methods as method_registry
from lowcomm import models as model_registry
from lowcomm.comm import accounting
from lowcomm.comm.topology import Topology
from lowcomm.compress.feedback import warn_nonfinite
from lowcomm.errors import UsageError
from lowcomm.methods.base import Method, MethodContext
from lowcomm.optim.builders import apply_method_overrides, build_optimizer
from lowcomm.optim.schedules import advance, build_scheduler
from lowcomm.runtime import checkpoint, timing
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.distributed import init_distributed
from lowcomm.runtime.emulated_setup import EmulatedCompute
from lowcomm.runtime.evaluation import evaluate
from lowcomm.runtime.kfac_hook import KFACRun
from lowcomm.runtime.measure import InterfaceCounter, LastGradClock
from lowcomm.runtime.precision import amp_dtype, autocast, grad_scaler
from lowcomm.runtime.records import Progress, RunLog
from lowcomm.runtime.summary import summary
from lowcomm.runtime.workload import (Batches, build_model, cache_samples, loss_fn, seed_everything,
                                       task_of, unwrap)

__all__ = ["Trainer", "amp_dtype", "run_training"]


class Trainer:
    """Builds everything from a :class:`TrainConfig` and runs the loop on this rank."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.dist = init_distributed(cfg)
        # workers per node: --gpus-per-node, else LOCAL_WORLD_SIZE; the ledger splits bytes by link
        accounting.set_topology(Topology.from_env(cfg.gpus_per_node))
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        self.bundle = data_registry.create(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed, **cfg.data_args)
        self.task = task_of(cfg.model, self.bundle)
        # Encoder-decoder models trained as a copy task predict their own input.
        self.target_is_input = getattr(model_registry.info(cfg.model), "lm_target", "next") == "input"
        self.method: Method = method_registry.create(cfg.method)
        self.kfac = KFACRun(cfg, self.method)  # --optimizer kfac:...: base optimizer + K-FAC (or inactive)
        moved: dict[str, Any] = {}  # momentum correction: SGD's momentum moves into the codec
        for line in apply_method_overrides(cfg, self.method, moved):  # e.g. signum: no SGD momentum
            if self.dist.is_main:
                print(f"lowcomm: {line}", file=sys.stderr, flush=True)
        if self.method.timing_only and cfg.eval:
            raise UsageError(f"method {cfg.method!r} is for timing only; use it with --no-eval")
        self.bundle = cache_samples(cfg, self.bundle)  # --data-cache: decoded once, read later epochs
        self.train_batches = Batches(self.bundle.train, cfg.batch_size, self.dist.rank, self.dist.world_size, cfg.seed,
                                     workers=cfg.data_workers, prefetch=cfg.prefetch,
                                     pin_memory=self.dist.device.type == "cuda")
        self.steps_per_epoch = len(self.train_batches)
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.ctx = MethodContext(
            rank=self.dist.rank, world_size=self.dist.world_size,
            local_rank=self.dist.local_rank,
            device=self.dist.device,
            seed=cfg.seed,
            bucket_cap_mb=cfg.bucket_cap_mb,
            codec_momentum=float(moved.get("momentum", 0.0)),
            steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps, batch_size=cfg.batch_size,
        )
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.warmup_steps = (
            cfg.warmup_steps if cfg.warmup_steps is not None else min(2, max(0, self.total_steps - 1))
        )
        self.amp_dtype = amp_dtype(cfg, self.dist.device)
        self.scaler: torch.amp.GradScaler | None = grad_scaler(self.amp_dtype, self.dist.device)  # fp16 only
        self.ctx.loss_scaling = self.scaler is not None and self.scaler.is_enabled()
        self.clock = LastGradClock()
        self.timer = timing.timer()
        self.step = self.start_epoch = self.start_batch = 0
        self.history: list[dict[str, Any]] = []
        self.step_bytes: list[int] = []
        self.step_inter_bytes: list[int] = []  # the inter-node part (accounting's link classes)
        self.step_times: list[float] = []
        self.iface = InterfaceCounter(os.environ.get("LOWCOMM_MEASURE_IFACE"))
        self.step_tx: list[int] = []
        self.log = RunLog.of_rank(cfg.log, cfg.tensorboard, rank=self.dist.rank, all_ranks=cfg.log_all_ranks)
        self.compute = EmulatedCompute(cfg)  # --compute emulated:...: layers wait a profile's times

        # seeded again right before the weights are drawn: whatever ran since the first seeding
        # (a lazy import, a dataset, a method's set-up) cannot shift them, so every run with
        # this seed starts from the same weights, the first in a process or the tenth
        seed_everything(cfg.seed)
        raw = self.build_raw_model()
        self.params_before = sum(p.numel() for p in raw.parameters())
        resume_state = self._load_resume_state()
        if resume_state is not None:
            self.method.load_state_dict(resume_state.get("method", {}))
        self._build(raw, resume_state)

    # --- construction -------------------------------------------------------------------------
    def build_raw_model(self) -> nn.Module:
        """The model before the method wraps it (``ElasticTrainer``: the supernet)."""
        return build_model(self.cfg, self.bundle)

    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one wrapped forward (a subclass training several sub-networks runs
        them in that one forward: every method sees one forward and one backward)."""
        return loss_fn(self.task, self.model(x), y, max_disp=self.max_disp)

    @property
    def max_disp(self) -> float | None:
        """The model's largest disparity (stereo models), else None."""
        return None if (value := getattr(self.raw, "max_disp", None)) is None else float(value)

    def _build(self, raw: nn.Module, resume_state: dict[str, Any] | None = None) -> None:
        """Prepare and wrap the model with the method, build optimizer and scheduler (again
        after a method's re-wrap, continuing the schedule), restore a checkpoint's state."""
        raw = self.compute.apply(self, self.method.prepare(self.compute.restore(raw)).to(self.dist.device))
        if resume_state is not None and "model" in resume_state:
            raw.load_state_dict(resume_state["model"])
        self.raw = raw
        self.model = self.method.wrap(raw, self.ctx)
        self.method.attach_scaler(self.scaler)
        self.clock.attach(raw)
        self.optimizer = build_optimizer(self.cfg, raw)
        self.scheduler = build_scheduler(self.cfg, self.optimizer, self.steps_per_epoch, self.total_steps,
                                         multiplier=self.method.lr_multiplier)
        self.kfac.build(self, resume_state)  # on the (re)wrapped layers; the checkpoint's K-FAC state
        if resume_state is not None:
            self.optimizer.load_state_dict(resume_state["optimizer"])
            self.scheduler.load_state_dict(resume_state["scheduler"])
            if self.scaler is not None and resume_state.get("scaler"):
                # the loss scale and its growth counter: without them a resumed fp16 run
                # restarts at 65536 and skips steps the uninterrupted run did not
                self.scaler.load_state_dict(resume_state["scaler"])
        elif self.step:
            # Rebuilt mid-run (e.g. Pufferfish switch): continue the LR schedule where it was.
            with warnings.catch_warnings():  # replaying steps, not skipping optimizer steps
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(self.step):
                    self.scheduler.step()

    def _load_resume_state(self) -> dict[str, Any] | None:
        """The latest committed checkpoint's state for this rank (``--resume``), or None."""
        cfg = self.cfg
        if not cfg.resume:
            return None
        assert cfg.checkpoint_dir
        manifest = checkpoint.latest(cfg.checkpoint_dir)
        if manifest is None:
            if self.dist.is_main:
                print(f"lowcomm: no checkpoint in {cfg.checkpoint_dir}; starting from scratch", file=sys.stderr)
            return None
        if manifest.get("world_size") != self.dist.world_size:
            raise UsageError(
                f"checkpoint in {cfg.checkpoint_dir} was written by {manifest.get('world_size')} "
                f"workers; resume with --nproc {manifest.get('world_size')}"
            )
        state = checkpoint.load_rank(cfg.checkpoint_dir, manifest["step"], self.dist.rank)
        if self.dist.rank != 0:
            state["model"] = checkpoint.load_rank(cfg.checkpoint_dir, manifest["step"], 0)["model"]
        self.step = int(state["step"])
        self.start_epoch = int(state["epoch"])
        self.start_batch = int(state["batch"])
        self.history = list(state.get("history", []))
        checkpoint.set_rng_state(state["rng"])
        return state

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, epoch: int, batch: int) -> None:
        """Write every rank's state at (``epoch``, ``batch``) and commit it (``--checkpoint-dir``);
        a resume from it continues bit-identically."""
        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return
        self.method.flush()
        payload: dict[str, Any] = {
            "step": self.step,
            "epoch": epoch,
            "batch": batch,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
            "method": self.method.state_dict(),
            "history": self.history,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "kfac": self.kfac.state_dict(),  # collective with DP-KFAC: every rank is here
        }
        if self.dist.is_main:
            payload["model"] = self.raw.state_dict()
        checkpoint.save_rank(cfg.checkpoint_dir, self.step, self.dist.rank, payload)
        if dist.is_initialized():
            dist.barrier()
        if self.dist.is_main:
            checkpoint.commit(
                cfg.checkpoint_dir,
                self.step,
                {"world_size": self.dist.world_size, "epoch": epoch, "batch": batch, "method": cfg.method, "model": cfg.model},
            )
        if dist.is_initialized():
            dist.barrier()

    # --- one step -----------------------------------------------------------------------------
    def _phase_wall(self, name: str, start: float, end: float,
                    hook_phases: tuple[str, ...] = ("compress", "optimizer")) -> None:
        """Credit the wall time from ``start`` to ``end`` to ``name``, less the work hooks
        reported for ``hook_phases`` that ran inside it (:meth:`StepTimer.within`)."""
        inner = self.timer.within(hook_phases, start, end)
        self.timer.add(name, max(0.0, end - start - inner))

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on batch ``(x, y)``, timed by phase; returns the loss."""
        t = self.timer
        with t.phase("data"):
            x = x.to(self.dist.device, non_blocking=True)
            y = y.to(self.dist.device, non_blocking=True)
            if self.bundle.train_transform is not None:
                x = self.bundle.train_transform(x)
            if self.target_is_input:
                y = x
        self.optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with autocast(self.amp_dtype, self.dist.device):
            loss = self.compute_loss(x, y)
        fwd_end = time.perf_counter()
        self._phase_wall("forward", start, fwd_end, ("comm_wait", "compress", "optimizer"))

        self.clock.last = fwd_end
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        bwd_end = time.perf_counter()
        compute_end = min(max(self.clock.last, fwd_end), bwd_end)
        self._phase_wall("backward", fwd_end, compute_end)
        # Waiting after the last gradient was ready is exposed communication; the last
        # buckets' encode and decode in that tail are compression (counted there).
        self._phase_wall("comm_wait", compute_end, bwd_end)
        sync_start = time.perf_counter()
        self.method.finish_sync()  # (the engine decodes here: compression, not waiting)
        self._phase_wall("comm_wait", sync_start, time.perf_counter())

        with t.phase("optimizer"):
            loss_value, skip = self._check_step(loss)
            if self.scaler is not None and not skip:
                self.method.unscale_(self.optimizer)  # inf check recorded, no host sync
            self.kfac.step(t)  # preconditions p.grad; on a skipped step too (consumes its all-reduces)
            if skip:
                warn_nonfinite(f"step {self.step} of {self.cfg.method!r} left the method's state unchanged")
                self.method.skip_step(self.optimizer)
            else:
                if self.cfg.clip_grad:
                    clip = getattr(self.method, "clip_grad_norm_", None)
                    if clip is not None:
                        clip(self.cfg.clip_grad)
                    else:
                        nn.utils.clip_grad_norm_(self.raw.parameters(), self.cfg.clip_grad)
                self.method.optimizer_step(self.optimizer)  # with a scaler: skipped on inf/NaN
                if self.scaler is not None:
                    self.scaler.update()
            # as with GradScaler, a skipped step still advances the LR schedule
            advance(self.scheduler)
        self.step += 1
        return loss_value if loss_value is not None else float(loss.detach())

    def _check_step(self, loss: torch.Tensor) -> tuple[float | None, bool]:
        """(loss value if already read, skip this step?), after backward and finish_sync.

        Without a GradScaler, a method tracking non-finite gradients (hooks and engine poison
        a non-finite payload for every rank) gives a device flag, read with the loss value in
        one transfer: the step's only host sync. With a scaler its own inf check skips.
        """
        if self.scaler is not None:
            return None, False
        flag = self.method.nonfinite_flag()
        if flag is None:
            return None, False
        both = torch.stack([loss.detach().float().reshape(()), flag.to(torch.float32).reshape(())])
        loss_value, nonfinite = both.tolist()
        return float(loss_value), bool(nonfinite)

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Test metrics of the current weights (the method's pending work completed first)."""
        self.method.flush()
        return evaluate(self.raw, self.bundle.test, task=self.task, dist_info=self.dist,
                        batch_size=self.cfg.eval_batch_size, amp=self.amp_dtype,
                        target_is_input=self.target_is_input, max_disp=self.max_disp)

    # --- loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to the end (or ``--stop-after-steps``), evaluating and checkpointing at epoch
        ends; returns the :func:`~lowcomm.runtime.summary.summary`."""
        cfg = self.cfg
        progress = Progress(self.total_steps, self.step, enabled=cfg.progress and self.dist.is_main)
        wall_start = time.perf_counter() - (self.history[-1]["wall_s"] if self.history else 0.0)
        led = accounting.ledger()
        done = self.step >= self.total_steps
        first_step, stopping = self.step, False
        epoch = self.start_epoch
        for epoch in range(self.start_epoch, self.epochs):
            if done:
                break
            first = self.start_batch if epoch == self.start_epoch else 0
            batch_idx = first
            data_start = time.perf_counter()
            for x, y in self.train_batches.epoch(epoch, first):
                self.timer.add("data", time.perf_counter() - data_start)
                bytes_before, inter_before = led.wire_bytes, led.inter_wire_bytes
                tx_before = self.iface.read()
                step_start = time.perf_counter()
                loss = self.train_step(x, y)
                if tx_before is not None:
                    self.step_tx.append(int(self.iface.read() or 0) - tx_before)
                phases = self.timer.end_step()
                step_time = time.perf_counter() - step_start + phases.get("data", 0.0)
                self.step_times.append(step_time)
                self.step_bytes.append(led.wire_bytes - bytes_before)
                self.step_inter_bytes.append(led.inter_wire_bytes - inter_before)
                batch_idx += 1
                progress.update(loss)
                if self.log.active:
                    self.log.write({"event": "step", "step": self.step, "epoch": epoch, "loss": loss,
                               "lr": self.optimizer.param_groups[0]["lr"], "iter_time_s": step_time,
                               "bytes": self.step_bytes[-1], **{f"{k}_s": v for k, v in phases.items()}},
                                   self.step)
                if self.step >= self.total_steps:
                    done = True
                    break
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint(epoch, batch_idx)
                if cfg.stop_after_steps and self.step - first_step >= cfg.stop_after_steps:
                    stopping = True
                    break
                data_start = time.perf_counter()
            end_of_epoch = batch_idx >= self.steps_per_epoch
            if end_of_epoch or done:
                record: dict[str, Any] = {"event": "eval", "epoch": epoch + 1, "step": self.step}
                if cfg.eval:
                    record.update(self.evaluate())
                record["wall_s"] = time.perf_counter() - wall_start
                self.history.append(record)
                self.log.write(record, self.step)
                progress.note(record)
                if self.method.on_epoch_end(epoch + 1) and not done:
                    self.method.flush()
                    self.clock.detach()
                    self._build(unwrap(self.model))
                next_epoch, next_batch = (epoch + 1, 0) if end_of_epoch else (epoch, batch_idx)
                self.save_checkpoint(next_epoch, next_batch)
            elif stopping:
                self.save_checkpoint(epoch, batch_idx)
            if stopping:
                break
        self.method.flush()
        progress.close()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """The run's JSON summary (:func:`lowcomm.runtime.summary.summary`)."""
        return summary(self)

    def close(self) -> None:
        """Close the step log and TensorBoard writer, stop the data workers."""
        self.log.close()
        self.train_batches.close()  # the data workers (persistent) stop here, not at exit


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Worker entry point: train on this rank; rank 0 writes ``cfg.json``."""
    trainer = Trainer(cfg)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    if trainer.dist.is_main and cfg.json:
        checkpoint.atomic_write_json(summary, cfg.json)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary

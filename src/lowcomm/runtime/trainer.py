"""The training loop every method runs in: short enough to read in one sitting.

One worker process per rank. The loop is plain DDP-style data parallelism; a
:class:`~lowcomm.methods.Method` decides how the model is wrapped and how gradients travel.
Everything measured here (phase times, bytes) is measured the same way for every method.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import data as data_registry
from lowcomm import methods as method_registry
from lowcomm import models as model_registry
from lowcomm.comm import accounting
from lowcomm.compress.feedback import warn_nonfinite
from lowcomm.errors import UsageError
from lowcomm.methods.base import Method, MethodContext
from lowcomm.runtime import checkpoint, timing
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.optim import apply_method_overrides, build_optimizer, build_scheduler


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


#: Process-group backend with CUDA: NCCL carries CUDA tensors, gloo the few CPU ones. A bare
#: ``"nccl"`` registers no CPU backend, so any CPU collective (a stray control tensor, a
#: library's object broadcast) would fail with "No backend type associated with device type cpu".
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def dist_backend(use_cuda: bool) -> str:
    """The backend string for ``init_process_group``.

    ``LOWCOMM_DIST_BACKEND`` overrides it (e.g. ``gloo``: several ranks sharing one GPU, which
    NCCL refuses, for tests on a single-GPU machine); otherwise :data:`CUDA_BACKEND` with CUDA
    and ``gloo`` without.
    """
    forced = os.environ.get("LOWCOMM_DIST_BACKEND", "").strip()
    if forced:
        return forced
    return CUDA_BACKEND if use_cuda else "gloo"


def _cuda_device(local: int, backend: str) -> torch.device:
    """``cuda:LOCAL_RANK``; ranks share GPUs round-robin only where CUDA tensors go over gloo."""
    n = torch.cuda.device_count()
    if local < n:
        return torch.device("cuda", local)
    config = dist.get_backend_config() if dist.is_initialized() else backend
    try:
        cuda_backend = accounting.parse_backend_config(config).get("cuda")
    except ValueError as e:
        raise UsageError(f"LOWCOMM_DIST_BACKEND: {e}") from None
    if cuda_backend == "nccl":
        raise UsageError(
            f"LOCAL_RANK {local} but only {n} CUDA device(s) visible: NCCL needs one GPU per rank; "
            f"start at most {n} workers per node (or set LOWCOMM_DIST_BACKEND=gloo to share GPUs, "
            "e.g. for tests)"
        )
    return torch.device("cuda", local % n)


def init_distributed(cfg: TrainConfig) -> Dist:
    """Join the process group described by torchrun's environment variables (if any)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    backend = dist_backend(use_cuda)
    device = _cuda_device(local, backend) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=float(os.environ.get("LOWCOMM_DIST_TIMEOUT_S", 300))),
        )
    return Dist(rank, world, local, device)


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``--amp``: plain ``--amp`` (``auto``) is bf16 on CPU and fp16 on
    CUDA (as it always was); ``fp16`` / ``bf16`` choose explicitly. None: no AMP."""
    mode = cfg.amp_mode()
    if mode is None:
        return None
    if mode == "auto":
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.float16 if mode == "fp16" else torch.bfloat16


def _open_log(path: str) -> Any:
    """Open the JSONL step log for appending, first dropping a torn last line.

    A run killed while writing a record leaves half a line; a resumed run appending after it
    would glue its first record onto that fragment and make the file unreadable as JSONL.
    """
    try:
        with open(path, "rb+") as f:
            end = f.seek(0, os.SEEK_END)
            pos = end
            while pos > 0:  # read back from the end only as far as the last newline
                step = min(pos, 1 << 16)
                f.seek(pos - step)
                chunk = f.read(step)
                if pos == end and chunk.endswith(b"\n"):
                    break  # the last line is whole
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    f.truncate(pos - step + cut + 1)
                    break
                pos -= step
            else:
                f.truncate(0)  # no newline at all: one torn line
    except FileNotFoundError:
        pass
    return open(path, "a")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _accepted_kwargs(factory: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def build_model(cfg: TrainConfig, bundle: Any) -> nn.Module:
    """Create the model sized to the data (classes / vocabulary / input width)."""
    factory = model_registry.MODELS.get(cfg.model)
    implied: dict[str, Any] = {}
    if bundle.task == "classification" and bundle.num_classes:
        implied["num_classes"] = bundle.num_classes
    if bundle.vocab_size:
        implied["vocab_size"] = bundle.vocab_size
    if bundle.input_shape:
        implied["input_dim"] = bundle.input_shape[0] if len(bundle.input_shape) == 1 else None
        implied = {k: v for k, v in implied.items() if v is not None}
    kwargs = {**_accepted_kwargs(factory, implied), **cfg.model_args}
    try:
        return model_registry.create(cfg.model, **kwargs)
    except TypeError as e:
        raise UsageError(f"model {cfg.model!r} does not accept these arguments: {e}") from None


def _task_of(model_name: str, bundle: Any) -> str:
    info = getattr(model_registry, "info", None)
    model_task = info(model_name).task if info else bundle.task
    if model_task != bundle.task:
        raise UsageError(
            f"model {model_name!r} is a {model_task} model but data {bundle.name!r} is "
            f"{bundle.task} data"
        )
    return str(bundle.task)


def loss_fn(task: str, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task == "language_model":
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return nn.functional.cross_entropy(logits, y)


class Batches:
    """Deterministic per-rank batches for an epoch, resumable at any batch index.

    Same permutation as ``DistributedSampler(shuffle=True, seed, drop_last=False)`` after
    ``set_epoch(epoch)``: every rank gets the same number of batches, so collectives match.
    """

    def __init__(self, dataset: Any, batch_size: int, rank: int, world: int, seed: int, shuffle: bool = True) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
        )
        self.tensors = getattr(dataset, "tensors", None)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)
        for b in range(start_batch, len(self)):
            idx = indices[b * self.batch_size : (b + 1) * self.batch_size]
            yield self._fetch(idx)

    def _fetch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tensors is not None:
            t = torch.as_tensor(idx)
            return self.tensors[0][t], self.tensors[1][t]
        items = [self.dataset[i] for i in idx]
        xs, ys = zip(*items)
        return torch.stack([torch.as_tensor(x) for x in xs]), torch.stack([torch.as_tensor(y) for y in ys])


def unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


class LastGradClock:
    """Time at which the last gradient of backward was accumulated (compute end)."""

    def __init__(self) -> None:
        self.last = 0.0
        self._handles: list[Any] = []

    def attach(self, model: nn.Module) -> None:
        self.detach()
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._tick))

    def _tick(self, _: torch.Tensor) -> None:
        self.last = time.perf_counter()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class InterfaceCounter:
    """Bytes this host really transmitted on one network interface (Linux sysfs).

    Set ``LOWCOMM_MEASURE_IFACE`` (the benchmark sets it to each worker's emulated link) to
    record, next to the bytes counted by the accounting layer, what actually left the
    worker, TCP/IP headers and any collective-algorithm overhead included.
    """

    def __init__(self, iface: str | None) -> None:
        self.path = f"/sys/class/net/{iface}/statistics/tx_bytes" if iface else None
        if self.path and not os.path.exists(self.path):
            self.path = None

    def read(self) -> int | None:
        if self.path is None:
            return None
        with open(self.path) as f:
            return int(f.read())


class Trainer:
    """Builds everything from a :class:`TrainConfig` and runs the loop on this rank."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.dist = init_distributed(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        self.bundle = data_registry.create(cfg.data, data_dir=cfg.data_dir, seed=cfg.seed, **cfg.data_args)
        self.task = _task_of(cfg.model, self.bundle)
        # Encoder-decoder models trained as a copy task predict their own input.
        self.target_is_input = getattr(model_registry.info(cfg.model), "lm_target", "next") == "input"
        self.method: Method = method_registry.create(cfg.method)
        for line in apply_method_overrides(cfg, self.method):  # e.g. signum: no SGD momentum
            if self.dist.is_main:
                print(f"lowcomm: {line}", file=sys.stderr, flush=True)
        if self.method.timing_only and cfg.eval:
            raise UsageError(f"method {cfg.method!r} is for timing only; use it with --no-eval")
        self.ctx = MethodContext(
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            local_rank=self.dist.local_rank,
            device=self.dist.device,
            seed=cfg.seed,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        self.train_batches = Batches(self.bundle.train, cfg.batch_size, self.dist.rank, self.dist.world_size, cfg.seed)
        self.steps_per_epoch = len(self.train_batches)
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.warmup_steps = (
            cfg.warmup_steps if cfg.warmup_steps is not None else min(2, max(0, self.total_steps - 1))
        )
        # fp16 autocast needs a GradScaler (fp16 gradients underflow); bf16 does not. Every
        # method takes it through Method.attach_scaler (after each wrap, see _build): comm
        # hooks keep their state in unscaled units, the scheduling engine runs the scaler's
        # unscale/skip on its gradient shards.
        self.amp_dtype = amp_dtype(cfg, self.dist.device)
        self.scaler: Any = None
        if self.amp_dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(self.dist.device.type)
        self.clock = LastGradClock()
        self.timer = timing.timer()
        self.step = 0
        self.start_epoch = 0
        self.start_batch = 0
        self.history: list[dict[str, Any]] = []
        self.step_bytes: list[int] = []
        self.step_times: list[float] = []
        self.iface = InterfaceCounter(os.environ.get("LOWCOMM_MEASURE_IFACE"))
        self.step_tx: list[int] = []
        self.log_file = _open_log(cfg.log) if cfg.log and self.dist.is_main else None
        self.tb: Any = None
        if cfg.tensorboard and self.dist.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(cfg.tensorboard)

        raw = build_model(cfg, self.bundle)
        self.params_before = sum(p.numel() for p in raw.parameters())
        resume_state = self._load_resume_state()
        if resume_state is not None:
            self.method.load_state_dict(resume_state.get("method", {}))
        self._build(raw, resume_state)

    # --- construction -------------------------------------------------------------------------
    def _build(self, raw: nn.Module, resume_state: dict[str, Any] | None = None) -> None:
        raw = self.method.prepare(raw).to(self.dist.device)
        if resume_state is not None and "model" in resume_state:
            raw.load_state_dict(resume_state["model"])
        self.raw = raw
        self.model = self.method.wrap(raw, self.ctx)
        self.method.attach_scaler(self.scaler)
        self.clock.attach(raw)
        self.optimizer = build_optimizer(self.cfg, raw)
        self.scheduler = build_scheduler(self.cfg, self.optimizer, self.steps_per_epoch, self.total_steps)
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
    def _autocast(self) -> Any:
        if self.amp_dtype is None:
            return torch.autocast(self.dist.device.type, enabled=False)
        return torch.autocast(self.dist.device.type, dtype=self.amp_dtype)

    def _phase_wall(self, name: str, start: float, end: float, hook_phases: dict[str, float]) -> None:
        """Credit wall time to ``name`` minus what hooks reported for other phases meanwhile."""
        inner = sum(self.timer.get(p) - v for p, v in hook_phases.items())
        self.timer.add(name, max(0.0, end - start - inner))

    def _snapshot(self) -> dict[str, float]:
        return {p: self.timer.get(p) for p in ("comm_wait", "compress")}

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t = self.timer
        with t.phase("data"):
            x = x.to(self.dist.device, non_blocking=True)
            y = y.to(self.dist.device, non_blocking=True)
            if self.bundle.train_transform is not None:
                x = self.bundle.train_transform(x)
            if self.target_is_input:
                y = x
        self.optimizer.zero_grad(set_to_none=True)
        snap = self._snapshot()
        start = time.perf_counter()
        with self._autocast():
            out = self.model(x)
            loss = loss_fn(self.task, out, y)
        fwd_end = time.perf_counter()
        self._phase_wall("forward", start, fwd_end, snap)

        snap = self._snapshot()
        self.clock.last = fwd_end
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        bwd_end = time.perf_counter()
        compute_end = min(max(self.clock.last, fwd_end), bwd_end)
        # Waiting after the last gradient was ready is exposed communication.
        t.add("comm_wait", bwd_end - compute_end)
        self._phase_wall("backward", fwd_end, compute_end, {"compress": snap["compress"]})
        with t.phase("comm_wait"):
            self.method.finish_sync()

        with t.phase("optimizer"):
            loss_value, skip = self._check_step(loss)
            if skip:
                warn_nonfinite(f"step {self.step} of {self.cfg.method!r} left the method's state unchanged")
                self.method.skip_step(self.optimizer)
            else:
                if self.scaler is not None:
                    self.method.unscale_(self.optimizer)  # inf check recorded, no host sync
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
            self.scheduler.step()
        self.step += 1
        return loss_value if loss_value is not None else float(loss.detach())

    def _check_step(self, loss: torch.Tensor) -> tuple[float | None, bool]:
        """(loss value if already read, skip this step?), after backward and finish_sync.

        Without a GradScaler, a method that tracks non-finite gradients (the compression
        hooks and the engine poison a non-finite payload so that every rank sees it) gives a
        device flag; it is read here together with the loss value, in one transfer: the only
        host sync of the step, and none inside backward. With a scaler nothing is read here:
        the poisoned gradient reaches the scaler's own inf check, which skips the step.
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
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.method.flush()
        model = self.raw
        was_training = model.training
        model.eval()
        n = len(self.bundle.test)
        idx = list(range(self.dist.rank, n, self.dist.world_size))
        # Statistics stay on the training device: no host sync per batch, and the all-reduce
        # below runs on the backend that carries the model's tensors (NCCL has no CPU one).
        dev = self.dist.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        correct = torch.zeros((), dtype=torch.float64, device=dev)
        count = torch.zeros((), dtype=torch.float64, device=dev)
        fetch = Batches(self.bundle.test, self.cfg.eval_batch_size, 0, 1, 0, shuffle=False)._fetch
        for b in range(0, len(idx), self.cfg.eval_batch_size):
            x, y = fetch(idx[b : b + self.cfg.eval_batch_size])
            x, y = x.to(self.dist.device), y.to(self.dist.device)
            if self.target_is_input:
                y = x
            with self._autocast():
                out = model(x)
            out = out.float()
            loss_sum += loss_fn(self.task, out, y).double() * y.numel()
            count += y.numel()
            if self.task == "classification":
                correct += (out.argmax(-1) == y).sum().double()
        stats = torch.stack([loss_sum, correct, count])
        if dist.is_initialized():
            accounting.all_reduce(stats, tag="eval")
        stats = stats.cpu()  # the one host sync of the evaluation
        model.train(was_training)
        loss = float(stats[0] / stats[2].clamp(min=1))
        result = {"test_loss": loss}
        if self.task == "classification":
            result["test_accuracy"] = float(stats[1] / stats[2].clamp(min=1))
        else:
            result["test_perplexity"] = float(math.exp(min(loss, 50.0)))
        return result

    # --- loop ---------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if self.log_file:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(k, v, record.get("step", self.step))

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        progress = _Progress(self.total_steps, self.step, enabled=cfg.progress and self.dist.is_main)
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
                bytes_before = led.wire_bytes
                tx_before = self.iface.read()
                step_start = time.perf_counter()
                loss = self.train_step(x, y)
                if tx_before is not None:
                    self.step_tx.append(int(self.iface.read() or 0) - tx_before)
                phases = self.timer.end_step()
                step_time = time.perf_counter() - step_start + phases.get("data", 0.0)
                self.step_times.append(step_time)
                self.step_bytes.append(led.wire_bytes - bytes_before)
                batch_idx += 1
                progress.update(loss)
                if self.dist.is_main and (self.log_file or self.tb):
                    self._log({"event": "step", "step": self.step, "epoch": epoch, "loss": loss,
                               "lr": self.optimizer.param_groups[0]["lr"], "iter_time_s": step_time,
                               "bytes": self.step_bytes[-1], **{f"{k}_s": v for k, v in phases.items()}})
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
                self._log(record)
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
        skip = min(self.warmup_steps, max(0, len(self.step_times) - 1))
        times = self.step_times[skip:]
        bytes_iter = self.step_bytes[skip:]
        led = accounting.ledger()
        iter_median = float(np.median(times)) if times else 0.0
        last = self.history[-1] if self.history else {}
        result: dict[str, Any] = {
            "method": self.cfg.method,
            "world_size": self.dist.world_size,
            "model": self.cfg.model,
            "data": self.cfg.data,
            "synthetic": bool(self.bundle.synthetic),
            "epochs": self.epochs,
            "steps": self.step,
            "batch_size": self.cfg.batch_size,
            # effective settings, after any method override (e.g. signum turns momentum off)
            "optimizer": {"name": self.cfg.optimizer, "lr": self.cfg.lr,
                          "momentum": self.cfg.momentum, "weight_decay": self.cfg.weight_decay},
            "amp": self.cfg.amp,
            "params": sum(p.numel() for p in self.raw.parameters()),
            "params_initial": self.params_before,
            "bytes_sent_per_worker": led.wire_bytes,
            "bytes_per_worker_per_iter": float(np.median(bytes_iter)) if bytes_iter else 0.0,
            "iter_time_s_median": iter_median,
            "measured_tx_bytes_per_iter": float(np.median(self.step_tx[skip:])) if self.step_tx[skip:] else None,
            "samples_per_s": self.cfg.batch_size * self.dist.world_size / iter_median if iter_median else 0.0,
            "breakdown_s": self.timer.medians(skip),
            "timed_steps": len(times),
            "threads": torch.get_num_threads(),
            "device": str(self.dist.device),
            "method_info": self.method.describe(),
            "traffic": led.as_dict(),
            "history": self.history,
        }
        if self.task == "classification":
            result["final_test_accuracy"] = last.get("test_accuracy")
        else:
            result["final_test_metric"] = last.get("test_perplexity")
            result["metric_name"] = "perplexity"
        if self.bundle.synthetic:
            result["note"] = "synthetic data: timing only"
        return result

    def close(self) -> None:
        if self.log_file:
            self.log_file.close()
        if self.tb is not None:
            self.tb.close()


class _Progress:
    """A rich progress bar on rank 0 when attached to a terminal; silent otherwise."""

    def __init__(self, total: int, done: int, *, enabled: bool) -> None:
        self.bar: Any = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=done, info="")

    def update(self, loss: float) -> None:
        if self.bar:
            self.bar.update(self.task, advance=1, info=f"loss {loss:.3f}")

    def note(self, record: dict[str, Any]) -> None:
        if self.bar:
            parts = [f"{k} {v:.4f}" for k, v in record.items() if k.startswith("test_")]
            self.bar.console.print(f"epoch {record['epoch']}: " + ", ".join(parts))

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


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

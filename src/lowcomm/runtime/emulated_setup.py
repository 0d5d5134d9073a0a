"""The trainer's side of ``--compute``: which profile a run emulates, and installing it.

Why apart from :mod:`lowcomm.runtime.emulated`: that module knows models and profiles; this
one knows runs. It picks the profile (a file, a shipped name, or this machine's own profile
of the model as trained, divided by K), refuses what cannot be emulated, and reports the
label every summary and bench row carries.

``emulated:scale=K`` measures the model the method trains (after ``Method.prepare``: the
factorized model for Pufferfish) once, in one process (rank 0; the other ranks wait and
receive it), with the run's batch, input, threads and AMP, and caches it under
``$LOWCOMM_CACHE_DIR/profiles`` (default ``~/.cache/lowcomm/profiles``), keyed by everything
that changes the times: model, model arguments, data, batch, layer shapes, threads, AMP,
device, torch version and CPU. The real data loader still feeds the run (only the batch's
shape is used by the emulated layers); its reading time is real.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.runtime.compute_spec import ComputeSpec, parse_compute
from lowcomm.runtime.emulated import _hookless_twin, emulate, emulation_of, restore, scaled
from lowcomm.runtime.host import cpu_name
from lowcomm.sim.profile import Profile

if TYPE_CHECKING:
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.trainer import Trainer


def compute_of(cfg: TrainConfig) -> ComputeSpec:
    """The run's ``--compute`` (``real`` for a config made before the flag existed)."""
    return parse_compute(cfg.compute or "real")


def check_config(cfg: TrainConfig) -> None:
    """Refuse, before any worker starts, what emulated compute cannot run: evaluation (the
    emulated model computes nothing, its accuracy would be meaningless), K-FAC (it reads the
    layers' real activations), a method that says it cannot be emulated
    (``Method.emulated_compute_refusal``: FSDP), a profile file that is no profile."""
    spec = compute_of(cfg)
    if not spec.emulated:
        return
    if cfg.eval:
        raise UsageError(f"--compute {spec.text} times iterations only (the layers compute nothing); "
                         "add --no-eval")
    if cfg.kfac is not None:
        raise UsageError(f"--compute {spec.text} cannot run K-FAC (it needs the layers' real activations); "
                         "use --compute real")
    from lowcomm.methods import method_class, split_spec

    name = split_spec(cfg.method)[0]
    refusal = method_class(name).emulated_compute_refusal
    if refusal:
        raise UsageError(f"--compute {spec.text} cannot run {name} ({refusal}); use --compute real")
    if spec.path is not None:
        _check_batch(Profile.load(spec.path), cfg.batch_size, spec)


def _check_batch(profile: Profile, batch_size: int, spec: ComputeSpec) -> None:
    if profile.batch_size != batch_size:
        raise UsageError(f"--compute {spec.text}: the profile was measured at batch {profile.batch_size} per "
                         f"worker but this run has --batch-size {batch_size} (times do not scale linearly "
                         f"with the batch); use --batch-size {profile.batch_size} or a profile at {batch_size}")


class EmulatedCompute:
    """Installs (and removes) the emulation on the trainer's model; real compute: a no-op."""

    def __init__(self, cfg: TrainConfig) -> None:
        check_config(cfg)  # also for runs started from Python or by torchrun
        self.spec = compute_of(cfg)
        self.profile: Profile | None = None  # the profile in use (after matching and scaling)
        self.source: str | None = None  # the file it came from (for scale=K: the cached profile)

    def restore(self, model: nn.Module) -> nn.Module:
        """``model`` with real forwards (before a method prepares it again)."""
        return restore(model)

    def apply(self, trainer: Trainer, model: nn.Module) -> nn.Module:
        """``model`` (prepared by the method, on the device) with its layers emulated."""
        if not self.spec.emulated:
            return model
        cfg = trainer.cfg
        x, _ = _batch(trainer, 1)
        if self.spec.kind == "scale":
            assert self.spec.scale is not None
            profile = scaled(self._own_profile(trainer, model, x), self.spec.scale)
        else:
            assert self.spec.path is not None
            profile, self.source = Profile.load(self.spec.path), self.spec.path
        _check_batch(profile, cfg.batch_size, self.spec)
        emulate(model, profile, x, rank=trainer.dist.rank, seed=cfg.seed, where=self.source or "profile")
        emu = emulation_of(model)
        self.profile = emu.profile if emu is not None else None
        return model

    def summary(self) -> dict[str, Any]:
        """``compute`` (the label) and, when emulated, what the profile was."""
        out: dict[str, Any] = {"compute": self.spec.label}
        if self.profile is not None:
            p = self.profile
            out["compute_profile"] = {"source": self.source, "model": p.model, "device": p.device,
                                      "batch_size": p.batch_size, "scale": self.spec.scale,
                                      "forward_s": p.forward_s, "backward_s": p.backward_s, "layers": len(p.layers)}
        return out

    # --- emulated:scale=K: this machine's own profile ------------------------------------
    def _own_profile(self, trainer: Trainer, model: nn.Module, example: torch.Tensor) -> Profile:
        """This machine's profile of ``model`` (cached); rank 0 measures, the others receive it."""
        path = cache_path(trainer, model, example)
        self.source = str(path)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return _load_or_measure(path, trainer, model)
        doc: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                doc[0] = _load_or_measure(path, trainer, model).to_dict()
            except UsageError as e:
                doc[0] = {"error": str(e)}
        dist.broadcast_object_list(doc, src=0)
        if "error" in doc[0]:
            raise UsageError(doc[0]["error"])
        return Profile.from_dict(doc[0], where=str(path))


def cache_path(trainer: Trainer, model: nn.Module, example: torch.Tensor) -> Path:
    """Where this machine's profile of ``model`` in ``trainer``'s run is cached."""
    from lowcomm.data.cache import cache_dir
    from lowcomm.sim.profiler import parameter_layers

    cfg = trainer.cfg
    key = {"model": cfg.model, "model_args": cfg.model_args, "data": cfg.data, "data_args": cfg.data_args,
           "batch_size": cfg.batch_size, "input": list(example.shape[1:]), "dtype": str(example.dtype),
           "layers": [[n, [list(p.shape) for p in ps]] for n, _, ps in parameter_layers(model)],
           "threads": torch.get_num_threads(), "amp": str(trainer.amp_dtype), "device": str(trainer.dist.device),
           "torch": torch.__version__, "cpu": cpu_name()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir(None) / "profiles" / f"{cfg.model}-b{cfg.batch_size}-{digest}.json"


def _load_or_measure(path: Path, trainer: Trainer, model: nn.Module) -> Profile:
    if path.is_file():
        try:
            return Profile.load(path)
        except UsageError:
            pass  # a damaged cache entry is measured again
    profile = measure(trainer, model)
    from lowcomm.runtime.checkpoint import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(profile.to_dict(), str(path))
    return profile


def measure(trainer: Trainer, model: nn.Module, *, warmup: int = 2, iters: int = 5) -> Profile:
    """Profile a hookless copy of ``model`` on one real batch of the run, with its AMP, leaving
    the model, its buffers and every random number generator as they were."""
    from lowcomm.runtime.precision import autocast
    from lowcomm.runtime.workload import loss_fn
    from lowcomm.sim.profiler import profile_model

    x, y = _batch(trainer, trainer.cfg.batch_size)
    twin = _hookless_twin(model)

    def loss(out: Any, target: Any) -> torch.Tensor:
        return loss_fn(trainer.task, out, target, max_disp=getattr(model, "max_disp", None))

    devices = [trainer.dist.device] if trainer.dist.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), autocast(trainer.amp_dtype, trainer.dist.device):
        prof = profile_model(twin, lambda: (x, y), loss, model_name=trainer.cfg.model,
                             batch_size=trainer.cfg.batch_size, device=trainer.dist.device,
                             warmup=warmup, iters=iters, measure_kernels=False)
    prof.notes = f"measured by --compute emulated:scale with {torch.get_num_threads()} threads"
    return prof


def _batch(trainer: Trainer, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``size`` samples of this rank's first batch, as the training step sees them."""
    batches = trainer.train_batches
    x, y = batches.fetch(batches.plan(0)[0][:size])
    x, y = x.to(trainer.dist.device), y.to(trainer.dist.device)
    if trainer.bundle.train_transform is not None:
        x = trainer.bundle.train_transform(x)
    return x, (x if trainer.target_is_input else y)

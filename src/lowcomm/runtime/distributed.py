"""Joining the process group: ranks, devices and the backend string, from torchrun's variables.

Why apart from the loop: how a worker finds its peers and its GPU (one per rank with NCCL, or
shared over gloo for tests) is decided once per process and has nothing to do with training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.runtime.config import TrainConfig


@dataclass
class Dist:
    """This worker's place in the job: rank, world size, local rank, device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, summaries and checkpoint manifests (one writer per job)."""
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


@dataclass
class Joined:
    """What :func:`join_world` found and did: this process's ranks, its device, and whether it
    created the process group (and so must destroy it)."""

    rank: int
    world: int
    local: int
    device: torch.device
    owns_group: bool


def join_world(device: str = "auto") -> Joined:
    """Join the process group torchrun's variables describe: the one way ``train``, ``fl`` and
    ``split`` workers find their peers and their device (``device``: auto, cpu or cuda; gloo on
    CPU, :data:`CUDA_BACKEND` with CUDA). A group that already exists (tests) is kept."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    backend = dist_backend(use_cuda)
    dev = _cuda_device(local, backend) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    owns = world > 1 and not dist.is_initialized()
    if owns:
        from datetime import timedelta

        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=float(os.environ.get("LOWCOMM_DIST_TIMEOUT_S", 300))),
        )
    if owns and not use_cuda and local == 0:
        _notice_shared_cores()
    return Joined(rank, world, local, dev, owns)


def _notice_shared_cores() -> None:
    """Print :func:`lowcomm.runtime.cpu_sessions.autogroup_notice` when it applies."""
    import sys

    from lowcomm.runtime.cpu_sessions import autogroup_notice, usable_cpus

    text = autogroup_notice(os.environ, threads=torch.get_num_threads(), cpus=usable_cpus())
    if text:
        print(text, file=sys.stderr, flush=True)


def init_distributed(cfg: TrainConfig) -> Dist:
    """Join the process group described by torchrun's variables (if any), for ``train``."""
    joined = join_world(cfg.device)
    return Dist(joined.rank, joined.world, joined.local, joined.device)

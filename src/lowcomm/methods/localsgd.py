"""Semi-synchronous training: ``localsgd`` and ``diloco`` (and the base of ``streaming_diloco``).

No gradient is communicated during the inner steps: each rank runs the trainer's optimizer
on its own batches (the *inner* optimizer, SGD or AdamW, whatever ``--optimizer`` says), and
every ``sync_every`` (H) steps the ranks synchronize:

* ``localsgd:sync_every=H`` (Stich, "Local SGD converges fast and communicates little",
  ICLR'19; Hugging Face Accelerate's LocalSGD): the parameters are averaged (one all-reduce).
* ``diloco:sync_every=H,outer_lr=0.7,outer_momentum=0.9,nesterov=true,compress=none,global_on=device``
  (Douillard et al., "DiLoCo", 2023; torchft's DiLoCo): the pseudo-gradient
  ``delta = theta_global - theta_local`` is averaged over ranks, optionally through any payload
  compressor (``compress=fp16``, ``compress=(topk:density=0.01)``: the codec's error feedback,
  where it has one, carries across syncs), the *outer* optimizer (SGD with Nesterov momentum)
  steps the global copy with it, and ``theta_local <- theta_global``. The global copy and the
  outer momentum live on the training device or, with ``global_on=cpu``, in host memory (the
  pseudo-gradient is still formed and averaged on the device).

Floating-point buffers (BatchNorm running statistics) are averaged at every sync. The initial
weights are broadcast from rank 0 once (counted under ``<method>.init``). Between syncs the
ranks' weights differ: an evaluation there evaluates each rank's replica on its shard of the
test set (choose H dividing the steps per epoch to evaluate synchronized weights).

``inner=SPEC`` (any synchronous method, ``none`` by default: every rank is its own replica)
makes the replicas the nodes of the topology: SPEC runs the inner steps synchronously inside
each node and only the nodes' leaders cross the inter-node link at a sync
(:mod:`lowcomm.methods.replicas_inner`).

Exact resume: the inner step within the period, this rank's own weights and buffers, the
global copies, the outer optimizer's momentum, the codecs' state (error feedback) and any
sync already received but not yet merged are in the checkpoint (:meth:`OuterMethod.state_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods import register
from lowcomm.methods.base import Method, MethodContext
from lowcomm.methods.outer_sync import OuterSync, parse_compress, split_fragments
from lowcomm.methods.replicas_inner import (
    inner_context,
    inner_spec,
    make_inner,
    replica_groups,
)

if TYPE_CHECKING:
    from lowcomm.methods.base import OptimizerOverride
    from lowcomm.runtime.config import TrainConfig


def _check_sync_every(value: int, method: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(
            f"option sync_every={value!r} of method {method!r} must be an integer >= 1 "
            "(inner steps between syncs)"
        )


@dataclass
class LocalSGDOptions:
    """``sync_every``: inner steps between two parameter averagings (H)."""

    sync_every: int = 20
    #: ``none`` (every rank a replica) or a synchronous method run inside each node
    inner: str = "none"

    def __post_init__(self) -> None:
        _check_sync_every(self.sync_every, "localsgd")
        inner_spec(self.inner, "localsgd")


@dataclass
class DiLoCoOptions:
    """DiLoCo's outer loop: H inner steps, then an outer SGD step on the averaged pseudo-gradient."""

    sync_every: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    #: ``none`` or a payload compressor's spec (``fp16``, ``(topk:density=0.01)``)
    compress: str = "none"
    #: where the global copy and the outer momentum live: ``device`` or ``cpu``
    global_on: str = "device"
    #: ``none`` (every rank a replica) or a synchronous method run inside each node
    inner: str = "none"

    def __post_init__(self) -> None:
        method = type(self).method_name
        _check_sync_every(self.sync_every, method)
        if not self.outer_lr > 0:
            raise UsageError(f"option outer_lr={self.outer_lr} of method {method!r} must be > 0")
        if not 0 <= self.outer_momentum < 1:
            raise UsageError(
                f"option outer_momentum={self.outer_momentum} of method {method!r} must be in [0, 1)"
            )
        if self.global_on not in ("cpu", "device"):
            raise UsageError(
                f"option global_on={self.global_on!r} of method {method!r} must be cpu or device"
            )
        parse_compress(self.compress, method)  # refuses a non-codec (e.g. a model-axis method) now
        inner_spec(self.inner, method)

    method_name: ClassVar[str] = "diloco"


class OuterMethod(Method):
    """No gradient communication; every ``sync_every`` inner steps an :class:`OuterSync`."""

    #: ``average`` (parameters averaged) or ``outer`` (pseudo-gradient + outer optimizer)
    mode: ClassVar[str] = "outer"
    #: refused as ``inner=`` of another semi-synchronous method
    semi_synchronous: ClassVar[bool] = True

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        #: the synchronous method of each node's inner steps (``inner=``), or None
        self.inner: Method | None = make_inner(self.options.inner, self.name)
        self.model: nn.Module | None = None
        self.nodes: tuple[int, int] | None = None  # (nodes, GPUs per node) with inner=
        #: inner optimizer steps taken so far (the position within the period is step % H)
        self.step = 0
        self.sync: OuterSync | None = None
        self._loaded: dict[str, Any] | None = None

    # --- what the subclasses choose ----------------------------------------------------------
    def fragment_count(self) -> int:
        """Fragments of the model synced separately (1: the whole model at once)."""
        return 1

    def delay(self) -> int:
        """Inner steps between starting a fragment's sync and merging it (0: blocking)."""
        return 0

    def sync_kwargs(self) -> dict[str, Any]:
        """The outer optimizer's settings for :class:`OuterSync`."""
        o = self.options
        return {
            "global_on": o.global_on,
            "outer_lr": o.outer_lr,
            "outer_momentum": o.outer_momentum,
            "nesterov": o.nesterov,
            "compress": parse_compress(o.compress, self.name),
        }

    # --- life cycle --------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        """The inner method's (a synchronous method leaves the model as it is)."""
        return self.inner.prepare(model) if self.inner is not None else model

    def wrap(self, model: nn.Module, ctx: MethodContext) -> nn.Module:
        """Without ``inner=``: no DDP (nothing is sent during backward), the model itself, with
        the sync state. With it: the inner method wrapped on the node's intra group, and the
        outer sync among the nodes' leaders."""
        self.ctx = ctx
        self.model = self.ddp = model
        h, frags = self.options.sync_every, self.fragment_count()
        fragments = split_fragments(model, frags)
        place: dict[str, Any] = {"group": ctx.process_group}
        if self.inner is not None:
            topo, groups = replica_groups(ctx, self.name)
            self.nodes = (topo.nodes, topo.local_size)
            leader = topo.intra_ranks()[0]
            place = {
                "group": groups.inter,
                "node_group": groups.intra,
                "leader_rank": leader,
                "buffer_group": None,
            }
        if self._loaded is None:
            self._broadcast_initial(model, ctx.process_group)
        if self.inner is not None:
            inner_state = (self._loaded or {}).get("inner")
            if inner_state:
                self.inner.load_state_dict(inner_state)
            self.inner.attach_scaler(self.scaler)
            self.ddp = self.inner.wrap(model, inner_context(ctx, topo, groups))
        syncs = math.ceil(ctx.total_steps / h) if ctx.total_steps else None
        kwargs = self.sync_kwargs() if self.mode == "outer" else {}
        self.sync = OuterSync(
            model,
            fragments,
            [f * h // frags for f in range(frags)],
            name=self.name,
            mode=self.mode,
            device=ctx.device,
            syncs=syncs,
            **place,
            **kwargs,
        )
        if self._loaded is not None:
            state, self._loaded = self._loaded, None
            self.step = int(state["step"])
            model.load_state_dict({k: v.to(ctx.device) for k, v in state["local"].items()})
            self.sync.load_state_dict(state["sync"])
        return self.ddp

    def _broadcast_initial(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        """Rank 0's weights and floating buffers to every rank (DDP does the same at wrap)."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for tensors in (
            [p for p in model.parameters()],
            [b for b in model.buffers() if b.is_floating_point()],
        ):
            if not tensors:
                continue
            with torch.no_grad():
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                accounting.broadcast(flat, src, group=group, tag=f"{self.name}.init")
                start = 0
                for t in tensors:
                    t.copy_(flat[start : start + t.numel()].view_as(t))
                    start += t.numel()

    # --- the trainer's hooks: the inner method first, then the outer logic ---------------------
    def finish_sync(self) -> None:
        """The inner method's gradient sync (nothing without ``inner=``)."""
        if self.inner is not None:
            self.inner.finish_sync()

    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Kept, and handed to the inner method (it holds the synchronized gradient)."""
        super().attach_scaler(scaler)
        if self.inner is not None:
            self.inner.attach_scaler(scaler)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner method's (it knows where its synchronized gradient is)."""
        if self.inner is not None:
            self.inner.unscale_(optimizer)
        else:
            super().unscale_(optimizer)

    def nonfinite_flag(self) -> torch.Tensor | None:
        """The inner method's flag (None without ``inner=``)."""
        return self.inner.nonfinite_flag() if self.inner is not None else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip as the inner method does (an engine holds gradient shards), else on the model."""
        clip = getattr(self.inner, "clip_grad_norm_", None)
        if clip is not None:
            return clip(max_norm)  # type: ignore[no-any-return]
        assert self.model is not None
        return nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_overrides(self, cfg: TrainConfig) -> list[OptimizerOverride]:
        """The inner method's (the inner optimizer is the trainer's)."""
        return self.inner.optimizer_overrides(cfg) if self.inner is not None else []

    def lr_multiplier(self, step: int) -> float:
        """The inner method's factor (1 without ``inner=``)."""
        return self.inner.lr_multiplier(step) if self.inner is not None else 1.0

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A non-finite step (``inner=`` only) still counts in the period, as a GradScaler's
        skip inside :meth:`optimizer_step` does."""
        if self.inner is not None:
            self.inner.skip_step(optimizer)
        self._advance()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner step, then whatever sync this step starts or merges."""
        if self.inner is not None:
            self.inner.optimizer_step(optimizer)
        else:
            super().optimizer_step(optimizer)
        self._advance()

    def _advance(self) -> None:
        """Count the inner step; start and merge the syncs due (the inner method's pending
        updates completed first: a deferred schedule such as dear updates in the next forward)."""
        self.step += 1
        assert self.sync is not None
        h, tau = self.options.sync_every, self.delay()
        due = any(
            self.step % h == f.offset or any(item[0] <= self.step for item in f.pending)
            for f in self.sync.fragments
        )
        if due and self.inner is not None:
            self.inner.flush()
        for f in self.sync.fragments:
            self.sync.complete(f, self.step)
        for f in self.sync.fragments:
            if self.step % h == f.offset:
                self.sync.launch(f, self.step + tau)
                if tau == 0:
                    self.sync.complete(f, self.step)

    def flush(self) -> None:
        """Wait for syncs in flight (not merged before their step: the trajectory is unchanged)."""
        if self.inner is not None:
            self.inner.flush()
        if self.sync is not None:
            for f in self.sync.fragments:
                self.sync.wait(f)

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step within the run, this rank's weights and buffers, and the sync state."""
        if self.sync is None or self.model is None:
            return dict(self._loaded or {})
        local = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        state = {
            "method": self.name,
            "step": self.step,
            "local": local,
            "sync": self.sync.state_dict(),
        }
        if self.inner is not None:
            state["inner"] = self.inner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Kept until :meth:`wrap` (called before it by the trainer)."""
        if not state:
            return
        if state.get("method", self.name) != self.name:
            raise UsageError(f"checkpoint is for method {state.get('method')!r}, not {self.name!r}")
        self._loaded = state

    def describe(self) -> dict[str, Any]:
        """Options, fragments (parameter counts) and the mean bytes per inner step so far."""
        info = super().describe()
        if self.sync is not None:
            info["fragments"] = [sum(p.numel() for p in f.params) for f in self.sync.fragments]
            info["bytes_per_step_mean"] = (
                accounting.ledger().wire_bytes / self.step if self.step else 0.0
            )
        if self.inner is not None:
            info["inner"] = self.inner.describe()
        if self.nodes is not None:
            info.update(nodes=self.nodes[0], gpus_per_node=self.nodes[1])
        return info


@register
class LocalSGD(OuterMethod):
    """Local SGD: every H inner steps the parameters (and float buffers) are averaged."""

    name = "localsgd"
    Options = LocalSGDOptions
    mode = "average"


@register
class DiLoCo(OuterMethod):
    """DiLoCo: H inner steps, then an outer Nesterov step on the averaged pseudo-gradient."""

    name = "diloco"
    Options = DiLoCoOptions

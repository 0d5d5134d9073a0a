"""The one DDP comm hook: drives any codec (or none: ``ssgd``) through the shared transport.

Ordering rule (why these hooks work with any number of buckets on gloo): DDP calls the hook
for bucket 0, 1, 2, ... in the same order on every rank, on the autograd thread. The hook
issues *every* collective from inside that call: non-final messages (PowerSGD's P, gTop-k's
rounds) are completed synchronously by :func:`lowcomm.comm.transport.run_rounds`, the final
one is started asynchronously; the future's callback only decodes (tensor math), never
communicates. PyTorch's ``powerSGD_hook`` launches its second all-reduce from a callback,
whose timing differs across ranks, so with several buckets the ranks' collective sequences
diverge and gloo fails; here that cannot happen. The one exception keeps the rule: on CPU
workers over gloo (:func:`rounds_beside`) a codec with rounds runs them, its final message and
its decode as one job per bucket on a thread of the hook's own, jobs in bucket order, on a
process group only that thread uses; every rank issues the same sequence there too, and
backward no longer waits for the rounds.

Step counter: the codec's (:meth:`~lowcomm.compress.codec.Codec.end_step`), advanced after
the hook of the bucket DDP marks ``is_last()``, so it counts synchronized iterations
(``no_sync()`` steps never call the hook). While the codec is not
:attr:`~lowcomm.compress.codec.Codec.active` (``start_iter`` warm-up) the hook is a plain
mean all-reduce, which is also all ``ssgd`` ever does.

No host synchronization inside a hook: "is this bucket finite?" is a device-side flag that
steers branch-free state updates and poisons the payload (see :mod:`lowcomm.compress.feedback`).
Each bucket's *aggregated* result notes a flag in :attr:`CodecHook.finite_flags`; after
backward, :attr:`CodecHook.nonfinite_this_step` is one device tensor for the whole step and
:meth:`CodecHook.check_finite` is the single host read (with the warning) that a training
loop without a GradScaler uses to skip the optimizer step. With a GradScaler nothing is read
here: the poisoned aggregate reaches ``p.grad`` and the scaler's own inf check skips the step.

Momentum correction (:class:`~lowcomm.compress.feedback.Velocity`): every step, warm-up
included, the codec's :meth:`~lowcomm.compress.codec.Codec.accumulate` turns the bucket into
its velocity (unscaled units) before it is encoded or averaged.

AMP: :meth:`CodecHook.attach_scaler` gives the hook the GradScaler; for a
:attr:`~lowcomm.compress.codec.Codec.stateful` codec the bucket is divided by the loss scale
before encoding (state in unscaled units, :mod:`lowcomm.comm.amp`) and the decoded mean is
multiplied by it again; stateless casts keep the scaled values, the range the scaler chose.

Hierarchical all-reduce (``lowcomm.hooks.register(..., hierarchical=True)``): with a
:attr:`CodecHook.reducer` (:class:`lowcomm.comm.hierarchical.HierarchicalReducer`) every
all-reduce, the warm-up mean and a ``SUM`` codec's messages alike, runs as an intra-node
reduce-scatter, an inter-node all-reduce and an intra-node all-gather on the reducer's
communication thread, in bucket order (or flat, per bucket, in hybrid mode).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting, transport
from lowcomm.comm.backends import device_backend
from lowcomm.comm.ordered import OrderedThread
from lowcomm.comm.amp import current_scale
from lowcomm.comm.hooks.replay import BucketReplay, sync_as_parts
from lowcomm.comm.topology import Topology
from lowcomm.compress.codec import Codec, Layout, Message
from lowcomm.compress.feedback import StepFlags, finite_flag, warn_nonfinite
from lowcomm.runtime import timing

Future = torch.futures.Future


@dataclass
class SSGDOptions:
    """ssgd takes no options."""


def rounds_beside(codec: Codec, model: nn.Module, group: dist.ProcessGroup | None) -> bool:
    """Whether a hook runs ``codec``'s rounds on a thread of its own, beside backward: a codec
    with rounds (:attr:`Codec.has_rounds`: gTop-k's exchanges,
    PowerSGD's P) on CPU tensors over gloo, on the world group of several workers, with real
    compute (and, checked per call, without a hierarchical reducer, which has a thread of its
    own: :attr:`CodecHook.beside`).

    Why: in the hook's own call each round stalls backward until every partner reached the
    same bucket; on CPU workers that share cores they reach it at different moments.
    The thread uses a process group of its own (same ranks), so its collectives cannot
    interleave with those another thread issues on the world group (DDP's unused-parameter
    all-reduce, SyncBatchNorm). On CUDA a round's wait holds the compute stream (NCCL), so
    there the hook keeps its rounds, as before; so does emulated compute
    (:mod:`lowcomm.runtime.emulated`), which stands for such a GPU.
    """
    from lowcomm.runtime.emulated import emulation_of

    device = next(iter(model.parameters())).device
    return (codec.has_rounds and device.type == "cpu" and group is None and emulation_of(model) is None
            and dist.get_world_size() > 1 and device_backend(None, device) == "gloo")


class CodecHook:
    """State of one DDP comm hook: the codec (None for ``ssgd``), the step's finite flags,
    the AMP scaler. Hand it to DDP with :func:`run_hook`; checkpoint it with
    :meth:`state_dict`."""

    def __init__(self, ddp: nn.Module, name: str, options: Any, codec: Codec | None, *,
                 process_group: dist.ProcessGroup | None = None, reducer: Any = None) -> None:
        self.name = name
        #: sums all-reduces hierarchically (see module docstring); None: the plain all-reduce
        self.reducer = reducer
        self.options = options
        self.codec = codec
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.topology: Topology | None = None
        self.use_topology(accounting.topology() if process_group is None else None)
        self._step = 0  # ssgd's own count (a codec counts its steps itself)
        #: optional ``torch.amp.GradScaler``: stateful codecs then work in unscaled units
        self.scaler: torch.amp.GradScaler | None = None
        #: finiteness of every bucket's aggregated result in the current (or last) step
        self.finite_flags = StepFlags()
        self._flags_step = -1
        self._scale: torch.Tensor | None = None
        named = list(getattr(ddp, "module", ddp).named_parameters())
        self._param_name = {id(p): n for n, p in named}
        self.param_index = {n: i for i, (n, _) in enumerate(named)}
        #: the bucket layouts, recorded and replayed after a load (exact resume)
        self.replay = BucketReplay(lambda p: self._param_name.get(id(p), "?"))
        self.replay.watch(ddp)
        #: a codec's rounds beside backward (see :func:`rounds_beside`): the thread that runs
        #: them and the process group it alone uses (None: in the hook's own call)
        self.rounds_group: dist.ProcessGroup | None = None
        self.rounds_thread: OrderedThread[torch.Tensor] | None = None
        self._codec_lock = threading.Lock()
        if codec is not None and rounds_beside(codec, getattr(ddp, "module", ddp), process_group):
            self.rounds_group = dist.new_group()  # collective: every rank registers its hook
            self.rounds_thread = OrderedThread(f"lowcomm-{name}-rounds")

    def use_topology(self, topology: Topology | None) -> None:
        """The node layout scoped codec messages (hitopk's intra/inter) run on, also handed to
        the codec (``set_topology``, where it has one). None: one node (on a subgroup, too)."""
        self.topology = topology
        if self.codec is not None and hasattr(self.codec, "set_topology"):
            self.codec.set_topology(topology)

    @property
    def beside(self) -> bool:
        """Whether the codec's rounds run on :attr:`rounds_thread` (:func:`rounds_beside`; a
        hierarchical reducer attached after construction keeps them in the hook)."""
        return self.rounds_thread is not None and self.reducer is None

    @property
    def step(self) -> int:
        """Synchronized steps so far (warm-up included)."""
        return self.codec.step if self.codec is not None else self._step

    # --- the hook -------------------------------------------------------------------------
    def __call__(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        """One bucket: warm-up mean, or the codec's messages; counts the step at the last.
        The first step after a load syncs a bucket as the recorded run's buckets where they
        differ (:mod:`lowcomm.comm.hooks.replay`: exact resume)."""
        first = self._flags_step != self.step
        if first:  # first bucket of a synchronized step
            self._flags_step = self.step
            self.finite_flags.clear()
            self._scale = current_scale(self.scaler, bucket.buffer().device)
        names = self.replay.names(bucket)
        parts = self.replay.split(names)
        if parts is not None:
            return sync_as_parts(bucket, names, parts, lambda vb: self._sync(vb, first and vb.index() == 0))
        return self._sync(bucket, first, names)

    def _sync(self, bucket: Any, first: bool, names: list[str] | None = None) -> Future[torch.Tensor]:
        """:meth:`__call__` for one bucket as DDP (or the replay) presents it."""
        self.replay.note(self.replay.names(bucket) if names is None else names, first=first)
        codec = self.codec
        beside = codec is not None and codec.active and self.beside
        if codec is None:
            fut = self.allreduce_mean(bucket.buffer(), tag=self.name)
        elif not codec.active:
            if codec.accumulates:  # momentum correction: the warm-up averages the velocity
                self.accumulate(bucket, codec)
            fut = self.allreduce_mean(bucket.buffer(), tag=f"{self.name}.warmup")
        elif beside:
            fut = self.compressed_beside(bucket, codec)  # the step ends on that thread
        else:
            fut = self.compressed(bucket, codec)
        if bucket.is_last():
            if codec is None:
                self._step += 1
            elif not beside:
                codec.end_step()
            self.replay.end_step()
        return fut

    def compressed(self, bucket: dist.GradBucket, codec: Codec) -> Future[torch.Tensor]:
        """Encode, complete the non-final messages, start the final one, decode in its callback."""
        buf, msg, scale = self.encode(bucket, codec)
        msg = transport.run_rounds(codec, msg, group=self.group, tag=self.name, topology=self.topology,
                                   reducer=self.reducer)
        pending = transport.start(msg, group=self.group, tag=self.name, topology=self.topology, reducer=self.reducer)

        def decode(fut: Future[torch.Tensor]) -> torch.Tensor:
            return self.decode(codec, msg, fut.value(), buf, scale)

        return pending.future().then(decode)

    def compressed_beside(self, bucket: dist.GradBucket, codec: Codec) -> Future[torch.Tensor]:
        """:meth:`compressed` with the rounds, the final message and the decode on
        :attr:`rounds_thread`, in bucket order; after the last bucket the step ends there."""
        lock = self._codec_lock  # the codec's state is shared: one thread at a time works on it
        with lock:
            buf, msg, scale = self.encode(bucket, codec)
        last = bucket.is_last()

        def job() -> torch.Tensor:
            final = transport.run_rounds(codec, msg, group=self.rounds_group, tag=self.name,
                                         topology=self.topology, guard=lock)
            received = transport.start(final, group=self.rounds_group, tag=self.name, topology=self.topology).wait()
            with lock:
                out = self.decode(codec, final, received, buf, scale)
                if last:
                    codec.end_step()
            return out

        assert self.rounds_thread is not None
        return self.rounds_thread.submit(job)

    def encode(self, bucket: dist.GradBucket, codec: Codec) -> tuple[torch.Tensor, Message, torch.Tensor | None]:
        """The bucket's first message (velocity and loss scale handled); returns the bucket's
        buffer, the message and the loss scale the decode multiplies back (None: none)."""
        buf = bucket.buffer()
        layout = self.layout(bucket)
        scale = self.loss_scale if codec.stateful else None
        with timing.measure("compress"):
            if scale is not None:
                buf.div_(scale)
            finite = finite_flag(buf)  # device flag: no host sync inside backward
            codec.accumulate(buf, layout, finite)  # buf <- velocity (no-op without one)
            return buf, codec.encode(buf, layout, finite), scale

    def decode(self, codec: Codec, msg: Message, received: torch.Tensor, buf: torch.Tensor,
               scale: torch.Tensor | None) -> torch.Tensor:
        """The mean gradient into ``buf`` from what the final ``msg`` received (timed as compress)."""
        t0 = time.perf_counter()
        codec.decode(msg, received, buf)
        self.note_aggregate(buf)
        if scale is not None:
            buf.mul_(scale)
        timing.add("compress", time.perf_counter() - t0)
        return buf

    def accumulate(self, bucket: dist.GradBucket, codec: Codec) -> None:
        """A dense warm-up step's velocity: ``buf <- u = m*u + buf`` in unscaled units (the
        loss scale is divided out and multiplied back at once: GradScaler's scales are
        powers of two, so both are exact and the mean of the velocity is heavy-ball SGD's)."""
        buf = bucket.buffer()
        scale = self.loss_scale
        with timing.measure("compress"):
            if scale is not None:
                buf.div_(scale)
            codec.accumulate(buf, self.layout(bucket), finite_flag(buf))
            if scale is not None:
                buf.mul_(scale)

    def allreduce_mean(self, buf: torch.Tensor, *, tag: str) -> Future[torch.Tensor]:
        """Plain mean all-reduce (what DDP does), counted under ``tag``."""
        world = self.world
        if self.reducer is not None and world > 1:
            work = self.reducer.start(buf, tag=tag)
        else:
            work = accounting.all_reduce(buf, group=self.group, async_op=True, tag=tag)

        def mean(fut: Future[Any]) -> torch.Tensor:
            out = fut.value()[0].div_(world)
            self.note_aggregate(out)
            return out

        return work.get_future().then(mean)

    # --- AMP and the NaN/Inf policy ---------------------------------------------------------
    def attach_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Use ``scaler``'s loss scale from the next step on (None: gradients are unscaled)."""
        self.scaler = scaler

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """The current step's loss scale (0-dim device tensor), None without AMP."""
        return self._scale

    def note_aggregate(self, out: torch.Tensor) -> None:
        """Record whether a bucket's synchronized result is finite (device flag, no sync)."""
        self.finite_flags.note(finite_flag(out))

    @property
    def nonfinite_this_step(self) -> torch.Tensor | None:
        """0-dim bool device tensor: some bucket of the last synchronized step came out
        non-finite (on every rank alike: the payload of a non-finite input is poisoned).
        None before the first step. Reading it as a Python bool is a host sync."""
        return self.finite_flags.nonfinite()

    def check_finite(self) -> bool:
        """One host read for the whole step (call it after backward, not in a hook): True if
        the synchronized gradient is finite; otherwise warn and return False so the caller
        skips the optimizer step (the codec's state was already left unchanged)."""
        bad = self.nonfinite_this_step
        if bad is None or not bool(bad):
            return True
        warn_nonfinite(f"{self.name} state left unchanged in step {self.step - 1}")
        return False

    # --- helpers ---------------------------------------------------------------------------
    def layout(self, bucket: dist.GradBucket) -> Layout:
        """The bucket's tensors (names, shapes, positions in the model), in buffer order."""
        params = bucket.parameters()
        names = [self._param_name.get(id(p), f"?{i}") for i, p in enumerate(params)]
        layout = Layout.of(names, [p.shape for p in params], self.param_index)
        if layout.numel != bucket.buffer().numel():
            raise RuntimeError("bucket buffer does not match its parameters (sparse gradients?)")
        return layout

    # --- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Method name, options, step, the last step's bucket layout and the codec's state
        (memory, factors)."""
        state = {"method": self.name, "options": dataclasses.asdict(self.options), "step": self.step,
                 "ddp_buckets": self.replay.state_dict()}
        return {**state, **self.codec.state_dict()} if self.codec is not None else state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (refuses another method's state)."""
        if state.get("method", self.name) != self.name:
            raise ValueError(f"state is for method {state.get('method')!r}, not {self.name!r}")
        if self.codec is not None:
            self.codec.load_state_dict(state)
        else:
            self._step = int(state.get("step", 0))
        self.replay.load(state.get("ddp_buckets"))


def run_hook(state, bucket):  # type: ignore[no-untyped-def]
    """The function handed to ``ddp.register_comm_hook(state, run_hook)``.

    Deliberately unannotated: DDP checks the ``bucket`` and return annotations against the
    real classes, and ``from __future__ import annotations`` would turn them into strings.
    """
    return state(bucket)

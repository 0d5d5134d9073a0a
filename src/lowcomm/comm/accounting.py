"""The one place every collective passes through, so each method's traffic is counted alike.

Each wrapper calls the matching ``torch.distributed`` collective unchanged and records, per
collective kind and per tag (e.g. ``"powersgd.P"``):

* ``payload_bytes`` — bytes of the tensor this worker hands to the collective;
* ``wire_bytes`` — bytes this worker sends on the wire under the bandwidth-optimal ring
  algorithm: all-reduce ``2(P-1)/P·n``, reduce-scatter ``(P-1)/P·n`` (n = full input),
  all-gather ``(P-1)·n_local``, broadcast ``n`` on the source and 0 elsewhere,
  all-to-all ``(P-1)/P·n``, point-to-point (``"p2p"``, e.g. gTop-k) ``n`` on the sender
  (receives are not counted). With ``P == 1`` nothing is sent.

``bytes_sent_per_worker`` in every summary is the sum of ``wire_bytes``. The formulas are the
ones the simulator uses, so measured and predicted traffic are comparable.

Devices. A process group carries a tensor only if it has a backend for the tensor's device
type: ``init_process_group("nccl")`` registers none for ``cpu``, and a CPU tensor then fails
deep inside c10d ("No backend type associated with device type cpu"), often on one code path
that only runs every few epochs. Every wrapper here checks first (:func:`device_backend`,
once per group and device type, then a dictionary look-up) and raises
:class:`BackendDeviceError` naming the collective, the tag and the group's backends. Point-to-
point transfers of CUDA tensors on a gloo backend are staged through host memory, because
gloo's send/recv read the tensor's data pointer as host memory.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist


@dataclass
class Counter:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0

    def add(self, payload: int, wire: int) -> None:
        self.calls += 1
        self.payload_bytes += payload
        self.wire_bytes += wire


@dataclass
class Ledger:
    """Per-process tally of collective traffic, keyed by collective kind and by tag."""

    by_collective: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    by_tag: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, collective: str, tag: str, payload: int, wire: int) -> None:
        with self._lock:
            self.by_collective[collective].add(payload, wire)
            self.by_tag[tag].add(payload, wire)

    @property
    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.by_collective.values())

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.by_collective.values())

    def reset(self) -> None:
        with self._lock:
            self.by_collective.clear()
            self.by_tag.clear()

    def as_dict(self) -> dict[str, Any]:
        def dump(d: dict[str, Counter]) -> dict[str, dict[str, int]]:
            return {k: vars(v).copy() for k, v in sorted(d.items())}

        return {
            "wire_bytes": self.wire_bytes,
            "payload_bytes": self.payload_bytes,
            "by_collective": dump(self.by_collective),
            "by_tag": dump(self.by_tag),
        }


_LEDGER = Ledger()

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def ledger() -> Ledger:
    """The process-wide ledger."""
    return _LEDGER


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# --- which backend carries which device ------------------------------------------------------
class BackendDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its process group has no backend for."""


def parse_backend_config(config: str) -> dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` from ``"cpu:gloo,cuda:nccl"``.

    The format is that of :func:`torch.distributed.get_backend_config` (lower case,
    ``device:backend`` pairs). A bare backend name (``"nccl"``) is expanded the way torch
    expands it (:class:`torch.distributed.BackendConfig`), so both spellings give one answer.
    """
    text = config.strip().lower()
    if text and ":" not in text:
        text = str(dist.BackendConfig(dist.Backend(text)))
    out: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        device, sep, backend = pair.partition(":")
        if not sep or not device or not backend:
            raise ValueError(f"malformed backend config {config!r}: expected 'device:backend,...'")
        out[device.strip()] = backend.strip()
    return out


def check_device_supported(
    config: str | dict[str, str], device_type: str, *, what: str = "collective"
) -> str:
    """The backend name that carries ``device_type`` tensors under ``config``, or raise.

    A pure function of the configuration (no process group needed), so the refusal is
    testable on a CPU-only machine with a config such as ``"cuda:nccl"``.

    Raises:
        BackendDeviceError: ``config`` has no backend for ``device_type``.
    """
    mapping = parse_backend_config(config) if isinstance(config, str) else config
    backend = mapping.get(device_type)
    if backend is None:
        have = ", ".join(f"{d}:{b}" for d, b in mapping.items()) or "none"
        hint = (
            "initialize the group with a backend for both devices, e.g. "
            "dist.init_process_group('cpu:gloo,cuda:nccl'), or "
            if device_type == "cpu"
            else ""
        )
        raise BackendDeviceError(
            f"{what}: a {device_type} tensor cannot travel on this process group, whose backends "
            f"are {have}; {hint}create the tensor on a device the group serves "
            f"({', '.join(mapping) or 'none'})"
        )
    return backend


# group -> {device type -> backend name}; weak keys, so a destroyed group's entry goes with it
_BACKENDS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()


def _group_backends(group: Any) -> dict[str, str] | None:
    """Device-type -> backend map of ``group`` (cached), or None where torch cannot say."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    try:
        return _BACKENDS[pg]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: never cached, still checked
        pass
    try:
        mapping = parse_backend_config(dist.get_backend_config(pg))
    except (ValueError, RuntimeError, AttributeError):
        # this rank is not in ``pg`` (the collective is then a no-op in torch), or a group
        # kind without a recorded config: leave the call to torch unchanged
        return None
    try:
        with _BACKENDS_LOCK:
            _BACKENDS[pg] = mapping
    except TypeError:
        pass
    return mapping


def device_backend(
    group: Any, device: torch.device | str, *, what: str = "collective"
) -> str | None:
    """Name of the backend that carries ``device`` tensors on ``group`` (None: not known).

    Checked once per (group, device type), then a dictionary look-up. Returns None when no
    process group is initialized (torch then raises its own, clear error).

    Raises:
        BackendDeviceError: the group has no backend for ``device``'s type.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mapping = _group_backends(group)
    if mapping is None:
        return None
    device_type = torch.device(device).type
    return check_device_supported(mapping, device_type, what=what)


def _check(collective: str, tag: str, group: Any, tensors: Sequence[torch.Tensor]) -> str | None:
    """Refuse before anything is counted: mixed devices, or a device the group cannot carry."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise BackendDeviceError(
                f"{collective} (tag {tag!r}): all tensors of one collective must be on one device, "
                f"got {device} and {t.device}"
            )
    return device_backend(group, device, what=f"{collective} (tag {tag!r})")


def wire_bytes(collective: str, payload: int, world_size: int, *, is_src: bool = True) -> int:
    """Bytes one worker sends under the ring model (see module docstring)."""
    p = world_size
    if p <= 1:
        return 0
    if collective == "all_reduce":
        return 2 * (p - 1) * payload // p
    if collective in ("reduce_scatter", "all_to_all"):
        return (p - 1) * payload // p
    if collective == "all_gather":
        return (p - 1) * payload
    if collective == "broadcast":
        return payload if is_src else 0
    if collective == "p2p":
        return payload
    raise ValueError(f"unknown collective {collective!r}")


def _record(collective: str, tag: str, payload: int, group: Any, *, is_src: bool = True) -> None:
    p = _world(group)
    _LEDGER.record(collective, tag, payload, wire_bytes(collective, payload, p, is_src=is_src))


def all_reduce(
    tensor: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str = "all_reduce",
) -> Any:
    _check("all_reduce", tag, group, [tensor])
    _record("all_reduce", tag, _nbytes(tensor), group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str = "all_gather",
) -> Any:
    _check("all_gather", tag, group, [output, input])
    _record("all_gather", tag, _nbytes(input), group)
    return _ALL_GATHER_SINGLE(output, input, group=group, async_op=async_op)


def all_gather(
    outputs: list[torch.Tensor],
    input: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str = "all_gather",
) -> Any:
    _check("all_gather", tag, group, [input, *outputs])
    _record("all_gather", tag, _nbytes(input), group)
    return dist.all_gather(outputs, input, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str = "reduce_scatter",
) -> Any:
    backend = _check("reduce_scatter", tag, group, [output, input])
    _record("reduce_scatter", tag, _nbytes(input), group)
    if op == dist.ReduceOp.SUM and backend == "gloo":  # the backend of this tensor's device
        return _reduce_scatter_by_all_to_all(output, input, group, async_op)
    return _REDUCE_SCATTER_SINGLE(output, input, op=op, group=group, async_op=async_op)


class _SumChunksWork:
    """Work handle of :func:`_reduce_scatter_by_all_to_all`: wait, then sum the chunks."""

    def __init__(self, work: Any, received: torch.Tensor, output: torch.Tensor, world: int) -> None:
        self._work, self._received, self._output, self._world = work, received, output, world
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            torch.sum(self._received.view(self._world, -1), dim=0, out=self._output.view(-1))
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed())


def _reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Any:
    """Reduce-scatter on gloo as an all-to-all of the chunks plus a local sum.

    gloo's own reduce-scatter runs a full all-reduce underneath: measured on 4 emulated
    100 Mbit/s workers it sent 1.58·n bytes per worker (the all-reduce's 2(P-1)/P·n), not
    (P-1)/P·n. The all-to-all sends exactly (P-1)/P·n (measured 0.78·n with TCP headers),
    so the bytes counted here are the bytes that cross the wire. NCCL keeps its native ring.
    """
    world = dist.get_world_size(group)
    received = torch.empty_like(input)
    work = dist.all_to_all_single(received, input.contiguous(), group=group, async_op=async_op)
    handle = _SumChunksWork(work if async_op else None, received, output, world)
    if not async_op:
        handle.wait()
        return None
    return handle


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str = "broadcast",
) -> Any:
    is_src = (dist.get_rank() if dist.is_initialized() else 0) == src
    _check("broadcast", tag, group, [tensor])
    _record("broadcast", tag, _nbytes(tensor), group, is_src=is_src)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str = "all_to_all",
) -> Any:
    _check("all_to_all", tag, group, [output, input])
    _record("all_to_all", tag, _nbytes(input), group)
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def _stage_through_host(backend: str | None, tensor: torch.Tensor) -> bool:
    """gloo's send/recv take the tensor's data pointer as host memory (no device check in
    ``ProcessGroupGloo::send``), so a CUDA tensor must travel through a host copy."""
    return backend == "gloo" and tensor.device.type != "cpu"


class _CopyBackWork:
    """Work handle of a receive staged through host memory: wait, then copy to the device."""

    def __init__(self, work: Any, staged: torch.Tensor, target: torch.Tensor) -> None:
        self._work, self._staged, self._target = work, staged, target
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            self._target.copy_(self._staged)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


def isend(tensor: torch.Tensor, dst: int, group: Any = None, *, tag: str = "p2p") -> Any:
    """Point-to-point send (counted: wire bytes = payload bytes on the sender).

    Prefer :func:`batch_isend_irecv` when both partners send to each other: NCCL may
    deadlock on two unbatched sends of large messages that wait for their receives.
    """
    backend = _check("p2p", tag, group, [tensor])
    _record("p2p", tag, _nbytes(tensor), group)
    if _stage_through_host(backend, tensor):
        tensor = tensor.detach().to("cpu")  # synchronous copy: the data is on the host now
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group: Any = None, *, tag: str = "p2p") -> Any:
    """Point-to-point receive (not counted: the sender counts the bytes)."""
    backend = _check("p2p", tag, group, [tensor])
    if _stage_through_host(backend, tensor):
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return _CopyBackWork(dist.irecv(staged, src=src, group=group), staged, tensor)
    return dist.irecv(tensor, src=src, group=group)


def batch_isend_irecv(ops: Sequence[dist.P2POp], *, tag: str = "p2p") -> list[Any]:
    """:func:`torch.distributed.batch_isend_irecv`, counted like :func:`isend` / :func:`irecv`.

    Sends count their payload on the sender, receives count nothing. On NCCL the batch is one
    ``ncclGroupStart/End``, so two partners may each send to and receive from the other in
    the same batch without the deadlock that unbatched ``isend`` before ``irecv`` risks for
    large messages. Returns one work handle per op, in order.
    """
    ops = list(ops)
    if not ops:
        return []
    # torch checks that every op uses one group; the backend check then needs the first only
    backend = _check("p2p", tag, ops[0].group, [op.tensor for op in ops])
    staged: list[tuple[int, torch.Tensor]] = []
    if _stage_through_host(backend, ops[0].tensor):
        host_ops = []
        for i, op in enumerate(ops):
            if op.op is dist.isend:
                host = op.tensor.detach().to("cpu")
            else:
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype, device="cpu")
                staged.append((i, host))
            host_ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        run_ops = host_ops
    else:
        run_ops = ops
    for op in ops:
        if op.op is dist.isend:
            _record("p2p", tag, _nbytes(op.tensor), op.group)
    works = list(dist.batch_isend_irecv(run_ops))
    for i, host in staged:
        works[i] = _CopyBackWork(works[i], host, ops[i].tensor)
    return works

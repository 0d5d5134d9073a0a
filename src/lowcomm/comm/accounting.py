"""The one place every collective passes through, so each method's traffic is counted alike.

Each wrapper calls the matching ``torch.distributed`` collective unchanged and records, per
collective kind and per tag (e.g. ``"powersgd.P"``):

* ``payload_bytes`` — bytes of the tensor this worker hands to the collective;
* ``wire_bytes`` — bytes this worker sends on the wire under the bandwidth-optimal ring
  algorithm: all-reduce ``2(P-1)/P·n``, reduce-scatter ``(P-1)/P·n`` (n = full input),
  all-gather ``(P-1)·n_local``, broadcast ``n`` on the source and 0 elsewhere,
  all-to-all ``(P-1)/P·n``, reduce to one rank ``n`` on every other rank and ``(P-1)/P·n``
  on the destination, point-to-point (``"p2p"``, e.g. gTop-k) ``n`` on the sender
  (receives are not counted). With ``P == 1`` nothing is sent.

``bytes_sent_per_worker`` in every summary is the sum of ``wire_bytes``. The formulas are the
ones the simulator uses, so measured and predicted traffic are comparable.

Devices. Every wrapper first checks that the group has a backend for its tensors' device
(:mod:`lowcomm.comm.backends`) and raises :class:`BackendDeviceError` naming the collective,
the tag and the group's backends, before anything is counted. Point-to-point transfers of CUDA tensors on a gloo backend are staged through host memory, because
gloo's send/recv read the tensor's data pointer as host memory.

Link classes: each wrapper takes a keyword ``link`` (None: from the group and the topology)
and the ledger splits every call's bytes into ``by_link`` ``"intra"`` / ``"inter"``: a
collective on an intra-node group is intra, on an inter-node group inter; a flat collective
over several nodes follows the ring model (``1/local_size`` of its wire bytes inter: the ring
crosses each node boundary once, so a node's NIC carries what one worker sends); p2p goes by
the peer's node; on one node everything is intra. The rules live in :mod:`lowcomm.comm.ledger`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, ParamSpec, Sequence, TypeVar

import torch
import torch.distributed as dist

from lowcomm.comm.backends import (
    BackendDeviceError,
    check_device_supported,
    device_backend,
    parse_backend_config,
)
from lowcomm.comm import ring
from lowcomm.comm.ledger import Counter, Ledger, inter_share, ledger, set_topology, topology

P = ParamSpec("P")
R = TypeVar("R")


# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _check(collective: str, tag: str, group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor]) -> str | None:
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
    if collective == "reduce":
        # reduce-scatter then gather of the chunks at the root: a non-root sends
        # (P-1)/P·n + n/P = n, the root only its reduce-scatter share
        return payload if is_src else (p - 1) * payload // p
    if collective == "p2p":
        return payload
    raise ValueError(f"unknown collective {collective!r}")


def _record(collective: str, tag: str, payload: int, group: dist.ProcessGroup | None, *, is_src: bool = True,
            link: str | None = None, peer: int | None = None) -> None:
    p = _world(group)
    wire = wire_bytes(collective, payload, p, is_src=is_src)
    ledger().record(collective, tag, payload, wire, inter_share(collective, payload, wire, group, link, peer))


def _counted(
    kind: str, *, tensors: tuple[str, ...], payload: str | None = None, src: str | None = None,
    dst: str | None = None, peer: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator for the wrappers below: the one place that checks and counts a collective.

    Before the wrapper's body (the plain ``torch.distributed`` call) runs, the tensors named in
    ``tensors`` (a list argument counts each element) are checked against the group's backends
    (:func:`_check`), then the bytes of the argument named ``payload`` are recorded under
    ``kind`` and the call's ``tag`` (nothing is recorded without ``payload``: receives). With
    ``src``, the argument of that name is the sending rank (broadcast: only the source sends);
    with ``dst``, the receiving rank (reduce: every other rank sends).
    Arguments are matched by name, so each wrapper keeps its own signature. The keyword
    ``link`` of every wrapper and the argument named ``peer`` (a point-to-point partner's
    global rank) choose the link class (module docstring).
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args: P.args, **kwargs: P.kwargs) -> R:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arg = bound.arguments
            me = dist.get_rank() if dist.is_initialized() else 0
            is_src = (src is None or me == arg[src]) and (dst is None or me != arg[dst])
            checked: list[torch.Tensor] = []
            for name in tensors:
                value = arg[name]
                checked.extend(value if isinstance(value, (list, tuple)) else [value])
            _check(kind, arg["tag"], arg["group"], checked)
            if payload is not None:
                _record(kind, arg["tag"], _nbytes(arg[payload]), arg["group"], is_src=is_src,
                        link=arg["link"], peer=None if peer is None else arg[peer])
            return fn(*args, **kwargs)

        return counted

    return decorate


def _backend(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> str | None:
    """The backend that carries ``tensor`` (already checked by :func:`_counted`; cached)."""
    return device_backend(group, tensor.device)


@_counted("all_reduce", tensors=("tensor",), payload="tensor")
def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False, *, tag: str = "all_reduce", link: str | None = None) -> Any:
    """:func:`torch.distributed.all_reduce`, checked and counted under ``tag``."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@_counted("all_gather", tensors=("output", "input"), payload="input")
def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                           async_op: bool = False, *, tag: str = "all_gather", link: str | None = None) -> Any:
    """All-gather into one flat tensor (torch's ``all_gather_single``), checked and counted."""
    return _ALL_GATHER_SINGLE(output, input, group=group, async_op=async_op)


@_counted("all_gather", tensors=("input", "outputs"), payload="input")
def all_gather(outputs: list[torch.Tensor], input: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False, *, tag: str = "all_gather", link: str | None = None) -> Any:
    """:func:`torch.distributed.all_gather` into a list, checked and counted under ``tag``."""
    return dist.all_gather(outputs, input, group=group, async_op=async_op)


@_counted("reduce_scatter", tensors=("output", "input"), payload="input")
def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False, *,
                          tag: str = "reduce_scatter", link: str | None = None) -> Any:
    """Reduce-scatter of one flat tensor, checked and counted; a sum on gloo runs as an
    ring of point-to-point steps (:func:`_reduce_scatter_by_ring`)."""
    if op == dist.ReduceOp.SUM and _backend(group, input) == "gloo":  # the backend of this tensor's device
        return _reduce_scatter_by_ring(output, input, group, async_op)
    return _REDUCE_SCATTER_SINGLE(output, input, op=op, group=group, async_op=async_op)


def _reduce_scatter_by_ring(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool) -> Any:
    """Reduce-scatter on gloo as a ring of point-to-point steps (:mod:`lowcomm.comm.ring`).

    gloo's own reduce-scatter runs a full all-reduce underneath: measured on 4 emulated
    100 Mbit/s workers it sent 1.58·n bytes per worker (the all-reduce's 2(P-1)/P·n), not
    (P-1)/P·n. The ring sends exactly (P-1)/P·n, one flow per link, as NCCL's does (an
    all-to-all sends the same bytes but as P-1 flows at once, which shaped links deliver at a
    fifth to a third less bandwidth). NCCL keeps its native ring. A CUDA tensor on a gloo
    group travels through a host copy, as gloo's own collectives stage it.
    """
    if _stage_through_host("gloo", input):  # gloo's send/recv read host memory (below)
        staged = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        work: Any = _CopyBackWork(ring.start(staged, input.to("cpu"), group), staged, output)
    else:
        work = ring.start(output, input, group)
    if not async_op:
        work.wait()
        return None
    return work


@_counted("broadcast", tensors=("tensor",), payload="tensor", src="src")
def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False, *,
              tag: str = "broadcast", link: str | None = None) -> Any:
    """:func:`torch.distributed.broadcast`, checked and counted (bytes on the source only)."""
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


@_counted("reduce", tensors=("tensor",), payload="tensor", dst="dst")
def reduce(tensor: torch.Tensor, dst: int, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None,
           async_op: bool = False, *, tag: str = "reduce", link: str | None = None) -> Any:
    """:func:`torch.distributed.reduce` to ``dst``, checked and counted (the federated round's one
    aggregation: every worker's local sum to the server rank)."""
    return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


@_counted("all_to_all", tensors=("output", "input"), payload="input")
def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False, *, tag: str = "all_to_all", link: str | None = None) -> Any:
    """:func:`torch.distributed.all_to_all_single` (equal splits), checked and counted."""
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


@_counted("p2p", tensors=("tensor",), payload="tensor", peer="dst")
def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, *, tag: str = "p2p", link: str | None = None) -> Any:
    """Point-to-point send (counted: wire bytes = payload bytes on the sender).

    Prefer :func:`batch_isend_irecv` when both partners send to each other: NCCL may
    deadlock on two unbatched sends of large messages that wait for their receives.
    """
    if _stage_through_host(_backend(group, tensor), tensor):
        tensor = tensor.detach().to("cpu")  # synchronous copy: the data is on the host now
    return dist.isend(tensor, dst=dst, group=group)


@_counted("p2p", tensors=("tensor",))
def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *, tag: str = "p2p", link: str | None = None) -> Any:
    """Point-to-point receive (not counted: the sender counts the bytes)."""
    if _stage_through_host(_backend(group, tensor), tensor):
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return _CopyBackWork(dist.irecv(staged, src=src, group=group), staged, tensor)
    return dist.irecv(tensor, src=src, group=group)


def batch_isend_irecv(ops: Sequence[dist.P2POp], *, tag: str = "p2p", link: str | None = None) -> list[Any]:
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
            _record("p2p", tag, _nbytes(op.tensor), op.group, link=link, peer=op.peer)
    works: list[Any] = list(dist.batch_isend_irecv(run_ops))
    for i, host in staged:
        works[i] = _CopyBackWork(works[i], host, ops[i].tensor)
    return works


__all__ = [
    "BackendDeviceError",
    "Counter",
    "Ledger",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "batch_isend_irecv",
    "broadcast",
    "check_device_supported",
    "device_backend",
    "irecv",
    "isend",
    "ledger",
    "parse_backend_config",
    "reduce_scatter_tensor",
    "set_topology",
    "topology",
    "wire_bytes",
]

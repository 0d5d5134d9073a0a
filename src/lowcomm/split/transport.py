"""The edge <-> cloud exchange of split fine-tuning: activations forward, their gradients back.

Why point-to-point and not RPC with distributed autograd (what Shi et al.'s code uses):

* ``torch.distributed.rpc`` moves tensors through TensorPipe; CUDA tensors need explicit device
  maps or they are copied through host memory, and it adds its own thread pools;
* ``dist_autograd`` is a second autograd engine with its own context per step and a
  ``DistributedOptimizer`` on top, which neither a profiler nor a plain training loop sees into;
* its traffic bypasses :mod:`lowcomm.comm.accounting`, so the bytes per direction could not be
  counted where they are sent, as everything else in lowcomm is.

With p2p there is one explicit boundary: the cloud's received tensor is a leaf with
``requires_grad``, its ``.grad`` after ``loss.backward()`` is what goes back, and the edge calls
``torch.autograd.backward(sent, received_grad)``. Both sides run stock autograd and any
optimizer. Every send goes through :func:`lowcomm.comm.accounting.batch_isend_irecv` (NCCL needs
grouped send/recv; gloo runs the same calls) under the tag ``"split.forward"`` (edge -> cloud)
or ``"split.backward"`` (cloud -> edge), so the ledger's ``by_tag`` holds the bytes per
direction. A lost peer surfaces as the process group's timeout on the blocked wait.

One forward message, in two batches (the receiver must size its buffers from the first):

1. a header of :data:`HEADER_LEN` int32 (:data:`HEADER_BYTES` bytes): magic, kind (train /
   eval / stop), batch, sequence length, wire dtype, label code, mask code, number of tensors
   and their widths. The cloud checks the wire dtype and widths against its own settings, so
   two sides started with different ``--rank`` / ``--wire`` fail with a clear message instead of
   misreading bytes. The batch size travels here, so a short last batch needs nothing special.
2. the tensors (B, T, width) in the wire dtype (fp32, fp16 or bf16; cast before sending, back to
   fp32 on receipt), the attention mask, and the labels (the head is on the cloud).

The mask: BERT tokenizers pad on the right, so the mask is a prefix of ones and its row lengths
say everything: B int32 instead of B*T bytes (at rank 8 in bf16, a uint8 mask would be 1/16 of
the activations' bytes). A mask that is not a prefix goes as B*T uint8. Integer labels in
[0, 255] go as uint8, other integers as int64, float labels (regression) as float32.
:func:`forward_bytes` / :func:`backward_bytes` give the resulting byte counts.

A backward message is the gradients, in the wire dtype, of the tensors of the last train
message; the edge knows their shapes, so no header is needed. In fp16 each gradient is first
scaled by a power of two that puts its largest magnitude just below 2^14, and the scales go
along as one float32 per tensor: loss gradients per activation are often below fp16's smallest
normal number (6.1e-5) and would otherwise flush towards zero; the power of two makes the
scaling itself exact. bf16 has fp32's exponent range and needs no scale.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.errors import UsageError

__all__ = [
    "FORWARD_TAG",
    "BACKWARD_TAG",
    "HEADER_BYTES",
    "HEADER_LEN",
    "WIRE_DTYPES",
    "CloudLink",
    "EdgeLink",
    "ForwardMessage",
    "Kind",
    "backward_bytes",
    "forward_bytes",
    "transfer_device",
    "wire_dtype",
]

FORWARD_TAG = "split.forward"
BACKWARD_TAG = "split.backward"

#: wire dtype names (``--wire``) and their torch dtypes, in header-code order
WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_WIRE_CODES = {name: i for i, name in enumerate(WIRE_DTYPES)}

_MAGIC = 0x5F17  # "split" protocol, version 1: a peer speaking something else is refused
_MAX_TENSORS = 2  # the compressed activations, and the residual when it is kept
#: int32 fields: magic, kind, batch, seq, wire, label code, mask code, n tensors, widths
HEADER_LEN = 8 + _MAX_TENSORS
HEADER_BYTES = 4 * HEADER_LEN

# labels: code -> dtype on the wire (0: no labels)
_LABEL_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int64, 3: torch.float32}
_MASK_LENGTHS, _MASK_FULL = 1, 2  # (0: no mask, a stop message)


class Kind(enum.IntEnum):
    """What a forward message asks of the cloud."""

    TRAIN = 0  #: run in train mode, send the gradients back
    EVAL = 1  #: run in eval mode without gradients, send nothing back
    STOP = 2  #: the edge is done; no tensors follow


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--wire`` name; unknown names -> UsageError listing the valid ones."""
    if name not in WIRE_DTYPES:
        raise UsageError(f"unknown wire dtype {name!r}; valid: {', '.join(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def _label_bytes(batch: int, labels: str | None) -> int:
    sizes = {None: 0, "uint8": 1, "int64": 8, "float32": 4}
    if labels not in sizes:
        raise UsageError(f"labels must be one of {', '.join(map(str, sizes))}, got {labels!r}")
    return batch * sizes[labels]


def forward_bytes(batch: int, seq: int, widths: Sequence[int], wire: str, *,
                  mask: str = "lengths", labels: str | None = "uint8") -> int:
    """Bytes one forward message puts on the wire (edge -> cloud), header included.

    ``mask``: ``"lengths"`` (a right-padded mask: B int32) or ``"full"`` (B*T uint8);
    ``labels``: ``None``, ``"uint8"``, ``"int64"`` or ``"float32"`` (see the module docstring).
    """
    item = wire_dtype(wire).itemsize
    if mask not in ("lengths", "full"):
        raise UsageError(f"mask must be 'lengths' or 'full', got {mask!r}")
    mask_bytes = batch * 4 if mask == "lengths" else batch * seq
    return HEADER_BYTES + sum(batch * seq * w * item for w in widths) + mask_bytes + _label_bytes(batch, labels)


def backward_bytes(batch: int, seq: int, widths: Sequence[int], wire: str) -> int:
    """Bytes one backward message puts on the wire (cloud -> edge): the gradients (and, in fp16,
    one float32 scale per tensor)."""
    scales = 4 * len(widths) if wire_dtype(wire) == torch.float16 else 0
    return sum(batch * seq * w * wire_dtype(wire).itemsize for w in widths) + scales


def _fp16_scales(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor the power of two ``2^(14 - e)`` with ``max|g| < 2^e``: ``g * scale`` stays below
    2^14 (fp16's largest value is 65504), as far above fp16's subnormal range as it can be."""
    amax = torch.stack([g.detach().abs().amax().to(torch.float32) for g in grads])
    _, exponent = torch.frexp(amax)
    return torch.pow(2.0, (14 - exponent).to(torch.float32))


@dataclass
class ForwardMessage:
    """What the cloud received: ``tensors`` are fp32 (leaves requiring grad for ``TRAIN``)."""

    kind: Kind
    tensors: list[torch.Tensor] = field(default_factory=list)
    attention_mask: torch.Tensor | None = None  #: (B, T) int64 of 1/0
    labels: torch.Tensor | None = None  #: (B,) int64 (classes) or float32 (regression)


def _require_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("the split link needs torch.distributed initialized "
                         "(init_process_group with the edge as one rank and the cloud as another)")


class _Link:
    """What both ends share: the peer, the group, the wire dtype and the time spent blocked."""

    def __init__(self, peer: int, wire: str, group: dist.ProcessGroup | None) -> None:
        self.peer = peer
        self.wire = wire
        self.dtype = wire_dtype(wire)
        self.group = group
        #: seconds this side spent in sends and receives (the step time's communication part)
        self.comm_s = 0.0

    def _device(self) -> torch.device:
        _require_group()
        return transfer_device(self.group)

    def _exchange(self, ops: list[dist.P2POp], tag: str) -> None:
        t0 = time.perf_counter()
        for work in accounting.batch_isend_irecv(ops, tag=tag):
            work.wait()
        self.comm_s += time.perf_counter() - t0

    def _send(self, t: torch.Tensor) -> dist.P2POp:
        return dist.P2POp(dist.isend, t.contiguous(), self.peer, self.group)

    def _recv(self, t: torch.Tensor) -> dist.P2POp:
        return dist.P2POp(dist.irecv, t, self.peer, self.group)


class EdgeLink(_Link):
    """The edge's end: :meth:`send_forward` activations (+ mask, labels), :meth:`recv_backward`.

    ``peer`` is the cloud's global rank. Messages travel on :func:`transfer_device`; the
    gradients come back on the device and in the dtype of the tensors that were sent.
    """

    def __init__(self, peer: int = 1, wire: str = "fp32", *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(peer, wire, group)
        self._sent: list[torch.Tensor] | None = None  # shapes/dtypes the gradients come back as

    def send_forward(self, tensors: Sequence[torch.Tensor], attention_mask: torch.Tensor,
                     labels: torch.Tensor | None = None, *, train: bool = True) -> None:
        """Send one batch's link tensors (each (B, T, width)), its mask and labels.

        ``train=True`` announces a training batch: the cloud will send the gradients of
        ``tensors`` back (:meth:`recv_backward`). Blocks until the sends completed.
        """
        device = self._device()
        tensors = list(tensors)
        if not 1 <= len(tensors) <= _MAX_TENSORS:
            raise UsageError(f"a forward message carries 1 to {_MAX_TENSORS} tensors, got {len(tensors)}")
        if attention_mask.dim() != 2:
            raise UsageError(f"attention_mask must be (batch, seq), got {tuple(attention_mask.shape)}")
        b, t = attention_mask.shape
        for x in tensors:
            if x.dim() != 3 or tuple(x.shape[:2]) != (b, t):
                raise UsageError(f"link tensors must be (batch, seq, width) = ({b}, {t}, .) like the "
                                 f"attention mask, got {tuple(x.shape)}")
        mask_code, mask_wire = _encode_mask(attention_mask.to(device))
        label_code, label_wire = 0, None
        if labels is not None:
            label_code, label_wire = _encode_labels(labels.to(device).reshape(-1), b)
        widths = [x.shape[2] for x in tensors] + [0] * (_MAX_TENSORS - len(tensors))
        header = torch.tensor(
            [_MAGIC, int(Kind.TRAIN if train else Kind.EVAL), b, t, _WIRE_CODES[self.wire], label_code,
             mask_code, len(tensors), *widths], dtype=torch.int32, device=device)
        payload = [x.detach().to(device=device, dtype=self.dtype) for x in tensors] + [mask_wire]
        if label_wire is not None:
            payload.append(label_wire)
        self._exchange([self._send(header)], FORWARD_TAG)
        self._exchange([self._send(p) for p in payload], FORWARD_TAG)
        self._sent = tensors if train else None

    def recv_backward(self) -> list[torch.Tensor]:
        """The gradients of the last train batch's tensors, in those tensors' dtype and device."""
        if self._sent is None:
            raise UsageError("recv_backward() needs a preceding send_forward(..., train=True)")
        device = self._device()
        sent, self._sent = self._sent, None
        bufs = [torch.empty(x.shape, dtype=self.dtype, device=device) for x in sent]
        ops = [self._recv(g) for g in bufs]
        scales = None
        if self.dtype == torch.float16:
            scales = torch.empty(len(sent), dtype=torch.float32, device=device)
            ops.append(self._recv(scales))
        self._exchange(ops, BACKWARD_TAG)
        grads = [g.to(torch.float32) for g in bufs]
        if scales is not None:
            grads = [g / scales[i] for i, g in enumerate(grads)]  # a power of two: exact
        return [g.to(device=x.device, dtype=x.dtype) for g, x in zip(grads, sent)]

    def send_stop(self) -> None:
        """Tell the cloud that no more batches come (its :meth:`CloudLink.recv_forward` returns STOP)."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int32)
        header[0], header[1] = _MAGIC, int(Kind.STOP)
        self._exchange([self._send(header.to(self._device()))], FORWARD_TAG)
        self._sent = None


def _encode_mask(attention_mask: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(code, wire tensor): the row lengths (int32) of a right-padded mask, else B*T uint8."""
    keep = attention_mask != 0
    lengths = keep.sum(dim=1)
    positions = torch.arange(keep.shape[1], device=keep.device)
    if bool((keep == (positions[None] < lengths[:, None])).all()):
        return _MASK_LENGTHS, lengths.to(torch.int32)
    return _MASK_FULL, keep.to(torch.uint8)


def _encode_labels(labels: torch.Tensor, batch: int) -> tuple[int, torch.Tensor]:
    """(code, wire tensor): uint8 for class ids in [0, 255], else int64; floats as float32."""
    if labels.numel() != batch:
        raise UsageError(f"labels must hold one value per example ({batch}), got {labels.numel()}")
    if labels.is_floating_point():
        return 3, labels.to(torch.float32)
    if batch == 0:
        return 1, labels.to(torch.uint8)
    lo, hi = torch.aminmax(labels)
    if 0 <= int(lo) and int(hi) <= 255:
        return 1, labels.to(torch.uint8)
    return 2, labels.to(torch.int64)


def transfer_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device every split message travels from and to: CUDA where the group carries CUDA
    tensors with NCCL, else the host (gloo; CUDA tensors are copied through host memory).

    Both ends apply the same rule, so a header or a gradient is never posted on one backend by
    the sender and on another by the receiver (a mixed ``cpu:gloo,cuda:nccl`` group would
    otherwise pair a host send with a device receive and hang).
    """
    backends = accounting.parse_backend_config(str(dist.get_backend_config(group)))
    if backends.get("cuda") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CloudLink(_Link):
    """The cloud's end: :meth:`recv_forward` a batch, :meth:`send_backward` its gradients.

    ``peer`` is the edge's global rank.
    """

    def __init__(self, peer: int = 0, wire: str = "fp32", *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(peer, wire, group)
        self._received: list[torch.Tensor] | None = None

    def recv_forward(self, widths: Sequence[int], *, device: torch.device | str | None = None) -> ForwardMessage:
        """Receive one forward message whose tensors have ``widths`` (checked against the header).

        ``device`` is where the tensors land (default: :func:`transfer_device`). For ``TRAIN``
        the tensors are fp32 leaves with ``requires_grad``; :meth:`send_backward` sends their
        gradients.
        """
        wire_dev = self._device()
        target = torch.device(device) if device is not None else wire_dev
        header = torch.empty(HEADER_LEN, dtype=torch.int32, device=wire_dev)
        self._exchange([self._recv(header)], FORWARD_TAG)
        magic, kind_code, b, t, wire_code, label_code, mask_code, n, *got = header.tolist()
        self._received = None
        valid = (magic == _MAGIC and kind_code in tuple(Kind) and 0 <= wire_code < len(WIRE_DTYPES)
                 and label_code in (0, *_LABEL_DTYPES) and b >= 0 and t >= 0
                 and (kind_code == Kind.STOP or (mask_code in (_MASK_LENGTHS, _MASK_FULL)
                                                 and 1 <= n <= _MAX_TENSORS)))
        if not valid:
            raise UsageError(f"rank {self.peer} is not a split edge (bad message header {header.tolist()})")
        kind = Kind(kind_code)
        if kind is Kind.STOP:
            return ForwardMessage(kind)
        problem = None
        if wire_code != _WIRE_CODES[self.wire]:
            problem = (f"the edge sends {list(WIRE_DTYPES)[wire_code]} but this cloud expects "
                       f"{self.wire}: start both sides with the same --wire")
        elif list(got[:n]) != list(widths):
            problem = (f"the edge sends widths {got[:n]} but this cloud expects {list(widths)}: "
                       "start both sides with the same --rank, --keep-residual and --no-compress")
        if problem is not None:
            # take the message off the wire first, so the edge's sends complete and it sees the
            # cloud's exit (not a send blocked forever)
            self._recv_payload(wire_dev, b, t, list(WIRE_DTYPES.values())[wire_code], got[:n],
                               mask_code, label_code)
            raise UsageError(problem)
        bufs, mask_buf, label_buf = self._recv_payload(wire_dev, b, t, self.dtype, widths, mask_code,
                                                       label_code)
        train = kind is Kind.TRAIN
        # a fresh tensor even when wire, dtype and device agree: each is its own leaf
        tensors = [x.to(device=target, dtype=torch.float32, copy=True).requires_grad_(train) for x in bufs]
        mask_buf = mask_buf.to(target)
        if mask_code == _MASK_LENGTHS:
            mask = (torch.arange(t, device=target)[None] < mask_buf[:, None]).to(torch.int64)
        else:
            mask = mask_buf.to(torch.int64)
        labels = None
        if label_buf is not None:
            labels = label_buf.to(device=target, dtype=torch.float32 if label_code == 3 else torch.int64)
        self._received = tensors if train else None
        return ForwardMessage(kind, tensors, mask, labels)

    def _recv_payload(self, device: torch.device, b: int, t: int, dtype: torch.dtype, widths: Sequence[int],
                      mask_code: int, label_code: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """Receive a forward message's tensors, mask and labels as the header announced them."""
        bufs = [torch.empty(b, t, w, dtype=dtype, device=device) for w in widths]
        mask_buf = (torch.empty(b, dtype=torch.int32, device=device) if mask_code == _MASK_LENGTHS
                    else torch.empty(b, t, dtype=torch.uint8, device=device))
        ops = [self._recv(x) for x in bufs] + [self._recv(mask_buf)]
        label_buf = None
        if label_code:
            label_buf = torch.empty(b, dtype=_LABEL_DTYPES[label_code], device=device)
            ops.append(self._recv(label_buf))
        self._exchange(ops, FORWARD_TAG)
        return bufs, mask_buf, label_buf

    def send_backward(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """Send the gradients of the last ``TRAIN`` message's tensors back to the edge.

        ``grads`` default to the received leaves' ``.grad`` (after ``loss.backward()``); a
        missing gradient (a tensor the loss did not depend on) goes as zeros.
        """
        if self._received is None:
            raise UsageError("send_backward() needs a preceding TRAIN message (an EVAL or STOP "
                             "message has no gradients, and each TRAIN message is answered once)")
        device = self._device()
        received = self._received
        if grads is None:
            grads = [x.grad for x in received]
        if len(grads) != len(received):
            raise UsageError(f"expected {len(received)} gradients, got {len(grads)}")
        full = []
        for g, x in zip(grads, received):
            if g is not None and g.shape != x.shape:
                raise UsageError(f"gradient shape {tuple(g.shape)} differs from the received tensor's "
                                 f"{tuple(x.shape)}")
            full.append(torch.zeros(x.shape, device=device) if g is None else g.detach().to(device))
        payload = full
        if self.dtype == torch.float16:
            scales = _fp16_scales(full)
            payload = [g * scales[i] for i, g in enumerate(full)] + [scales]
        wire = [g.to(self.dtype) for g in payload[:len(full)]] + payload[len(full):]
        self._received = None
        self._exchange([self._send(g) for g in wire], BACKWARD_TAG)

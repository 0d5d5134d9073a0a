"""Base of the gathered codecs built from a payload :class:`~lowcomm.compress.base.Compressor`.

Sign and sparse payloads do not add up, so every worker receives every worker's payload
(one all-gather per fused buffer: the parts are packed into one uint8 tensor) and decodes
the mean from all of them. What differs between signsgd, signum and topk is only the payload
math (:meth:`PayloadCodec.build`) and the state around it (:meth:`PayloadCodec.wrap`:
:class:`~lowcomm.compress.feedback.Direct`, :class:`~lowcomm.compress.feedback.ErrorFeedback`
or :class:`~lowcomm.compress.feedback.Momentum`, one interface, no type dispatch).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lowcomm.compress.base import Compressor
from lowcomm.compress.codec import Aggregation, Codec, CodecCost, Layout, Message, Round, Work, pack, unpack
from lowcomm.compress.feedback import Direct, ErrorFeedback, ParamStore


class PayloadCodec(Codec):
    """A gathered codec: encode with the wrapped compressor, all-gather, aggregate."""

    aggregation = Aggregation.GATHER
    stateful = True

    def __init__(self, options: Any = None, *, world: int = 1, rank: int = 0) -> None:
        super().__init__(options, world=world, rank=rank)
        #: per-parameter state (residual memory or momentum), checkpointed as ``memory``
        self.memory = ParamStore()
        self.compressor = self.build()
        self.encoder = self.wrap(self.compressor, self.memory)

    @abstractmethod
    def build(self) -> Compressor:
        """The payload math of this codec."""

    def wrap(self, inner: Compressor, store: ParamStore) -> Direct:
        """The state kept around ``inner``: residual memory when the options ask for
        ``error_feedback``, else none."""
        cls = ErrorFeedback if getattr(self.options, "error_feedback", False) else Direct
        return cls(inner, store=store)

    def prepare(self, layout: Layout) -> None:
        """Per-buffer set-up before encoding (top-k sets the step's density and seeds its
        sampler here)."""

    def sent(self, layout: Layout, payload: Sequence[torch.Tensor], finite: torch.Tensor) -> None:
        """Called with this worker's payload once it is built, before packing (top-k masks
        the velocity at the sent indices here). Default: nothing."""

    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *,
               pad_to: int = 1) -> Message:
        """Pack this worker's payload of ``flat`` (poisoned when ``finite`` is False)."""
        self.prepare(layout)
        payload, ctx = self.encoder.compress(flat, layout, finite)
        self.sent(layout, payload, finite)
        buf, spec = pack(payload, finite)
        return Message(buf, "all_gather", ctx=(spec, ctx))

    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """The mean of every worker's decoded payload."""
        spec, ctx = msg.ctx
        self.compressor.aggregate_out(unpack(received, spec), ctx, out)

    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None) -> CodecCost:
        """One all-gather of :meth:`payload_bytes`; decoding reads every worker's payload.
        Encode: :meth:`work`'s plus the velocity stage's (momentum correction, when on)."""
        encode, decode = self.work(shapes)
        then = decode.scaled(world) + self.decode_once(shapes)
        return CodecCost(encode + self.velocity_work(shapes),
                         [Round("all_gather", self.payload_bytes(shapes, dtype_bytes), then)])

    @abstractmethod
    def payload_bytes(self, shapes: Sequence[Sequence[int]], dtype_bytes: int) -> int:
        """Bytes of one worker's packed payload for a buffer fusing ``shapes``."""

    @abstractmethod
    def work(self, shapes: Sequence[Sequence[int]]) -> tuple[Work, Work]:
        """(encode work, decode work of one worker's payload)."""

    def decode_once(self, shapes: Sequence[Sequence[int]]) -> Work:
        """Decode work done once, whatever the world size (zero-fill, the final division)."""
        return Work()

    def state_dict(self) -> dict[str, Any]:
        """Step and the per-parameter ``memory`` (residual or momentum)."""
        return {**super().state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        super().load_state_dict(state)
        self.memory.load_state_dict(dict(state.get("memory", {})))

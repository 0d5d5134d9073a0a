"""Payload axis: how one gradient is encoded. Tensor math and state, never a collective.

Every compressor is one :class:`~lowcomm.compress.codec.Codec` in its own module of this
package, registered in :data:`~lowcomm.compress.codec.CODECS` (found by listing the package:
adding a compressor touches no other module). The codec declares its aggregation, messages,
byte cost and state; :mod:`lowcomm.comm.transport` carries it for the DDP comm hooks and
the scheduling engine alike. The payload-math classes (:class:`Compressor` and its
subclasses) are the codecs' building blocks, also timed by the simulator's profiler.
"""

from __future__ import annotations

from lowcomm.compress.base import Compressor, pack_payload, unpack_payload
from lowcomm.compress.cast import CastCompressor
from lowcomm.compress.codec import CODECS, Aggregation, Codec, CodecCost, Layout, Message, codec_class
from lowcomm.compress.feedback import Direct, ErrorFeedback, Momentum, ParamStore
from lowcomm.compress.sign import MajoritySign, ScaledSign, pack_signs, unpack_signs
from lowcomm.compress.topk import TopK, fast_topk_indices, topk_indices

__all__ = [
    "CODECS",
    "Aggregation",
    "CastCompressor",
    "Codec",
    "CodecCost",
    "Compressor",
    "Direct",
    "ErrorFeedback",
    "Layout",
    "MajoritySign",
    "Message",
    "Momentum",
    "ParamStore",
    "ScaledSign",
    "TopK",
    "codec_class",
    "fast_topk_indices",
    "pack_payload",
    "pack_signs",
    "topk_indices",
    "unpack_payload",
    "unpack_signs",
]

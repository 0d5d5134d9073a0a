"""Payload axis: how one gradient is encoded. Pure tensor math, never a collective.

Each compressor says which aggregation it needs (:attr:`Compressor.aggregation`):
``"all_reduce"`` when payloads can be summed (casts, low-rank factors) and ``"all_gather"``
when each worker's payload must be decoded separately (signs, sparse top-k). The comm hooks
in :mod:`lowcomm.comm.hooks` pick the collective from that, and error feedback
(:mod:`lowcomm.compress.feedback`) wraps any compressor from the outside.
"""

from __future__ import annotations

from lowcomm.compress.base import Compressor, pack_payload, unpack_payload
from lowcomm.compress.cast import CastCompressor
from lowcomm.compress.feedback import ErrorFeedback, Momentum, ParamStore
from lowcomm.compress.sign import MajoritySign, ScaledSign, pack_signs, unpack_signs
from lowcomm.compress.topk import TopK, fast_topk_indices, topk_indices

__all__ = [
    "CastCompressor",
    "Compressor",
    "ErrorFeedback",
    "ParamStore",
    "MajoritySign",
    "Momentum",
    "ScaledSign",
    "TopK",
    "fast_topk_indices",
    "pack_payload",
    "pack_signs",
    "topk_indices",
    "unpack_payload",
    "unpack_signs",
]

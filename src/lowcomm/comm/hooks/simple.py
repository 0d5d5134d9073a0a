"""One-round compression hooks: fp16, bf16, signsgd, signum, topk (and ssgd for symmetry).

Each wraps a :class:`~lowcomm.compress.Compressor` (optionally inside error feedback or
momentum) and picks the collective from the compressor's aggregation kind:

* all-reduce kind: divide by P, encode, all-reduce the payload, decode (casts);
* all-gather kind: encode, pack the payload's parts into one uint8 tensor, one
  ``all_gather_into_tensor`` per bucket, then every rank unpacks and decodes all P payloads.

The collective is issued from the hook call; decoding happens in the future's callback.

Stateful compressors (error feedback, momentum) see the bucket divided by the AMP loss scale
and their decoded result is multiplied by it again (:mod:`lowcomm.comm.amp`); stateless casts
keep the scaled values, which is the range the scaler chose for fp16.
"""

from __future__ import annotations

from abc import abstractmethod

import time
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.comm import accounting
from lowcomm.comm.hooks.options import CastOptions, SignOptions, SignumOptions, TopKOptions
from lowcomm.comm.hooks.state import Future, HookState, poison
from lowcomm.compress.base import Compressor, pack_payload, payload_spec, unpack_payload
from lowcomm.compress.cast import CastCompressor
from lowcomm.compress.feedback import CompressorWrapper, ErrorFeedback, Momentum, ParamStore, finite_flag
from lowcomm.compress.sign import MajoritySign, ScaledSign
from lowcomm.compress.topk import TopK
from lowcomm.runtime import timing


class CompressorHook(HookState):
    """A hook around one compressor; subclasses only build :attr:`compressor`."""

    def __init__(self, ddp: Any, options: Any, *, process_group: Any = None) -> None:
        super().__init__(ddp, options, process_group=process_group)
        self.store = ParamStore()
        self.compressor = self.build()

    @abstractmethod
    def build(self) -> Compressor:
        """The payload compressor of this method."""

    def before_compress(self, names: list[str]) -> None:
        """Per-bucket preparation (e.g. seeding a sampler)."""

    def encode(
        self, buf: torch.Tensor, names: list[str], sizes: list[int], finite: torch.Tensor
    ) -> tuple[list[torch.Tensor], Any]:
        c = self.compressor
        if isinstance(c, (ErrorFeedback, Momentum)):
            return c.compress(buf, sizes, names=names, finite=finite)
        return c.compress(buf, sizes)

    @property
    def stateful(self) -> bool:
        """State kept across steps: it must live in unscaled units under AMP."""
        return isinstance(self.compressor, CompressorWrapper)

    def compressed_hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        buf = bucket.buffer()
        names, sizes, _ = self.layout(bucket)
        world, tag = self.world, self.name
        scale = self.loss_scale if self.stateful else None
        with self.timed():
            self.before_compress(names)
            if scale is not None:
                buf.div_(scale)
            if self.compressor.aggregation == "all_reduce":
                buf.div_(world)
            finite = finite_flag(buf)
            payload, ctx = self.encode(buf, names, sizes, finite)
            poison(payload, finite)
            if self.compressor.aggregation == "all_reduce":
                (send,) = payload
            else:
                spec = payload_spec(payload)
                send = pack_payload(payload)
                recv = send.new_empty(world * send.numel())
        if self.compressor.aggregation == "all_reduce":
            work = accounting.all_reduce(send, group=self.group, async_op=True, tag=tag)

            def decode_sum(fut: Future[Any]) -> torch.Tensor:
                t0 = time.perf_counter()
                buf.copy_(self.compressor.decompress([fut.value()[0]], ctx))
                self.note_aggregate(buf)
                if scale is not None:
                    buf.mul_(scale)
                timing.add("compress", time.perf_counter() - t0)
                return buf

            return work.get_future().then(decode_sum)

        work = accounting.all_gather_into_tensor(recv, send, group=self.group, async_op=True, tag=tag)

        def decode_gathered(fut: Future[Any]) -> torch.Tensor:
            t0 = time.perf_counter()
            fut.wait()
            parts = recv.view(world, -1)
            payloads = [unpack_payload(parts[r], spec) for r in range(world)]
            buf.copy_(self.compressor.aggregate(payloads, ctx))
            self.note_aggregate(buf)
            if scale is not None:
                buf.mul_(scale)
            timing.add("compress", time.perf_counter() - t0)
            return buf

        return work.get_future().then(decode_gathered)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["memory"] = self.store.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.store.load_state_dict(state.get("memory", {}))


class SSGDHook(HookState):
    """Plain mean all-reduce (what DDP does), counted under tag ``ssgd``."""

    name = "ssgd"
    Options = CastOptions

    def compressed_hook(self, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        return self.allreduce_mean(bucket.buffer(), tag=self.name)


class FP16Hook(CompressorHook):
    name = "fp16"
    Options = CastOptions

    def build(self) -> Compressor:
        return CastCompressor(torch.float16)


class BF16Hook(CompressorHook):
    name = "bf16"
    Options = CastOptions

    def build(self) -> Compressor:
        return CastCompressor(torch.bfloat16)


class SignSGDHook(CompressorHook):
    """EF-SignSGD: scaled sign per parameter with residual memory."""

    name = "signsgd"
    aggregation = "all_gather"
    Options = SignOptions

    def build(self) -> Compressor:
        inner = ScaledSign()
        return ErrorFeedback(inner, store=self.store) if self.options.error_feedback else inner


class SignumHook(CompressorHook):
    """Signum: momentum on each worker, then majority vote of the signs."""

    name = "signum"
    aggregation = "all_gather"
    Options = SignumOptions

    def build(self) -> Compressor:
        return Momentum(MajoritySign(), beta=self.options.momentum, store=self.store)


class TopKHook(CompressorHook):
    """Top-k with residual memory; values + int32 indices all-gathered, scatter-added."""

    name = "topk"
    aggregation = "all_gather"
    Options = TopKOptions

    def build(self) -> Compressor:
        self.topk = TopK(self.options.density, fast_select=self.options.fast_select)
        return ErrorFeedback(self.topk, store=self.store) if self.options.error_feedback else self.topk

    def before_compress(self, names: list[str]) -> None:
        if self.options.fast_select:
            g = torch.Generator(device="cpu")
            first = self.param_index.get(names[0], 0) if names else 0
            g.manual_seed((self.options.seed * 1_000_003 + self.step * 10_007 + first) % (2**63))
            self.topk.generator = g

"""A codec in the steady state of training, driven without a process group, for timing.

Why a module: the profiler (:func:`lowcomm.sim.profiler.measure_compressors`, whose figures
price compression in the simulator) and the kernel benchmark (``benchmarks/kernels.py``) time
a codec's encode and decode outside a training run. Timed on a fresh codec, both would
measure work a run does once: a step of the ``start_iter`` warm-up (a plain all-reduce, and
another path for some codecs) and, for the low-rank codecs, the first step's draw of their
starting factors on the host, repeated by every call because an encode alone never fills the
factor tables. Here a codec is moved past its warm-up and run through one full step of each
step kind first (encode, the rounds, decode) with fabricated peers: all ``world`` workers
send the same buffer.
"""

from __future__ import annotations

import torch

from lowcomm.compress.codec import Codec, Layout, Message


def received(msg: Message, world: int) -> torch.Tensor:
    """What ``msg``'s collective delivers among ``world`` workers sending the same buffer (one
    node: a scoped message runs on all of them, the transport's flat fallback)."""
    if msg.collective == "all_gather":
        return msg.buf[: msg.numel].unsqueeze(0).expand(world, -1).contiguous()
    if msg.collective == "reduce_scatter":  # this worker's chunk of the sum
        return msg.buf[: msg.numel // world].clone()
    return msg.buf.clone()


def final_message(codec: Codec, buf: torch.Tensor, layout: Layout, finite: torch.Tensor, world: int) -> Message:
    """Encode ``buf`` (consumed) and complete every non-final round with fabricated peers."""
    msg = codec.encode(buf, layout, finite)
    while not msg.final:
        msg = codec.advance(msg, received(msg, world))
    return msg


def compressing(codec: Codec, offset: int = 0) -> Codec:
    """``codec`` at its first compressed step (plus ``offset``): past the ``start_iter``
    warm-up, during which the transports send a plain all-reduce and a codec may take another
    path (e.g. ACP-SGD's velocity is not fused into its encode). Returns ``codec``."""
    codec.step = codec.start_iter + offset
    return codec


def step_offsets(codec: Codec | type[Codec]) -> tuple[int, ...]:
    """The compressed steps that together run every kernel of the codec: one for most, a
    P- and a Q-step for ACP-SGD (:attr:`Codec.step_cycle`); timings average over them."""
    return tuple(range(codec.step_cycle))


def primed(codec: Codec, x: torch.Tensor, layout: Layout, finite: torch.Tensor, world: int,
           offset: int = 0) -> Codec:
    """``codec`` after one full step of each step kind on ``x`` (not modified), set back to
    its compressed step ``offset``: the state a training step starts from (the low-rank
    codecs' factor tables filled). Returns it."""
    out = torch.empty_like(x)
    for o in step_offsets(codec):
        compressing(codec, o)
        buf = x.clone()
        codec.accumulate(buf, layout, finite)
        msg = final_message(codec, buf, layout, finite, world)
        codec.decode(msg, received(msg, world), out)
    return compressing(codec, offset)

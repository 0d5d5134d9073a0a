"""Model-parallel FC layers under ``--compute emulated:...``: real exchanges, emulated compute.

Why: emulated compute (:mod:`lowcomm.runtime.emulated`) replaces each layer's arithmetic by a
wait of its profiled time while collectives stay real, so that schedule studies on this
machine see a GPU cluster's compute/communication ratio. A model-parallel Linear
(:mod:`lowcomm.parallel.fc`) exchanges activations and errors around its compute, so its
emulated twin sends the same collectives with the same sizes (zeros of the real shapes: the
bytes and their order are what matter) and waits the layer's profiled time in between:

* forward: all-gather of ``n x in``, the layer's forward time, all-to-all of ``P n x out/P``;
* backward: all-to-all of the errors, the layer's backward time (this rank's fixed
  gradient rows), reduce-scatter of the ``P n x in`` input gradient when the input needs one.

The emulation's clock runs on deadlines (layer ``i`` ends at the pass start plus the profile's
time of layers ``0..i``), which would hide an exchange the compute must wait for; here the
layer's wait starts after its all-gather (all-to-all in backward), and a pass that ran late
moves the clock's start by as much, so the layers after it keep their own times.
"""

from __future__ import annotations

import time
import types
from typing import Any

import torch

from lowcomm.comm import accounting
from lowcomm.parallel.fc import ModelParallelLinear
from lowcomm.runtime.emulated import Emulation, _layer_forward


def _gather_rows(mp: ModelParallelLinear, n: int, like: torch.Tensor) -> None:
    comm = mp._comm
    x = like.new_zeros((n, mp.in_features))
    accounting.all_gather_into_tensor(
        x.new_empty((comm.world * n, mp.in_features)), x, group=comm.group, tag=f"{comm.tag}.fwd"
    )


def _exchange(mp: ModelParallelLinear, n: int, like: torch.Tensor, direction: str) -> None:
    comm = mp._comm
    send = like.new_zeros((comm.world * n, mp.rows))
    accounting.all_to_all_single(
        torch.empty_like(send), send, group=comm.group, tag=f"{comm.tag}.{direction}"
    )


class _EmulatedModelParallelFn(torch.autograd.Function):
    """The emulated layer ``i``: the model-parallel exchanges around profiled waits."""

    @staticmethod
    def forward(
        ctx: Any,
        act: torch.Tensor,
        emu: Emulation,
        i: int,
        mp: ModelParallelLinear,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.emu, ctx.i, ctx.mp, ctx.n = emu, i, mp, act.shape[0]
        like = params[0].detach()
        clock = emu.clock
        _gather_rows(mp, ctx.n, like)
        end = clock.forward_t0 + clock.forward_end[i]
        until = max(end, time.perf_counter() + clock.forward_s[i])
        clock._wait(clock.forward_s[i], lambda: until)
        _exchange(mp, ctx.n, like, "fwd")
        clock.forward_t0 += max(0.0, time.perf_counter() - end)  # later layers keep their own times
        return act.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        emu: Emulation = ctx.emu
        mp: ModelParallelLinear = ctx.mp
        i, n = ctx.i, ctx.n
        clock = emu.clock
        clock.start_backward()
        assert clock.backward_t0 is not None
        like = mp.weight.detach()
        _exchange(mp, n, like, "bwd")
        grads = []
        for src, out in zip(emu.grads[i], emu.grad_out[i]):
            out.copy_(src)
            grads.append(out.detach())
        end = clock.backward_t0 + clock.backward_end[i]
        until = max(end, time.perf_counter() + clock.backward_s[i])
        clock._wait(clock.backward_s[i], lambda: until)
        if ctx.needs_input_grad[0]:
            comm = mp._comm
            partial = like.new_zeros((comm.world * n, mp.in_features))
            accounting.reduce_scatter_tensor(
                partial.new_empty((n, mp.in_features)),
                partial,
                group=comm.group,
                tag=f"{comm.tag}.bwd",
            )
        clock.backward_t0 += max(0.0, time.perf_counter() - end)
        return (grad, None, None, None, *grads)


def emulate_model_parallel(emu: Emulation, old: torch.nn.Module, mp: ModelParallelLinear) -> None:
    """Put ``mp`` in the emulation in place of the Linear ``old`` it replaced: its fixed
    gradients become this rank's rows of the Linear's, its forward the exchange above (eval:
    the plain wait, no collective)."""
    i = next(k for k, m in enumerate(emu.modules) if m is old)
    rows = slice(mp.rank * mp.rows, (mp.rank + 1) * mp.rows)
    names = [n for n, _ in mp.named_parameters(recurse=False)]
    emu.modules[i] = mp
    emu.params[i] = names
    emu.grads[i] = [g[rows].clone() for g in emu.grads[i]]
    emu.grad_out[i] = [torch.empty_like(g) for g in emu.grads[i]]

    def forward(_self: ModelParallelLinear, act: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        if not mp.training:
            return _layer_forward(emu, i, act)
        out: torch.Tensor = _EmulatedModelParallelFn.apply(
            act, emu, i, mp, *(getattr(mp, n) for n in names)
        )
        return out

    mp.forward = types.MethodType(forward, mp)  # type: ignore[method-assign]

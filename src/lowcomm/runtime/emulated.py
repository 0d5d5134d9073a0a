"""Emulated compute (``--compute emulated:...``): each layer's forward and backward becomes a wait.

Why: on one machine, worker processes share the CPU with gloo's communication threads, so a
schedule that overlaps communication with compute has little compute to overlap with; on a GPU
cluster compute runs on the GPU and leaves the CPU to communication. To see what a GPU
cluster would see, the parameterized layers' forward and backward are replaced by waits of a
profile's ``forward_s`` / ``backward_s`` (:mod:`lowcomm.sim.profile`), while parameters,
gradients, compressors, collectives and the emulated network stay real.

How: the model keeps its module tree and parameters, so every method sees the same names,
shapes, module objects and gradient-ready order. Each layer module (a module owning trainable
parameters directly, as the profiler and the scheduling engine define it) gets a ``forward``
that runs :class:`_Layer`: it passes a ``(batch, 1)`` activation through, waits, and in
backward waits and returns a fixed gradient per parameter (seeded per rank and parameter, made
once, copied each step into memory kept for it). The model's ``forward`` becomes the chain of those layers in the
profile's forward order, called as modules (forward pre-hooks fire), ending in zero logits of
the real output's shape, so the loss, the method's hooks and the optimizer step run unchanged.

The waits keep a clock per pass: layer ``i`` sleeps until the pass start plus the profile's
time of layers ``0..i`` (backward: from the last layer down), so the copies of the gradient
buffers and the Python between layers are taken off the waits rather than added to them, as
a GPU runs ahead of the host that launches its kernels. Work a GPU would queue on the device
behind those kernels is not taken off: the hooks' compression (reported as device work through
:func:`lowcomm.runtime.timing.on_device_work`) delays the pass's remaining deadlines by its
duration, so it follows the emulated compute as on a GPU instead of filling the waits (without
this, host-side compression hid inside backward's waits and compressed methods ran below their
lower bound). Waits sleep (``time.sleep``), which releases the GIL and the CPU; on a CUDA device
they are ``torch.cuda._sleep`` on the stream, where compression kernels queue behind them anyway.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.runtime import timing
from lowcomm.sim.profile import LayerProfile, Profile
from lowcomm.sim.profiler import parameter_layers

__all__ = ["Emulation", "emulate", "emulation_of", "match_profile", "real_output_tail", "restore", "scaled"]

#: magnitude of the fixed gradients: small enough that SGD on them stays finite for many steps
GRAD_SCALE = 1e-3
_MARK = "_lowcomm_emulation"


def _shapes(params: list[nn.Parameter]) -> list[list[int]]:
    return [list(p.shape) for p in params]


def _mismatch(profile: Profile, model: nn.Module) -> str | None:
    """Why ``profile``'s layers are not ``model``'s (first difference), or None if they are."""
    have = {name: _shapes(params) for name, _, params in parameter_layers(model)}
    listed = {layer.name: layer for layer in profile.layers}
    for name, shapes in have.items():
        if name not in listed:
            some = ", ".join(list(listed)[:4])
            return (f"the model's layer {name!r} is not in the profile (it has {len(listed)} layers: "
                    f"{some}{', ...' if len(listed) > 4 else ''})")
        if listed[name].param_shapes != shapes:
            return (f"layer {name!r} has parameter shapes {shapes} in the model but "
                    f"{listed[name].param_shapes} in the profile")
    extra = [n for n in listed if n not in have]
    if extra:
        return f"the profile's layer {extra[0]!r} is not a parameterized layer of the model"
    return None


def match_profile(profile: Profile, model: nn.Module, *, where: str = "profile") -> Profile:
    """``profile``, or its ``factorized`` section (Pufferfish), whichever has ``model``'s layers
    (names and parameter shapes); else a UsageError naming the first mismatch."""
    why = _mismatch(profile, model)
    if why is None:
        return profile
    if profile.factorized is not None and _mismatch(profile.factorized, model) is None:
        return profile.factorized
    hint = ("" if profile.factorized is not None else "; a model-axis method (pufferfish) trains a factorized "
            "model: its profile needs a 'factorized' section (`lowcomm profile` writes one), or use emulated:scale=K")
    raise UsageError(f"--compute: {where} ({profile.model}) does not describe this model: {why}{hint}")


class _Clock:
    """The deadlines of one forward and one backward pass (seconds since each pass began)."""

    def __init__(self, layers: list[LayerProfile], device: torch.device) -> None:
        self.forward_end = list(_cumulative([lay.forward_s for lay in layers]))
        back = list(_cumulative([lay.backward_s for lay in reversed(layers)]))
        self.backward_end = back[::-1]  # layer i's gradient is ready this long after backward began
        self.forward_s = [lay.forward_s for lay in layers]
        self.backward_s = [lay.backward_s for lay in layers]
        self.cuda = device.type == "cuda"
        self.cycles_per_s = _cuda_cycles_per_s(device) if self.cuda else 0.0
        self.forward_t0 = 0.0
        self.forward_done = -1  # the last layer whose forward wait is over (this pass)
        self.backward_t0: float | None = None
        self._lock = threading.Lock()  # device work is reported from gloo's callback threads too

    def start_forward(self) -> None:
        with self._lock:
            self.forward_t0 = time.perf_counter()
            self.backward_t0 = None
            self.forward_done = -1

    def waited(self, until: float) -> None:
        """The host waited until ``until`` for a collective the next layer needs (an
        all-gather before its forward): that layer's compute starts no earlier, so the
        remaining forward deadlines move to follow it. Without this the layers after a long
        wait found their deadlines passed and took no time, hiding compute under the wait,
        which a GPU's stream cannot do. (CUDA: the stream waits by itself; no-op.)"""
        if self.cuda:
            return
        with self._lock:
            done = self.forward_end[self.forward_done] if self.forward_done >= 0 else 0.0
            self.forward_t0 = max(self.forward_t0, until - done)

    def start_backward(self) -> None:
        with self._lock:
            if self.backward_t0 is None:
                self.backward_t0 = time.perf_counter()

    def delay(self, seconds: float) -> None:
        """Device work of ``seconds`` was done on the host: push the current pass's remaining
        deadlines back by it (a CUDA stream serializes such kernels by itself: no-op there)."""
        if self.cuda or seconds <= 0:
            return
        with self._lock:
            self.forward_t0 += seconds
            if self.backward_t0 is not None:
                self.backward_t0 += seconds

    def forward_deadline(self, i: int) -> float:
        """When layer ``i``'s forward ends (host clock)."""
        with self._lock:
            return self.forward_t0 + self.forward_end[i]

    def backward_deadline(self, i: int) -> float:
        """When layer ``i``'s gradient is ready (host clock); starts the backward clock."""
        self.start_backward()
        with self._lock:
            assert self.backward_t0 is not None
            return self.backward_t0 + self.backward_end[i]

    def wait_forward(self, i: int) -> None:
        self._wait(self.forward_s[i], lambda: self.forward_deadline(i))
        with self._lock:
            self.forward_done = i

    def wait_backward(self, i: int) -> None:
        self._wait(self.backward_s[i], lambda: self.backward_deadline(i))

    def _wait(self, seconds: float, deadline: Callable[[], float]) -> None:
        if self.cuda:  # on the stream, like the kernels it stands for; no host clock to follow
            cycles = int(seconds * self.cycles_per_s)
            if cycles > 0:
                torch.cuda._sleep(cycles)
            return
        while (delay := deadline() - time.perf_counter()) > 0:  # re-read: device work may push it
            time.sleep(delay)


def _cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


def _cuda_cycles_per_s(device: torch.device) -> float:
    """GPU clock cycles per second of ``torch.cuda._sleep``, timed once with CUDA events."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(1e-6, start.elapsed_time(end) / 1e3)


class _Layer(torch.autograd.Function):
    """One layer: wait its forward time; in backward wait its backward time and return the
    layer's fixed gradients, copied into memory reused every step (methods may modify
    ``.grad`` in place; ``.grad`` is set to None between steps, so the memory is free again)."""

    @staticmethod
    def forward(ctx: Any, act: torch.Tensor, emu: Emulation, i: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.emu, ctx.i = emu, i
        emu.clock.wait_forward(i)
        return act.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        emu: Emulation = ctx.emu
        grads = []
        for src, out in zip(emu.grads[ctx.i], emu.grad_out[ctx.i]):
            out.copy_(src)  # the fixed values again (a method may have changed last step's in place)
            grads.append(out.detach())  # a new tensor on the same memory: autograd keeps it as .grad
        emu.clock.wait_backward(ctx.i)
        return (grad, None, None, *grads)


class _Head(torch.autograd.Function):
    """The logits: zeros of the real output's shape; its backward starts the backward clock."""

    @staticmethod
    def forward(ctx: Any, act: torch.Tensor, emu: Emulation, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.emu = emu
        return act.new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.emu.clock.start_backward()
        return grad.new_zeros((grad.shape[0], 1)), None, None


def _layer_forward(emu: Emulation, i: int, act: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    module = emu.modules[i]  # looked up per call: a wrapper (FSDP) may swap the parameters
    out: torch.Tensor = _Layer.apply(act, emu, i, *(getattr(module, n) for n in emu.params[i]))
    return out


def _chain_forward(emu: Emulation, x: Any, *_: Any, **__: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise UsageError("--compute emulated: the model's input must be one tensor")
    emu.clock.start_forward()
    act = torch.zeros((x.shape[0], 1), device=emu.device, dtype=torch.float32)
    for i, module in enumerate(emu.modules):
        act = _layer_forward(emu, i, act) if module is emu.root else module(act)
    out: torch.Tensor = _Head.apply(act, emu, emu.output_shape(x))
    return out


@dataclass
class Emulation:
    """What :func:`emulate` installed on one model (kept on it, for :func:`restore`)."""

    root: nn.Module
    profile: Profile
    modules: list[nn.Module]
    params: list[list[str]]  # per layer, the names of its parameters in its module
    grads: list[list[torch.Tensor]]
    #: per layer, the memory its gradients are written to every step (reused: a fresh tensor per
    #: step would pay the page faults of new memory, several times the copy itself on a CPU)
    grad_out: list[list[torch.Tensor]]
    device: torch.device
    clock: _Clock
    in_tail: tuple[int, ...]  # the input's shape past the batch dimension
    out_tail: tuple[int, ...]  # the real model's output shape past the batch, for that input
    #: unregisters the clock from the device-work reports (set by :func:`emulate`)
    stop_listening: Callable[[], None] = lambda: None

    def output_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The shape of the real model's output for input ``x``."""
        if tuple(x.shape[1:]) != self.in_tail:
            raise UsageError(f"--compute emulated: inputs of shape {tuple(x.shape[1:])} per sample, but the "
                             f"emulation was set up for {self.in_tail}")
        return (x.shape[0], *self.out_tail)


def _hookless_twin(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without any hooks (they may hold a method's state: an engine, a
    process group) and without the emulation's state."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for key, value in vars(m).items():
            if "hook" in key and isinstance(value, dict):
                memo[id(value)] = type(value)()
    if (mark := getattr(model, _MARK, None)) is not None:
        memo[id(mark)] = None
    twin = copy.deepcopy(model, memo)
    for m in twin.modules():
        m.__dict__.pop("forward", None)  # the real forwards (an emulated model's are instance attributes)
    twin.__dict__.pop(_MARK, None)
    return twin


def real_output_tail(model: nn.Module, example: torch.Tensor) -> tuple[int, ...]:
    """The real model's output shape past the batch dimension for a batch like ``example``,
    from a hookless copy on the meta device (no memory, no compute, the original untouched),
    else on the CPU with one sample."""
    probe = example[:1]
    for device in ("meta", "cpu"):
        try:
            twin = _hookless_twin(model).to(device).eval()
            with torch.no_grad():
                out = twin(probe.to(device))
        except (NotImplementedError, RuntimeError):
            continue
        if not isinstance(out, torch.Tensor):
            raise UsageError("--compute emulated needs a model whose forward returns one tensor "
                             f"(this one returns {type(out).__name__})")
        return tuple(out.shape[1:])
    raise UsageError("--compute emulated: the model's output shape could not be found (its forward "
                     "fails on one sample of the input)")


def _install(emu: Emulation) -> None:
    for i, module in enumerate(emu.modules):
        if module is not emu.root:
            module.forward = types.MethodType(lambda _self, act, *a, _i=i, **k: _layer_forward(emu, _i, act),
                                              module)
    emu.root.forward = types.MethodType(lambda _self, x, *a, **k: _chain_forward(emu, x), emu.root)


def emulation_of(model: nn.Module) -> Emulation | None:
    """What :func:`emulate` installed on ``model`` (None: real compute)."""
    mark: Emulation | None = getattr(model, _MARK, None)
    return mark


def restore(model: nn.Module) -> nn.Module:
    """``model`` with its real forwards back (a no-op on a model never emulated)."""
    mark: Emulation | None = getattr(model, _MARK, None)
    if mark is None:
        return model
    for module in [*mark.modules, mark.root]:
        module.__dict__.pop("forward", None)
    mark.stop_listening()
    model.__dict__.pop(_MARK, None)
    return model


def emulate(model: nn.Module, profile: Profile, example: torch.Tensor, *, rank: int = 0, seed: int = 0,
            where: str = "profile") -> nn.Module:
    """Make ``model``'s parameterized layers wait ``profile``'s times instead of computing
    (in place; returns ``model``). The profile must list the model's layers; ``example`` is
    an input batch (its shape only); the gradient of each parameter is fixed, seeded by
    ``seed``, ``rank`` and the parameter's index."""
    restore(model)
    profile = match_profile(profile, model, where=where)
    if not isinstance(example, torch.Tensor):
        raise UsageError("--compute emulated: the model's input must be one tensor")
    out_tail = real_output_tail(model, example)
    layers = {name: (module, params) for name, module, params in parameter_layers(model)}
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + rank * 7919) % 2**63)
    modules: list[nn.Module] = []
    params: list[list[str]] = []
    grads: list[list[torch.Tensor]] = []
    for layer in profile.layers:
        module, ps = layers[layer.name]
        modules.append(module)
        params.append([n for n, q in module.named_parameters(recurse=False) if any(q is p for p in ps)])
        grads.append([(torch.randn(p.shape, generator=gen) * GRAD_SCALE).to(device=device, dtype=p.dtype)
                      for p in ps])
    emu = Emulation(root=model, profile=profile, modules=modules, params=params, grads=grads,
                    grad_out=[[torch.empty_like(g) for g in gs] for gs in grads], device=device,
                    clock=_Clock(profile.layers, device), in_tail=tuple(example.shape[1:]), out_tail=out_tail)
    removers = (timing.on_device_work(_weak(emu.clock.delay)), timing.on_stream_wait(_weak(emu.clock.waited)))

    def stop_listening() -> None:
        for remove in removers:
            remove()

    emu.stop_listening = stop_listening
    object.__setattr__(model, _MARK, emu)
    _install(emu)
    return model


def _weak(method: Callable[[float], None]) -> Callable[[float], None]:
    """A listener that calls ``method`` while its object lives (a model dropped without
    :func:`restore` must not be kept alive by the process-wide device-work listeners)."""
    ref = weakref.WeakMethod(method)

    def listener(seconds: float) -> None:
        bound = ref()
        if bound is not None:
            bound(seconds)

    return listener


def scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with every layer's time divided by ``factor`` (its Pufferfish section too);
    ``optimizer_s`` stays: the emulation waits for layers only, the optimizer step is real."""
    if not (factor > 0 and math.isfinite(factor)):
        raise UsageError(f"--compute emulated:scale=K needs a finite K > 0, got {factor}")
    out = copy.deepcopy(profile)
    for prof in (out, out.factorized):
        if prof is None:
            continue
        for layer in prof.layers:
            layer.forward_s /= factor
            layer.backward_s /= factor
        prof.notes = (prof.notes + " " if prof.notes else "") + f"times divided by {factor:g}"
    return out

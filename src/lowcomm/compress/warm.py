"""Compile a codec's numba kernels before training, not inside its first compressed steps.

Why: numba compiles a kernel on its first call and caches it on disk (``cache=True``), so on a
machine that never ran lowcomm the first compressed steps of a codec with compiled CPU kernels
(:attr:`~lowcomm.compress.codec.Codec.compiled_kernels`) took seconds. Measured on the 2-vCPU
AMD EPYC VM with an empty cache (``make demo``, 4 workers compiling at once): Power-SGD's second
epoch 8.9 s instead of about 1.8, ACP-SGD's 13.8 s instead of about 1.5, which made their time to
accuracy 1.50x and 1.37x ``ssgd``'s where a warm cache gives about 2.4x. Training clocks the
steps, so a run must not pay the compiler inside them.

How: a blank copy of the codec (:meth:`~lowcomm.compress.codec.Codec.blank`: same class,
options, world, run length and momentum, none of the state) is driven through one full step
of each step kind (:func:`lowcomm.compress.steady.primed`) on the model's gradient shapes, each
distinct shape at most twice (the kernels are typed by dtype and layout, not size, and a pair
takes the paths that batch matrices of one shape). Once per process and codec configuration;
with a warm cache it loads the kernels and costs one such step.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Sequence

import torch

from lowcomm.compress import native
from lowcomm.compress.codec import Codec, Layout
from lowcomm.compress.steady import primed

_WARMED: set[tuple[str, str, bool]] = set()
_LOCK = threading.Lock()


def warm_shapes(shapes: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
    """``shapes`` in order with each distinct shape kept at most twice (empty ones dropped)."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for s in shapes:
        key = tuple(int(d) for d in s)
        if key and all(key) and seen.get(key, 0) < 2:
            seen[key] = seen.get(key, 0) + 1
            out.append(key)
    return out


def compile_kernels(codec: Codec, params: Iterable[torch.Tensor]) -> bool:
    """Run ``codec``'s compiled kernels once on a blank copy, on the shapes of ``params``'s
    trainable tensors, so numba compiles (or loads) them now. Returns whether it ran: not
    for parameters off the CPU (the kernels serve CPU tensors only), a codec without compiled
    kernels or none still to compress (a run shorter than its warm-up), numba missing, or a
    configuration this process already warmed."""
    params = [p for p in params if p.requires_grad]
    if not params or not codec.compiled_kernels or not codec.compresses:
        return False
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return False  # (the compiled paths take float32 CPU tensors only)
    if all(native.load(name) is None for name in codec.compiled_kernels):
        return False
    shapes = warm_shapes(p.shape for p in params)
    if not shapes:
        return False
    key = (type(codec).__name__, repr(codec.options), codec.momentum_factor != 0.0)
    with _LOCK:
        if key in _WARMED:
            return False
        _WARMED.add(key)
    names = [f"warm.{i}" for i in range(len(shapes))]
    layout = Layout.of(names, shapes, {n: i for i, n in enumerate(names)})
    x = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    try:
        primed(codec.blank(), x, layout, torch.ones((), dtype=torch.bool), codec.world)
    except Exception as exc:  # noqa: BLE001 - training must not fail for want of a head start
        warnings.warn(f"{codec.name}: its kernels could not be compiled before training "
                      f"({type(exc).__name__}: {exc}); the first compressed steps will compile them",
                      RuntimeWarning, stacklevel=2)
        return False
    return True

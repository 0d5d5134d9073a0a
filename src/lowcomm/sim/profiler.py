"""Measure a :class:`~lowcomm.sim.profile.Profile`: per-layer forward/backward times on one device.

A "layer" is a module owning parameters directly (tied parameters belong to the first owner
the forward pass reaches). Forward: a pre-hook stamps the moment each layer starts; a layer's
forward time runs until the next layer starts (the last one until the loss is computed), so
non-parameter work (activations, pooling, loss) is credited to the layer before it.
Backward: a post-accumulate-grad hook stamps when each layer's last gradient is ready; sorted
by that moment, each layer's backward time is the gap since the previous layer's gradients
were ready. That gap is what wait-free backpropagation can overlap, which is the quantity
the schedules need. Medians over ``iters`` timed iterations after ``warmup``.

Compression kernels are timed with plain tensor ops (:func:`measure_costs`), and every
registered codec's encode and decode per element too (:func:`measure_compressors`).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lowcomm.compress.codec import CODECS, Codec, Layout, Message, codec_class
from lowcomm.compress.feedback import finite_flag
from lowcomm.compress.steady import final_message, primed, received, step_offsets
from lowcomm.sim.hook_timing import measure_torch_hooks
from lowcomm.sim.profile import ComputeCosts, LayerProfile, Profile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _encode_as_trained(codec: Codec, buf: torch.Tensor, layout: Layout) -> Message:
    """What a transport does to a buffer before sending, all inside training's compression
    time: the buffer's finiteness flag (one read pass), the velocity (momentum correction, a
    no-op without it), then the first message."""
    finite = finite_flag(buf)
    codec.accumulate(buf, layout, finite)
    return codec.encode(buf, layout, finite)


def _timed(fn: Callable[[], Any], device: torch.device, reps: int = 5) -> float:
    fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def parameter_layers(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Modules owning trainable parameters directly, each parameter listed once."""
    seen: set[int] = set()
    out = []
    for name, mod in model.named_modules():
        params = [p for p in mod.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            out.append((name or type(mod).__name__, mod, params))
    return out


def profile_model(
    model: nn.Module,
    make_batch: Callable[[], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    model_name: str,
    batch_size: int,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    iters: int = 5,
    measure_kernels: bool = True,
) -> Profile:
    """Profile ``model`` on batches from ``make_batch() -> (inputs, targets)``."""
    device = torch.device(device)
    model = model.to(device).train()
    layers = parameter_layers(model)
    fwd_start: dict[str, float] = {}
    grad_ready: dict[str, float] = {}
    hooks = []

    def pre_hook(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if name not in fwd_start:
                _sync(device)
                fwd_start[name] = time.perf_counter()
        return hook

    def grad_hook(name: str) -> Callable[..., None]:
        def hook(_: Any) -> None:
            _sync(device)
            grad_ready[name] = time.perf_counter()
        return hook

    for name, mod, params in layers:
        hooks.append(mod.register_forward_pre_hook(pre_hook(name)))
        for p in params:
            hooks.append(p.register_post_accumulate_grad_hook(grad_hook(name)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    fwd: dict[str, list[float]] = {n: [] for n, _, _ in layers}
    bwd: dict[str, list[float]] = {n: [] for n, _, _ in layers}
    opt_times: list[float] = []
    order: list[str] = []
    try:
        for step in range(warmup + iters):
            x, y = make_batch()
            fwd_start.clear()
            grad_ready.clear()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            opt.step()
            _sync(device)
            t3 = time.perf_counter()
            if step == 0:
                order = sorted(fwd_start, key=fwd_start.__getitem__)
                order += [n for n, _, _ in layers if n not in fwd_start]
            if step < warmup:
                continue
            starts = [fwd_start.get(n, t1) for n in order]
            starts[0] = t0
            for k, n in enumerate(order):
                end = starts[k + 1] if k + 1 < len(order) else t1
                fwd[n].append(max(0.0, end - starts[k]))
            ready = sorted(order, key=lambda n: grad_ready.get(n, t2))
            prev = t1
            for n in ready:
                tr = grad_ready.get(n, t2)
                bwd[n].append(max(0.0, tr - prev))
                prev = tr
            bwd[ready[-1]][-1] += max(0.0, t2 - prev)  # tail after the last gradient
            opt_times.append(t3 - t2)
    finally:
        for h in hooks:
            h.remove()
    by_name = {n: params for n, _, params in layers}
    prof_layers = [
        LayerProfile(name=n, forward_s=statistics.median(fwd[n]), backward_s=statistics.median(bwd[n]),
                     param_shapes=[list(p.shape) for p in by_name[n]])
        for n in order
    ]
    return Profile(
        model=model_name,
        batch_size=batch_size,
        layers=prof_layers,
        device=str(device),
        optimizer_s=statistics.median(opt_times),
        costs=measure_costs(device) if measure_kernels else ComputeCosts(),
        compressors=measure_compressors(device, shapes=[s for lp in prof_layers for s in lp.param_shapes])
        if measure_kernels else {},
    )


def measure_optimizer_step(params: list[nn.Parameter], device: torch.device | str = "cpu") -> float:
    """Seconds of one SGD-with-momentum step over ``params`` (random gradients), the step
    :func:`profile_model` times: for a profile whose layer times come from elsewhere (a GPU
    profile file emulated here) the optimizer still runs for real on this machine."""
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-6, momentum=0.9)
    return _timed(opt.step, torch.device(device), reps=3)


def measure_costs(device: torch.device | str = "cpu", *, n: int = 1 << 21) -> ComputeCosts:
    """Per-element costs of the kernels compression is built from, timed on ``device``."""
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, generator=g).to(device)
    b = torch.randn(n, generator=g).to(device)
    elementwise = _timed(lambda: a.add_(b), device) / n
    m, k, r = 1024, 1024, 4
    mat = torch.randn(m, k, generator=g).to(device)
    q = torch.randn(k, r, generator=g).to(device)
    matmul = _timed(lambda: mat @ q, device) / (2 * m * k * r)
    tall = torch.randn(4096, r, generator=g).to(device)
    orth = _timed(lambda: torch.linalg.qr(tall, mode="reduced"), device) / tall.numel()
    kk = n // 100
    topk = _timed(lambda: torch.topk(a.abs(), kk, sorted=False), device) / n
    idx = torch.randint(0, n, (kk,), generator=g).to(device)
    vals = torch.randn(kk, generator=g).to(device)
    out = torch.zeros(n, device=device)
    scatter = _timed(lambda: out.index_add_(0, idx, vals), device) / kk
    return ComputeCosts(
        elementwise_s_per_elem=elementwise,
        matmul_s_per_flop=matmul,
        orthogonalize_s_per_elem=orth,
        topk_s_per_elem=topk,
        scatter_s_per_elem=scatter,
    )


def _encode_s(cls: type[Codec], x: torch.Tensor, layout: Layout, finite: torch.Tensor,
              device: torch.device, reps: int) -> float:
    """Median seconds of one encode as trained (velocity, then the first message), in the
    steady state, averaged over the codec's step kinds (:mod:`lowcomm.compress.steady`)."""
    codec = cls(world=4).as_trained()
    times = []
    for offset in step_offsets(codec):
        primed(codec, x, layout, finite, 4, offset)
        times.append(_timed(functools.partial(_encode_as_trained, codec, x.clone(), layout), device, reps))
    return statistics.mean(times)


def _decode_s(cls: type[Codec], x: torch.Tensor, layout: Layout, finite: torch.Tensor,
              world: int, device: torch.device, reps: int) -> tuple[float, str]:
    """Median seconds of one decode at ``world`` workers in the steady state (averaged over
    the codec's step kinds), and the final collective."""
    codec = cls(world=world).as_trained()
    times, collective = [], "none"
    for offset in step_offsets(codec):
        primed(codec, x, layout, finite, world, offset)
        samples = []
        for _ in range(reps + 1):
            buf = x.clone()
            msg = final_message(codec, buf, layout, finite, world)  # untimed: decode consumes it
            rec = received(msg, world)
            collective = msg.collective
            _sync(device)
            t0 = time.perf_counter()
            codec.decode(msg, rec, buf)  # into the buffer it encoded, as the DDP hook and the engine do
            finite_flag(buf)  # the result's finiteness, which both transports read per bucket
            _sync(device)
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples[1:]))
    return statistics.mean(times), collective


def measure_compressors(device: torch.device | str = "cpu", *, n: int = 1 << 20, reps: int = 3,
                        shapes: Sequence[Sequence[int]] | None = None,
                        before_each: Callable[[], Any] | None = None) -> dict[str, dict[str, float]]:
    """Encode/decode seconds per element of every registered codec (:data:`CODECS`), and
    the seconds of PyTorch's own hooks (:func:`~lowcomm.sim.hook_timing.measure_torch_hooks`).

    Why per codec and not per kernel: a codec's encode and decode are several kernels plus
    their state (error feedback, momentum, packing) and cost more than the constants of
    :func:`measure_costs` add up to. Measured on ``shapes`` (the model's own gradients, as
    :func:`profile_model` passes them) or else a synthetic buffer of ``n`` elements (one
    ``1024 x (n/1024 - 1)`` matrix and one vector, so low-rank codecs compress it). Why the
    model's shapes: the size sets where the codec's state lives (a 1 M-element buffer and its
    state stay in cache; ResNet-18's 11 M do not, and cost 20-50 % more per element on the
    2-vCPU Intel VM of 2026-11-28), and its tensors set the per-tensor work. With
    default options and fabricated peers (no process group), past the codec's warm-up and
    with one full step of each step kind done first (:mod:`lowcomm.compress.steady`: the
    low-rank codecs' factor tables filled). A codec whose final message is
    all-gathered decodes every worker's payload, so its decode is measured at 2 and 8
    workers and fitted as ``decode_s_per_elem + P * decode_s_per_elem_per_worker``.
    ``before_each``: called before each codec and before the hooks (several processes
    measuring at once keep in step with a barrier: :mod:`lowcomm.bench.compress_probe`).
    """
    device = torch.device(device)
    if not shapes or not any(math.prod(s) for s in shapes):
        cols = max(2, n // 1024)
        shapes = [(1024, cols - 1), (1024,)]
    names = [f"synthetic.{i}" for i in range(len(shapes))]
    layout = Layout.of(names, shapes, {nm: i for i, nm in enumerate(names)})
    numel = layout.numel
    x = torch.randn(numel, generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    out: dict[str, dict[str, float]] = {}
    for name in CODECS.names():
        if before_each is not None:
            before_each()
        cls = codec_class(name)
        enc = _encode_s(cls, x, layout, finite, device, reps)
        lo, collective = _decode_s(cls, x, layout, finite, 2, device, reps)
        entry = {"encode_s_per_elem": enc / numel}
        if collective == "all_gather":
            hi, _ = _decode_s(cls, x, layout, finite, 8, device, reps)
            per_worker = max(0.0, (hi - lo) / 6)
            entry["decode_s_per_elem"] = max(0.0, lo - 2 * per_worker) / numel
            entry["decode_s_per_elem_per_worker"] = per_worker / numel
        else:
            entry["decode_s_per_elem"] = lo / numel
        out[name] = entry
    if before_each is not None:
        before_each()
    out.update(measure_torch_hooks(shapes, device, reps=reps))  # PyTorch's own hooks, timed whole
    return out

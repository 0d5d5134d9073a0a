"""Measure a :class:`~lowcomm.sim.profile.Profile`: per-layer forward/backward times on one device.

A "layer" is a module owning parameters directly (tied parameters belong to the first owner
the forward pass reaches). Forward: a pre-hook stamps the moment each layer starts; a layer's
forward time runs until the next layer starts (the last one until the loss is computed), so
non-parameter work (activations, pooling, loss) is credited to the layer before it.
Backward: a post-accumulate-grad hook stamps when each layer's last gradient is ready; sorted
by that moment, each layer's backward time is the gap since the previous layer's gradients
were ready. That gap is what wait-free backpropagation can overlap, which is the quantity
the schedules need. Medians over ``iters`` timed iterations after ``warmup``.

Compression kernels are timed with plain tensor ops (:func:`measure_costs`), and, since
:mod:`lowcomm.compress` exists, each compressor's encode and decode per element too.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from lowcomm.sim.profile import ComputeCosts, LayerProfile, Profile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        compressors=measure_compressors(device) if measure_kernels else {},
    )


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


def measure_compressors(device: torch.device | str = "cpu", *, n: int = 1 << 20) -> dict[str, dict[str, float]]:
    """Encode/decode seconds per element of each :mod:`lowcomm.compress` compressor."""
    try:
        from lowcomm.compress import CastCompressor, MajoritySign, ScaledSign, TopK
    except ImportError:  # compressors not part of this build
        return {}
    device = torch.device(device)
    x = torch.randn(n, generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    compressors: dict[str, Any] = {
        "fp16": CastCompressor(torch.float16),
        "bf16": CastCompressor(torch.bfloat16),
        "signsgd": ScaledSign(),
        "signum": MajoritySign(),
        "topk": TopK(0.01),
    }
    out: dict[str, dict[str, float]] = {}
    for name, c in compressors.items():
        payload, ctx = c.compress(x, [n])
        enc = _timed(lambda c=c: c.compress(x, [n]), device)
        dec = _timed(lambda c=c, payload=payload, ctx=ctx: c.decompress(payload, ctx), device)
        out[name] = {"encode_s_per_elem": enc / n, "decode_s_per_elem": dec / n}
    return out

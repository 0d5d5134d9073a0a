"""What a bench row's method really trains and which compression kernels it runs.

The lower bound (:mod:`lowcomm.bench.bounds`) needs two facts per method that the method
spec alone does not show: the computation of the model it trains (Pufferfish trains a
factorized model: :meth:`~lowcomm.methods.base.Method.compute_reference` names the run that
measures it) and the codec its gradients go through, with the gradient shapes that codec sees
(the factors' shapes after a factorization), for the kernel bound
(:func:`lowcomm.bench.kernel_bound.compression_bound_s`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowcomm import methods
from lowcomm.methods.base import Method


def compute_reference(spec: str) -> str:
    """The spec of the run that measures ``spec``'s computation alone (``nocomm`` unless the
    method changes the model)."""
    return methods.create(spec).compute_reference()


def _inner(method: Method) -> Method:
    """The method that moves the gradients: a model-axis method's ``then`` method, or itself."""
    then = getattr(method.options, "then", None)
    if method.name == "pufferfish" and isinstance(then, str):
        from lowcomm.methods.pufferfish import _make_inner

        return _make_inner("then", then)
    return method


def codec_of(spec: str) -> tuple[str, dict[str, Any]] | None:
    """``(codec name, its options as a dict)`` of the codec ``spec``'s gradients go through, or
    None for methods that send plain (uncompressed, unencoded) gradients."""
    from lowcomm.compress.codec import CODECS

    method = _inner(methods.create(spec))
    opts = method.options
    if method.name in CODECS.names():
        return method.name, _as_dict(opts)
    from lowcomm.sim.schedules import make_schedule
    from lowcomm.sim.schedules.reference import HOOKS

    if method.name in HOOKS:  # PyTorch's own hooks: lowcomm's codec of the same payload
        plan = make_schedule(spec).codec
        return (plan.name, _as_dict(plan.options)) if plan is not None else None
    name = str(getattr(opts, "compress", "none") or "none").strip().lower()
    if name in ("", "none"):
        return None
    return name, _as_dict(getattr(opts, "codec_options", None))


def _as_dict(options: Any) -> dict[str, Any]:
    if options is None or not dataclasses.is_dataclass(options):
        return {}
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def trained_shapes(spec: str, model: str, *, model_kwargs: dict[str, Any] | None = None) -> list[tuple[int, ...]]:
    """Gradient shapes of the model ``spec`` trains (after its :meth:`prepare`, e.g. the
    factors of a Pufferfish model), built on the CPU from the same seed on every call."""
    import torch

    from lowcomm import models

    torch.manual_seed(0)
    net = models.create(model, **(model_kwargs or {}))
    method = methods.create(spec)
    if method.name == "pufferfish":
        net = method.prepare(net)
    return [tuple(p.shape) for p in net.parameters() if p.requires_grad]


def compression_bound_s(spec: str, shapes: list[tuple[int, ...]], *, world: int, bandwidth: float,
                        flops_per_s: float | None) -> float:
    """The least ``spec``'s compression kernels can take per step on this machine (0 without a
    codec): :func:`lowcomm.bench.kernel_bound.compression_bound_s` on the trained shapes."""
    from lowcomm.bench import kernel_bound

    codec = codec_of(spec)
    if codec is None:
        return 0.0
    name, options = codec
    return float(kernel_bound.compression_bound_s(name, shapes, world=world, bandwidth=bandwidth,
                                                  flops_per_s=flops_per_s, **options))


def machine_rates(threads: int | None, *, workers: int = 1, cpus: int | None = None) -> dict[str, Any]:
    """The kernel bound's denominators: the copy bandwidth (bytes/s, read + write) and the
    square fp32 matmul rate (FLOP/s, 1024 x 1024) one worker has, measured with the workers' threads.

    When ``workers`` processes of ``threads`` threads outnumber the ``cpus`` cores (this
    machine's by default), every worker runs its kernels while the others run theirs (they are
    in step), so no worker has one process's rates: the rates are then each process's share
    with all of them running at once (:func:`lowcomm.bench.compress_probe.measure_shared_rates`),
    never above one process's. The one-process rates stay under ``one_process``; if that
    measurement fails, the rates are one process's and ``shared_error`` says why."""
    import os

    import torch

    from lowcomm.bench import kernel_bound
    from lowcomm.bench.compress_probe import measure_shared_rates
    from lowcomm.sim.calibrate import core_share

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        alone = {"copy_bytes_per_s": kernel_bound.copy_bandwidth_bytes_per_s(),
                 "matmul_flops_per_s": kernel_bound.matmul_flops_per_s()}
    finally:
        torch.set_num_threads(before)
    if core_share(workers=workers, threads_per_worker=threads or 1, cpus=cpus or os.cpu_count() or 1) <= 1:
        return alone
    try:
        shared = measure_shared_rates(workers, threads=threads or 1)
    except RuntimeError as e:  # a probe process died or hung: the bound keeps one process's rates, and says so
        return {**alone, "shared_error": str(e)}
    return {**{k: min(v, shared[k]) for k, v in alone.items()}, "one_process": alone, "workers_at_once": workers}


def row_compression_bound_s(row: dict[str, Any], *, world: int, rates: dict[str, Any] | None) -> float | None:
    """The kernel bound of one bench row, from the shapes its workers trained (``grad_shapes``
    in their summary); None when unknown (the bound then uses the measured compression time)."""
    from lowcomm.errors import UsageError

    shapes = row.get("grad_shapes")
    if not rates or not shapes:
        return None
    try:
        return compression_bound_s(row.get("spec_run") or row["method"], [tuple(s) for s in shapes], world=world,
                                   bandwidth=rates["copy_bytes_per_s"], flops_per_s=rates["matmul_flops_per_s"])
    except UsageError:
        return None

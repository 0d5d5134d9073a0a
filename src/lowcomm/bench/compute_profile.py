"""Which compute profile a ``lowcomm bench`` run is predicted with, and how much CPU gloo takes.

Why apart from the harness: the harness runs methods and collects rows; choosing the
simulator's profile (measured here, a file's layer times under emulated compute, or this
machine's scaled by K) is a separate decision with its own rules, and the contention probe
is the real-compute side of the same question (what the workers' compute really costs here).
"""

from __future__ import annotations

from typing import Any

from lowcomm.bench import prediction
from lowcomm.bench.runner import BenchConfig
from lowcomm.errors import UsageError

__all__ = ["bench_profile", "compute_label", "gloo_contention"]


def compute_label(cfg: BenchConfig) -> str:
    """The workers' ``--compute`` (``real`` or ``emulated:<what>``), as every row records it."""
    given = getattr(cfg, "compute", None)
    if given:
        return str(given)
    args = cfg.extra_train_args
    labels = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--compute"]
    labels += [a.split("=", 1)[1] for a in args if a.startswith("--compute=")]
    return labels[-1] if labels else "real"


def bench_profile(cfg: BenchConfig) -> Any:
    """The simulator's profile of the bench's model, measured here with the workers' settings.

    With emulated compute the layer times are the emulation's (the profile file, or this
    measurement divided by K); the optimizer step and the compression costs stay this
    machine's, because they run for real."""
    if "--model-arg" in cfg.extra_train_args:
        raise UsageError("predictions do not support --model-arg yet (the profile would be of the default model)")
    from lowcomm.runtime.compute_spec import parse_compute

    spec = parse_compute(compute_label(cfg))
    if spec.kind in ("file", "name"):  # the layers' times are the file's: measure only what runs here
        return _emulated_file_profile(cfg, str(spec.path), spec.text)
    measured = prediction.measure(model=cfg.model, batch_size=cfg.batch_size, input_shape=cfg.input_shape,
                                  threads=cfg.threads)
    if not spec.emulated:
        return measured
    from lowcomm.runtime.emulated import scaled

    assert spec.scale is not None
    profile = scaled(measured, spec.scale)
    profile.notes = (profile.notes + "; " if profile.notes else "") + (
        f"compute emulated ({spec.text}): layer times emulated, optimizer and compression costs measured here")
    return profile


def _emulated_file_profile(cfg: BenchConfig, path: str, text: str) -> Any:
    """A profile file's layer times with this machine's optimizer step and compression costs
    (measured with the workers' threads: they run for real under emulated compute)."""
    import torch

    from lowcomm import models
    from lowcomm.sim.profile import Profile
    from lowcomm.sim.profiler import measure_compressors, measure_costs, measure_optimizer_step

    profile = Profile.load(path)
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or before)
    try:
        shape = tuple(int(v) for v in cfg.input_shape.split(",")) if cfg.input_shape else None
        kwargs = models.kwargs_for_data(cfg.model, input_shape=shape) if shape else {}
        params = [p for p in models.create(cfg.model, **kwargs).parameters() if p.requires_grad]
        profile.optimizer_s = measure_optimizer_step(params)
        profile.costs = measure_costs("cpu")
        profile.compressors = measure_compressors("cpu", shapes=[list(p.shape) for p in params])
    finally:
        torch.set_num_threads(before)
    profile.notes = (profile.notes + "; " if profile.notes else "") + (
        f"compute emulated ({text}): layer times from the file, optimizer and compression costs measured here")
    return profile


def gloo_contention(cfg: BenchConfig, cluster: Any = None) -> dict[str, float]:
    """Seconds of compute gloo's threads take per wire byte and, at least, per collective
    (``cpu_s_per_wire_byte``, ``cpu_s_per_collective``) with the bench's workers and threads,
    measured on ``cluster``'s emulated links (None: loopback), where the bench's methods run."""
    from lowcomm.bench.contention import measure_contention

    res = measure_contention(cfg.nproc, threads=cfg.threads or 1, cluster=cluster)
    return {k: float(res[k]) for k in ("cpu_s_per_wire_byte", "cpu_s_per_collective")}

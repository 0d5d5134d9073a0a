"""The per-method lower bound and the derived columns of a bench row (pure arithmetic).

Why a lower bound: an iteration time alone does not say whether a method is slow because it
sends too much or because it is implemented badly. With perfect overlap, an iteration cannot
be faster than the compute it needs nor than pushing its bytes through the link at the
measured bandwidth; compression work cannot overlap either, so it adds on top::

    lower_bound = max(compute_as_trained, wire_bytes * 8 / bandwidth) + compression_bound

* ``compute_as_trained`` is the compute-only time of the model the method really trains: the
  ``nocomm`` run for methods that keep the model, and the method's own
  :meth:`~lowcomm.methods.base.Method.compute_reference` run (e.g. Pufferfish's factorized
  model with no communication) for model-axis methods. A factorized model computes in less
  time than the full one, so the full model's ``nocomm`` time would put the bound above a
  correct run.
* ``compression_bound`` is the least the method's kernels can cost on this machine
  (:func:`lowcomm.bench.kernel_bound.compression_bound_s`: the bytes the encode, the
  aggregate/decode of the workers' payloads and the error-feedback update must read and write,
  at the measured copy bandwidth, or the low-rank matmuls' FLOPs at the measured matmul rate),
  not the method's own measured compression time: a bound that adds a slow kernel's own time
  flatters the slow kernel. The rates are one worker's: when the workers outnumber the
  machine's cores they run their kernels at the same moments, each on its share of the cores
  and the memory bus, so the rates are then measured with every worker's process at once
  (:func:`lowcomm.bench.trained.machine_rates`; ``compress_bound_one_process_s`` keeps the
  bound at one process's rates).

Both older terms stay in the row for comparison (``compute_only_full_model_s``,
``compress_s``, ``lower_bound_measured_compress_s``). A row below its bound is a bug in the
bound or the measurement, to be found, not load to be blamed.

On emulated nodes of G workers the shaped link is the node's, shared by its G workers, and
what crosses it is G times the inter-node bytes one worker sends (the accounting ledger's
``inter_node_bytes_per_worker_per_iter``); intra-node bytes stay on loopback. The wire term
uses those bytes then.

This bound ignores what a schedule can overlap: a method that never overlaps its forward
with communication cannot reach it. Each method's own limit, its schedule on an ideal link,
is ``schedule_bound_s`` (:mod:`lowcomm.bench.schedule_bound`).
"""

from __future__ import annotations

from typing import Any


def wire_time_s(bytes_per_iter: float, bits_per_s: float) -> float:
    """Seconds to push ``bytes_per_iter`` through a link of ``bits_per_s``."""
    if bits_per_s <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bits_per_s}")
    return bytes_per_iter * 8.0 / bits_per_s


def lower_bound_s(*, compute_only_s: float, bytes_per_iter: float, bits_per_s: float, compress_s: float = 0.0) -> float:
    """``max(compute_only, wire time) + compress`` (see module docstring)."""
    return max(compute_only_s, wire_time_s(bytes_per_iter, bits_per_s)) + max(compress_s, 0.0)


def derive(
    run: dict[str, Any],
    *,
    batch_size: int,
    world_size: int,
    bits_per_s: float | None,
    compute_only_s: float | None,
    ssgd_iter_s: float | None,
    nproc_per_node: int = 1,
    compress_bound_s: float | None = None,
    compute_full_model_s: float | None = None,
) -> dict[str, Any]:
    """Fill ``samples_per_s``, ``speedup_vs_ssgd``, ``wire_time_s``, ``lower_bound_s`` and
    ``bound_ratio`` (iteration time / lower bound, 1.0 = at the limit) of a successful run.

    ``compute_only_s`` is the compute of the model as trained; ``compress_bound_s`` the
    kernels' bound (None: the run's own measured compression time is used, and the row says
    so in ``bound_compress_source``); ``compute_full_model_s`` the ``nocomm`` time, kept beside.
    """
    it = run.get("iter_time_s_median")
    out = dict(run)
    if not it:
        return out
    out["samples_per_s"] = batch_size * world_size / it
    out["speedup_vs_ssgd"] = ssgd_iter_s / it if ssgd_iter_s else None
    measured = float((run.get("breakdown_s") or {}).get("compress", 0.0))
    out["compress_s"] = measured
    out["compress_bound_s"] = compress_bound_s
    compress = measured if compress_bound_s is None else compress_bound_s
    out["bound_compress_source"] = "measured" if compress_bound_s is None else "kernel bound"
    b = run.get("bytes_per_worker_per_iter")
    inter = run.get("inter_node_bytes_per_worker_per_iter")
    if nproc_per_node > 1:  # the node link carries its G workers' inter-node bytes (module docstring)
        b = None if inter is None else inter * nproc_per_node
    if bits_per_s and b is not None:
        out["wire_time_s"] = wire_time_s(b, bits_per_s)
        if compute_only_s is not None:
            lb = lower_bound_s(compute_only_s=compute_only_s, bytes_per_iter=b, bits_per_s=bits_per_s, compress_s=compress)
            out["lower_bound_s"] = lb
            out["bound_ratio"] = it / lb if lb > 0 else None
            full = compute_full_model_s if compute_full_model_s is not None else compute_only_s
            out["lower_bound_measured_compress_s"] = lower_bound_s(
                compute_only_s=full, bytes_per_iter=b, bits_per_s=bits_per_s, compress_s=measured)
    out.setdefault("lower_bound_s", None)
    out["compute_only_s"] = compute_only_s
    out["compute_only_full_model_s"] = compute_full_model_s if compute_full_model_s is not None else compute_only_s
    return out

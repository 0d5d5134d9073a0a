"""The JSON summary of a finished run (``--json``), rank 0's report of what was measured.

Why apart from the loop: its keys are an interface (the benchmark harness, the docs and the
tests read them) and must not move when the loop changes.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lowcomm.comm import accounting

if TYPE_CHECKING:
    from lowcomm.runtime.trainer import Trainer


def summary(t: Trainer) -> dict[str, Any]:
    """Timing medians (the first ``warmup_steps`` steps left out), bytes, accuracy and the
    effective settings of trainer ``t``'s run."""
    skip = min(t.warmup_steps, max(0, len(t.step_times) - 1))
    times = t.step_times[skip:]
    bytes_iter = t.step_bytes[skip:]
    led = accounting.ledger()
    topo = accounting.topology()
    iter_median = float(np.median(times)) if times else 0.0
    last = t.history[-1] if t.history else {}
    result: dict[str, Any] = {
        "method": t.cfg.method,
        "world_size": t.dist.world_size,
        "model": t.cfg.model,
        "data": t.cfg.data,
        "synthetic": bool(t.bundle.synthetic),
        "epochs": t.epochs,
        "steps": t.step,
        "batch_size": t.cfg.batch_size,
        # effective settings, after any method override (e.g. signum turns momentum off)
        "optimizer": {"name": t.cfg.optimizer, "lr": t.cfg.lr,
                      "momentum": t.cfg.momentum, "weight_decay": t.cfg.weight_decay,
                      "kfac": t.cfg.kfac},  # K-FAC's settings in front of the base (None: off)
        "amp": t.cfg.amp,
        "params": sum(math.prod(full_shape(p, t.dist.world_size)) for p in t.raw.parameters()),
        # the model as trained (factorized after a Pufferfish switch): the bench's kernel bound
        "grad_shapes": [full_shape(p, t.dist.world_size) for p in t.raw.parameters() if p.requires_grad],
        "params_initial": t.params_before,
        "bytes_sent_per_worker": led.wire_bytes,
        "bytes_per_worker_per_iter": float(np.median(bytes_iter)) if bytes_iter else 0.0,
        # the part on inter-node links (lowcomm.comm.accounting's link classes; 0 on one node)
        "inter_node_bytes_per_worker_per_iter": (float(np.median(t.step_inter_bytes[skip:]))
                                                 if t.step_inter_bytes[skip:] else 0.0),
        "gpus_per_node": topo.local_size if topo is not None else t.dist.world_size,
        "iter_time_s_median": iter_median,
        "measured_tx_bytes_per_iter": float(np.median(t.step_tx[skip:])) if t.step_tx[skip:] else None,
        "samples_per_s": t.cfg.batch_size * t.dist.world_size / iter_median if iter_median else 0.0,
        "breakdown_s": t.timer.medians(skip),
        "timed_steps": len(times),
        "threads": torch.get_num_threads(),
        "device": str(t.dist.device),
        "method_info": t.method.describe(),
        "traffic": led.as_dict(),
        "history": t.history,
    }
    compute = getattr(t, "compute", None)  # --compute: "real" or "emulated:<what>" (+ its profile)
    result.update(compute.summary() if compute is not None else {"compute": "real"})
    if t.task == "classification":
        result["final_test_accuracy"] = last.get("test_accuracy")
    elif t.task == "stereo":
        result["final_test_metric"] = last.get("test_epe")
        result["metric_name"] = "epe"
        result["final_test_d1"] = last.get("test_d1")
    else:
        result["final_test_metric"] = last.get("test_perplexity")
        result["metric_name"] = "perplexity"
    if t.bundle.synthetic:
        result["note"] = "synthetic data: timing only"
    return result


def full_shape(p: torch.Tensor, world: int) -> list[int]:
    """The shape of the whole parameter: a model-parallel partition (lee18's FC layers, each
    rank's rows) counts as all ranks' rows, so a run's parameter count is the model's."""
    from lowcomm.parallel.fc import is_model_parallel_param

    shape = list(p.shape)
    return [shape[0] * world, *shape[1:]] if is_model_parallel_param(p) and shape else shape

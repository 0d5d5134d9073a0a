"""The update axis: how synchronized gradients become new weights.

What lives here (imported lazily, so ``import lowcomm.optim`` stays cheap: no torch until a
name is used):

* optimizers built from the training config (:func:`build_optimizer`, :func:`param_groups`)
  and the settings a method may ask for (:func:`apply_method_overrides`);
* per-step LR schedules (:func:`lr_factor`, :func:`build_scheduler`: constant, step,
  multistep, cosine, poly, each after an optional linear warm-up) and a method's
  temporary LR ramp (:class:`Rewarmup`, Pufferfish's re-warm-up after its switch);
* gradient regularizers applied before the step (:func:`frobenius_decay_`);
* the shard-aware step used by the ``dear`` and ``lee18`` schedules (``lowcomm.optim.sharded``);
* K-FAC, the distributed Kronecker-factored preconditioner (:class:`KFAC`, the
  ``lowcomm.optim.kfac`` package; ``lowcomm train --optimizer kfac[:key=value,...]`` is parsed
  by ``lowcomm.optim.kfac_spec``; docs/kfac.md).

* layer-wise adaptive optimizers for large global batches: :class:`LARS` (and
  :class:`LARSWrapper`, its trust ratio in front of any torch optimizer) and :class:`LAMB`,
  on torch's multi-tensor kernels (``lowcomm.optim.lars``, ``lowcomm.optim.lamb``;
  ``lowcomm train --optimizer lars[:key=value,...]``; docs/largebatch.md), with the
  ``poly`` schedule (:func:`poly_factor`) for their warm-up + polynomial decay.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module of this package that defines it.
EXPORTS: dict[str, str] = {
    # optimizer builders
    "OPTIMIZER_FACTORIES": "builders",
    "apply_method_overrides": "builders",
    "build_optimizer": "builders",
    "param_groups": "builders",
    # LR schedules and re-warm-up
    "LRMultiplier": "schedules",
    "Rewarmup": "schedules",
    "build_scheduler": "schedules",
    "lr_factor": "schedules",
    # regularizers
    "frobenius_decay_": "decay",
    # shard-aware step (dear, lee18)
    "FlatShard": "sharded",
    "ShardedOptimizer": "sharded",
    "hyperparameters": "sharded",
    "step_subset": "sharded",
    # second-order preconditioning (K-FAC: the lowcomm.optim.kfac package)
    "KFAC": "kfac",
    # layer-wise adaptive optimizers (large batches; docs/largebatch.md)
    "LARS": "lars",
    "LARSWrapper": "lars",
    "LAMB": "lamb",
    "trust_ratios": "adaptive",
    "poly_factor": "schedules",
}

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the defining module on first access (PEP 562); other names are errors."""
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))

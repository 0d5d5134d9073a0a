"""Federated-learning simulation (Parrot-style): many stateful clients on a few worker processes.

``lowcomm fl`` (docs/fl.md) runs it; the public names for writing an algorithm
(docs/fl_api.md) are loaded on first use, so that the launcher, which imports this package,
stays free of torch.
"""

from __future__ import annotations

from lowcomm.registry import lazy_exports


#: public name -> the module that defines it
_EXPORTS = {
    "Algorithm": "lowcomm.fl.api", "ClientContext": "lowcomm.fl.api", "LocalTraining": "lowcomm.fl.api",
    "register_algorithm": "lowcomm.fl.algorithms", "create_algorithm": "lowcomm.fl.algorithms",
    "algorithm_names": "lowcomm.fl.algorithms", "local_sgd": "lowcomm.fl.local",
    "GradientCorrection": "lowcomm.fl.local", "ClientStateStore": "lowcomm.fl.store",
    "make_partition": "lowcomm.fl.partition", "sample_clients": "lowcomm.fl.partition",
    "Scheduler": "lowcomm.fl.schedule", "FLConfig": "lowcomm.fl.config", "run_fl": "lowcomm.fl.runner",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)

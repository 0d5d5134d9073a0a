"""lowcomm: communication-efficient distributed deep-learning training on PyTorch.

``import lowcomm`` is cheap (it does not import torch), yet ``lowcomm.hooks.register(...)``,
``lowcomm.lowrank.factorize(...)``, ``lowcomm.models.create(...)`` work right after it: the
public subpackages are imported on first attribute access (PEP 562 ``__getattr__``). That
keeps ``lowcomm --help`` and the CLI's one-line usage errors fast, while what a user types
first after ``import lowcomm`` works.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__version__ = "0.1.0"

#: Public subpackages and modules, imported lazily on first use.
SUBMODULES: frozenset[str] = frozenset({
    "bench",      # emulated cluster (netns + tc), benchmark harness, reports
    "comm",       # byte accounting of every collective, DDP comm hooks
    "compress",   # payload axis: compressors, error feedback (pure tensor math)
    "data",       # dataset registry: lowcomm.data.create(name, ...)
    "elastic",    # elastic supernets: progressive shrinking, latency-constrained search
    "errors",     # UsageError and argument checks
    "fl",         # federated simulation: lowcomm fl, algorithms, client state store
    "hooks",      # lowcomm.hooks.register(ddp_model, method, **options)
    "lowrank",    # model axis: lowcomm.lowrank.factorize(model, ...)
    "methods",    # the --method registry: lowcomm.methods.create("acpsgd:rank=4")
    "models",     # model registry: lowcomm.models.create(name, ...)
    "optim",      # update axis: optimizer builders, LR schedules, shard-aware step
    "runtime",    # launcher, trainer, checkpoints
    "sched",      # schedule axis: WFBP, MG-WFBP, DeAR, Lee et al. 2018
    "sim",        # alpha-beta simulator, profiles, advisor
    "split",      # split fine-tuning: lowcomm split, SplitModel, BERT loaders
    "testing",    # @distributed-style helpers for tests of collective code
})

__all__ = ["__version__", *sorted(SUBMODULES)]


def __getattr__(name: str) -> ModuleType:
    """Import ``lowcomm.<name>`` on first access (PEP 562); other names are errors."""
    if name in SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module  # later accesses skip this function
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy subpackages too, so tab completion and ``dir(lowcomm)`` show them."""
    return sorted(set(globals()) | SUBMODULES)

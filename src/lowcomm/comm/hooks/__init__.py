"""DDP comm hooks for gradient compression (schedule side of the payload axis).

:data:`HOOKS` maps a method name to its hook-state class; each class carries its
``Options`` dataclass and its aggregation kind. Use :func:`lowcomm.hooks.register`.
"""

from __future__ import annotations

from lowcomm.comm.hooks.gtopk import GTopKHook
from lowcomm.comm.hooks.lowrank import ACPSGDHook, PowerSGDHook
from lowcomm.comm.hooks.simple import BF16Hook, FP16Hook, SignSGDHook, SignumHook, SSGDHook, TopKHook
from lowcomm.comm.hooks.state import HookState, run_hook

HOOKS: dict[str, type[HookState]] = {
    cls.name: cls
    for cls in (
        SSGDHook,
        FP16Hook,
        BF16Hook,
        SignSGDHook,
        SignumHook,
        TopKHook,
        GTopKHook,
        PowerSGDHook,
        ACPSGDHook,
    )
}

__all__ = ["HOOKS", "HookState", "run_hook"]

"""The module a scheduling-engine method hands back from ``wrap`` (the engine's DDP-like face).

Why a module at all: the engine needs a stamp right before and after each forward (buffer
broadcast, the backward clock for MG-WFBP's profile) and users expect a wrapped model with
``.module``, as DDP gives them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lowcomm.sched.engine import Engine


class ScheduledModule(nn.Module):
    """What ``method.wrap`` returns: calls the model; the engine's hooks do the rest.

    Like DDP, the model is available as ``.module`` (state-dict keys get a ``module.`` prefix).
    """

    engine: Engine

    def __init__(self, module: nn.Module, engine: Engine) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "engine", engine)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward with the engine's buffer broadcast before and its timing stamp after."""
        self.engine.before_forward()
        out = self.module(*args, **kwargs)
        self.engine.after_forward()
        return out

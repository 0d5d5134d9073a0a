"""``--compute real|emulated:PROFILE|emulated:scale=K``: what the flag says, parsed without torch.

Why apart from :mod:`lowcomm.runtime.emulated`: ``lowcomm train`` and ``lowcomm bench`` refuse
a bad value in one line before any worker starts, and their usage errors stay fast.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from lowcomm.errors import UsageError

VALID = "real, emulated:PROFILE.json, emulated:NAME (a shipped profile) or emulated:scale=K"


@dataclass(frozen=True)
class ComputeSpec:
    """One ``--compute`` value: ``kind`` is ``real``, ``file``, ``name`` or ``scale``."""

    text: str
    kind: str
    path: str | None = None
    scale: float | None = None

    @property
    def emulated(self) -> bool:
        """Layers wait a profile's times instead of computing."""
        return self.kind != "real"

    @property
    def label(self) -> str:
        """``real`` or ``emulated:<what>``, as summaries and bench rows record it."""
        return self.text


def parse_compute(text: str | None) -> ComputeSpec:
    """Parse (and check) a ``--compute`` value; a bad one is a one-line UsageError."""
    text = (text or "real").strip()
    if text == "real":
        return ComputeSpec("real", "real")
    head, sep, what = text.partition(":")
    if head != "emulated" or not sep or not what:
        raise UsageError(f"--compute {text!r} is not valid; valid: {VALID}")
    if what.startswith("scale="):
        try:
            factor = float(what[len("scale="):])
        except ValueError:
            factor = math.nan
        if not (factor > 0 and math.isfinite(factor)):
            raise UsageError(f"--compute {text!r}: scale=K needs a finite number K > 0 (e.g. emulated:scale=20)")
        return ComputeSpec(text, "scale", scale=factor)
    if what.endswith(".json") or os.sep in what or os.path.exists(what):
        if not os.path.isfile(what):
            raise UsageError(f"--compute {text!r}: profile file {what!r} does not exist "
                             "(make one with `lowcomm profile`)")
        return ComputeSpec(text, "file", path=os.path.abspath(what))
    return ComputeSpec(text, "name", path=resolve_name(what, text))


def resolve_name(name: str, text: str) -> str:
    """The file of shipped profile ``name`` (``lowcomm.sim.profile.resolve_profile``)."""
    from lowcomm.sim import profile as profile_mod

    resolve = getattr(profile_mod, "resolve_profile", None)
    if resolve is None:
        raise UsageError(f"--compute {text!r}: no shipped profiles in this build; give a profile file "
                         "(emulated:PATH.json, from `lowcomm profile`) or emulated:scale=K")
    return str(resolve(name))

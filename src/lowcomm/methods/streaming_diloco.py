"""``streaming_diloco``: DiLoCo with the model split into fragments whose syncs are staggered
across the period and overlapped with the following inner steps.

(Douillard et al., "Streaming DiLoCo with overlapping communication", 2025.) The model's
layers are cut into ``fragments`` (F) contiguous groups of about equal size
(:func:`lowcomm.methods.outer_sync.split_fragments`; the paper also tries strided groups).
Fragment ``f`` is synced at the inner steps ``t`` with ``t mod H == f*H//F`` (H =
``sync_every``), so each fragment still syncs once per period, but the peak traffic is
``1/F`` of DiLoCo's. Its pseudo-gradient is formed and its all-reduce started at step ``t``,
and the inner steps go on; the result is waited for and merged after step ``t + delay``
(the paper's tau, default 1): the outer Nesterov step updates the fragment's global copy,
then the local fragment, which trained ``delay`` more steps meanwhile, is *mixed* with it:
``local <- alpha * local + (1 - alpha) * global`` (the paper's merge; ``alpha=0.5`` default,
the value the paper recommends; ``alpha=0`` discards the ``delay`` local steps). ``delay=0``
and ``fragments=1`` is exactly ``diloco``. ``compress=`` quantizes or sparsifies the
pseudo-gradients as for ``diloco`` (the paper uses 4-bit floats; ``fp16``/``bf16`` here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lowcomm.errors import UsageError
from lowcomm.methods import register
from lowcomm.methods.localsgd import DiLoCoOptions, OuterMethod


@dataclass
class StreamingDiLoCoOptions(DiLoCoOptions):
    """DiLoCo's options plus the fragments, the overlap (``delay`` inner steps) and the merge."""

    fragments: int = 2
    delay: int = 1
    alpha: float = 0.5

    method_name: ClassVar[str] = "streaming_diloco"

    def __post_init__(self) -> None:
        super().__post_init__()
        m = self.method_name
        if isinstance(self.fragments, bool) or not 1 <= self.fragments <= self.sync_every:
            raise UsageError(
                f"option fragments={self.fragments} of method {m!r} must be in 1..sync_every "
                f"(= {self.sync_every}): each fragment syncs at its own step of the period"
            )
        if isinstance(self.delay, bool) or not 0 <= self.delay < self.sync_every:
            raise UsageError(
                f"option delay={self.delay} of method {m!r} must be in 0..sync_every-1 "
                f"(= {self.sync_every - 1}) inner steps"
            )
        if not 0 <= self.alpha < 1:
            raise UsageError(
                f"option alpha={self.alpha} of method {m!r} must be in [0, 1) "
                "(the local weights' share in the merge)"
            )


@register
class StreamingDiLoCo(OuterMethod):
    """Streaming DiLoCo: staggered fragment syncs, overlapped with ``delay`` inner steps."""

    name = "streaming_diloco"
    Options = StreamingDiLoCoOptions

    def fragment_count(self) -> int:
        """``fragments``."""
        return int(self.options.fragments)

    def delay(self) -> int:
        """``delay`` (tau)."""
        return int(self.options.delay)

    def sync_kwargs(self) -> dict[str, Any]:
        """DiLoCo's settings plus the merge's ``alpha``."""
        return {**super().sync_kwargs(), "alpha": float(self.options.alpha)}

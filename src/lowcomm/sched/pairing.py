"""Which compressor each engine schedule can carry, derived only from the codecs' declarations.

Why one function: the engine methods refuse a pair with it, and the composition matrix
(``docs/composition.md``) prints its text, so the reason a user reads and the table cannot
disagree. Nothing here names a compressor; a new codec is placed by what it declares
(:class:`~lowcomm.compress.codec.Codec`'s ``aggregation``, ``elementwise``, ``multi_round``):

* ``allreduce`` mode (``wfbp``, ``mgwfbp``) carries every codec: a ``SUM`` payload is
  all-reduced, a ``GATHER`` payload is all-gathered (or exchanged in the codec's
  point-to-point rounds) per fused group, pipelined with backward;
* ``dear`` carries single-round ``SUM`` codecs (the message is reduce-scattered in backward
  and all-gathered before the next forward) and ``GATHER`` codecs (exchanged in backward,
  decoded to the full mean); a multi-round ``SUM`` codec is refused;
* ``lee18`` (``shard`` mode) carries ``elementwise`` ``SUM`` codecs (reduce-scatter the
  message, decode only this rank's slice) and ``GATHER`` codecs (decode the full mean, keep
  the slice); any other ``SUM`` codec is refused;
* a schedule whose method class sets ``sums_only`` (``hier``: its point is to run the
  all-reduce hierarchically) carries only ``SUM`` codecs (:func:`sum_only_refusal`).
"""

from __future__ import annotations

from enum import Enum

from lowcomm.compress.codec import CODECS, Aggregation, Codec, codec_class


class Mode(str, Enum):
    """How the engine synchronizes and updates (see :mod:`lowcomm.sched.engine`)."""

    ALLREDUCE = "allreduce"
    DEAR = "dear"
    SHARD = "shard"


def _schedule_mode(schedule: str) -> Mode:
    from lowcomm import methods

    mode = getattr(methods.method_class(schedule), "mode", None)
    if not isinstance(mode, Mode):
        raise ValueError(f"{schedule!r} is not a scheduling-engine method (wfbp, mgwfbp, dear, lee18)")
    return mode


def sum_only_refusal(schedule: str, codec: type[Codec]) -> str | None:
    """The refusal text of a ``sums_only`` schedule for ``codec``, or None for a ``SUM`` codec."""
    if codec.aggregation is Aggregation.SUM:
        return None
    return (
        f"{schedule} cannot carry compress={codec.name}: {codec.name}'s payloads are gathered (each "
        "decoded on its own), not summed, so there is no all-reduce to run hierarchically; use "
        f"method 'hitopk' (hierarchical top-k) or 'wfbp:compress={codec.name}'"
    )


def carries(mode: Mode, codec: type[Codec]) -> bool:
    """Whether an engine in ``mode`` can carry ``codec`` (the rule of the module doc)."""
    if codec.aggregation is Aggregation.GATHER or mode is Mode.ALLREDUCE:
        return True
    if mode is Mode.DEAR:
        return not codec.multi_round
    return codec.elementwise


def _working(schedule: str, mode: Mode, aggregation: Aggregation) -> str:
    """Codecs of ``aggregation`` this schedule does carry, as ``'schedule:compress=name'``."""
    return ", ".join(f"'{schedule}:compress={n}'" for n in CODECS.names()
                     if codec_class(n).aggregation is aggregation and carries(mode, codec_class(n))) or "none"


def mode_refusal(mode: Mode, schedule: str, codec: type[Codec]) -> str | None:
    """The refusal text for carrying ``codec`` in an engine of ``mode`` (named ``schedule``
    in the text), or None when the pair works."""
    name = codec.name
    if carries(mode, codec):
        return None
    if mode is Mode.DEAR:
        return (
            f"dear cannot carry compress={name}: {name} is multi-round (its next message needs "
            "the complete sum of the previous one, e.g. a second factor computed from the complete "
            "summed first), so the reduce-scatter would have to be followed by an all-gather inside "
            "backward (an all-reduce in two halves, nothing left to defer); use a single-round "
            f"codec with dear ({_working('dear', Mode.DEAR, codec.aggregation)}) or 'wfbp:compress={name}'"
        )
    alt = f"'dear:compress={name}' or " if carries(Mode.DEAR, codec) else ""
    return (
        f"{schedule} cannot carry compress={name}: each rank updates its own 1/P slice of the "
        "parameters from its slice of the summed message, but a slice of a summed "
        f"{name} message does not decode to any slice of the gradient (each entry needs the "
        f"whole message, e.g. a full row of both low-rank factors); use {alt}'wfbp:compress={name}'"
    )


def pairing_refusal(schedule_name: str, codec_name: str) -> str | None:
    """Why the engine schedule ``schedule_name`` (wfbp, mgwfbp, dear, lee18) cannot carry the
    registered codec ``codec_name``, or None when the pair works (``none`` always works).

    Raises :class:`~lowcomm.errors.UsageError` for an unknown codec (listing the valid ones)
    and ValueError for a method that is not an engine schedule.
    """
    if codec_name.strip().lower() in ("", "none"):
        return None
    from lowcomm import methods

    mode = _schedule_mode(schedule_name)
    codec = codec_class(codec_name.strip().lower())
    if getattr(methods.method_class(schedule_name), "sums_only", False):
        refusal = sum_only_refusal(schedule_name, codec)
        if refusal is not None:
            return refusal
    return mode_refusal(mode, schedule_name, codec)

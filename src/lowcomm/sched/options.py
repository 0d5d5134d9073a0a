"""``--method`` options of the engine schedules: their own keys plus the chosen codec's.

Why: ``compress=<codec>`` can be any registered codec, and its options are written in the same
spec (``dear:compress=acpsgd,rank=4``, ``wfbp:compress=topk,density=0.1``). The option parser
(:func:`lowcomm.methods.base.parse_options`) reads one dataclass per method, so each schedule's
``Options`` (:func:`with_codec_options`) holds its own fields and every registered codec's
fields, the latter *unset* unless given. After parsing, the keys given for the codec are
validated by that codec's own ``Options`` (same messages and defaults as ``--method <codec>``);
a key that belongs neither to the schedule nor to the chosen codec is refused, listing both.
A key both sides know (``seed``) goes to both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lowcomm.compress.codec import CODECS, Codec, codec_class
from lowcomm.errors import UsageError, check_positive
from lowcomm.sched.cost import SMALL_TENSOR_ELEMS
from lowcomm.sched.pairing import Mode, mode_refusal
from lowcomm.sched.tune import check_bayes_opt


class _Unset:
    """The default of a codec option that was not given (one object; survives copies)."""

    def __repr__(self) -> str:
        return "unset"

    def __copy__(self) -> _Unset:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Unset:
        return self

    def __reduce__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass
class EngineFields:
    """Options every engine schedule has: ``compress=<codec name>`` (``none``: plain
    averaging; the codec's keys join in :func:`with_codec_options`) and whether rank 0's
    buffers (BatchNorm statistics) are broadcast before each training forward, as DDP does."""

    compress: str = "none"
    broadcast_buffers: bool = True


#: lee18's ``update=`` values (:class:`Lee18Fields`)
LEE18_UPDATES = ("layer", "step")


@dataclass
class TuneFields(EngineFields):
    """The fusion threshold's online tuning, for the schedules that fuse by a threshold (DeAR
    section V: Bayesian optimization of ``threshold_mb`` over ``[tune_min_mb, tune_max_mb]``,
    ``tune_trials`` trials of ``tune_iters`` timed steps each; :mod:`lowcomm.sched.tune`)."""

    # the forward-order first group closes at this size (0: at threshold_mb), as DDP's first
    # bucket: it is exposed at both ends of a step (lowcomm.sched.groups.fuse_sizes)
    first_group_mb: float = 1.0
    tune: bool = False
    tune_trials: int = 10
    tune_iters: int = 5  # measured iterations per trial (one more is discarded)
    tune_min_mb: float = 1.0
    tune_max_mb: float = 256.0
    seed: int = 0  # tuner (and the codec's seed, when it has one)

    def check_fusion(self, schedule: str) -> None:
        """Refuse a bad first group size, search range or trial count, naming ``schedule``; with
        ``tune=true``, refuse a missing bayes_opt here, in one line, not at step 1."""
        check_positive(f"{schedule}: first_group_mb", self.first_group_mb, allow_zero=True)
        if self.tune_trials < 1 or self.tune_iters < 1:
            raise UsageError(f"{schedule}: tune_trials and tune_iters must be >= 1")
        check_positive(f"{schedule}: tune_min_mb", self.tune_min_mb)
        check_positive(f"{schedule}: tune_max_mb", self.tune_max_mb)
        if self.tune_max_mb < self.tune_min_mb:
            raise UsageError(
                f"{schedule}: tune_max_mb ({self.tune_max_mb}) must be >= tune_min_mb ({self.tune_min_mb})"
            )
        if self.tune:
            check_bayes_opt()


@dataclass
class Lee18Fields(TuneFields):
    """lee18: ``update=layer`` (the paper) steps each fused group's shard as soon as its
    reduce-scatter completes in backward (:mod:`lowcomm.sched.layer_update`, with its
    automatic fallbacks); ``update=step`` steps every shard in the optimizer step.
    ``tune=true`` chooses ``threshold_mb`` online as ``dear:tune=true`` does."""

    update: str = "layer"
    # fused groups of this size, as DeAR's and DDP's buckets: one ring per layer pays a ring's
    # start per layer, which fusion saves (scheduling.md); 0: one group per layer (the paper)
    threshold_mb: float = 25.0
    # a group closes only once it holds this many elements: layers smaller than MG-WFBP's
    # 8192 (BatchNorm, a lone bias) ride with their neighbour; 0: strictly one group per layer
    merge_below: int = SMALL_TENSOR_ELEMS

    def __post_init__(self) -> None:
        self.update = str(self.update).strip().lower()
        if self.update not in LEE18_UPDATES:
            raise UsageError(f"lee18: update={self.update!r} is not valid; valid: {', '.join(LEE18_UPDATES)}")
        check_positive("lee18: threshold_mb", self.threshold_mb, allow_zero=True)
        check_positive("lee18: merge_below", self.merge_below, allow_zero=True)
        self.check_fusion("lee18")


@dataclass
class DeAROptions(TuneFields):
    """dear: fusion threshold (optionally tuned by Bayesian optimization) and its search range."""

    threshold_mb: float = 25.0  # fusion buffer size; 0 = one group per layer

    def __post_init__(self) -> None:
        check_positive("dear: threshold_mb", self.threshold_mb, allow_zero=True)
        self.check_fusion("dear")


def _codec_fields() -> dict[str, dataclasses.Field[Any]]:
    """Every registered codec's option fields, by name (the first codec's type wins)."""
    out: dict[str, dataclasses.Field[Any]] = {}
    for name in CODECS.names():
        for f in dataclasses.fields(codec_class(name).Options):
            out.setdefault(f.name, f)
    return out


def own_fields(options: Any) -> list[str]:
    """The schedule's own option names (``compress`` included), in declaration order."""
    return [f.name for f in dataclasses.fields(type(options)) if not f.metadata.get("codec")]


def with_codec_options(schedule: str, mode: Mode, own: type) -> type:
    """The ``Options`` dataclass of engine schedule ``schedule``: ``own`` (a dataclass with a
    ``compress`` field) plus every codec's fields, unset by default (see module doc)."""
    own_names = {f.name for f in dataclasses.fields(own)}
    extra = [(n, f.type, dataclasses.field(default=UNSET, metadata={"codec": True}))
             for n, f in _codec_fields().items() if n not in own_names]

    def __post_init__(self: Any) -> None:
        base = getattr(own, "__post_init__", None)
        if base is not None:
            base(self)
        self.codec_options = codec_options(schedule, mode, self)

    cls = dataclasses.make_dataclass(f"{own.__name__}WithCodec", extra, bases=(own,),
                                     namespace={"__post_init__": __post_init__, "__doc__": own.__doc__})
    cls.__module__ = own.__module__
    return cls


def chosen_codec(options: Any) -> type[Codec] | None:
    """The codec class ``compress=`` names, or None for ``none``."""
    name = str(getattr(options, "compress", "none")).strip().lower()
    return None if name in ("", "none") else codec_class(name)


def codec_options(schedule: str, mode: Mode, options: Any) -> Any:
    """The chosen codec's ``Options`` built from the keys given in ``options`` (None without a
    codec); refuses pairs that cannot work and keys that belong to neither side."""
    fields = dataclasses.fields(type(options))
    given = {f.name: getattr(options, f.name) for f in fields
             if f.metadata.get("codec") and getattr(options, f.name) is not UNSET}
    own = own_fields(options)
    codec = chosen_codec(options)
    if codec is None:
        if given:
            raise UsageError(
                f"{schedule}: option(s) {', '.join(sorted(given))} belong to a compressor; give "
                f"compress=<name> too (valid: none, {', '.join(CODECS.names())})"
            )
        return None
    refusal = mode_refusal(mode, schedule, codec)
    if refusal is not None:
        raise UsageError(refusal)
    valid = [f.name for f in dataclasses.fields(codec.Options)]
    for key in given:
        if key not in valid:
            raise UsageError(
                f"unknown option {key!r} for method '{schedule}:compress={codec.name}'; valid: "
                f"{', '.join(own)} (schedule) and {', '.join(valid) or 'none'} ({codec.name})"
            )
    shared = {k: getattr(options, k) for k in valid if k in own}
    try:
        return codec.Options(**shared, **given)
    except (TypeError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"invalid options for compress={codec.name} of {schedule!r}: {e}") from None


def describe_options(options: Any) -> dict[str, Any]:
    """The schedule's own options and the codec's (for a run summary: no unset values)."""
    d = {k: getattr(options, k) for k in own_fields(options)}
    co = getattr(options, "codec_options", None)
    if co is not None:
        d.update(dataclasses.asdict(co))
    return d

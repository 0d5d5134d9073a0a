"""The codec contract: what every compressor declares, so that no other part keeps a list.

A *codec* is one compressor with everything the rest of lowcomm needs to carry it:

* **how its payloads aggregate** (:class:`Aggregation`): ``SUM`` payloads add up, so a
  schedule may all-reduce or reduce-scatter them; ``GATHER`` payloads must each be decoded,
  so every worker receives everyone's (all-gather, or a codec-driven point-to-point
  exchange such as gTop-k's recursive doubling);
* **its messages** (:class:`Message`): :meth:`Codec.encode` turns one worker's flat gradient
  into the first message; a codec whose next message needs the aggregate of the previous
  one (PowerSGD's Q needs the summed P; gTop-k's next exchange needs the merged pair) says
  ``final=False`` and :meth:`Codec.advance` builds the next from what was received;
  :meth:`Codec.decode` writes the *mean* gradient from what the final message received;
* **its cost** (:meth:`Codec.cost`): bytes per worker of each collective and the compute of
  each phase as a function of the tensor shapes and the world size, read by byte-count
  tests, the simulator, the profiler and the advisor;
* **its state** (:meth:`Codec.state_dict`), for exact checkpoints;
* **momentum correction** (Lin et al., Deep Gradient Compression, ICLR'18): a codec
  with error feedback may keep the optimizer's momentum as a *velocity* ``u <- m*u + g`` per
  parameter (:meth:`Codec.accumulate`, called by every transport on every step, warm-up
  included) and compress ``u`` instead of ``g``; the optimizer then runs without momentum
  (the trainer moves it, :meth:`Codec.set_momentum`). A dense step then averages ``u``,
  which is exactly heavy-ball SGD; a sparse step's residual holds velocity, not gradient;
* **durations** (``start_iter`` and other :attr:`Codec.durations`): steps, ``"2ep"`` or
  ``"5%"`` of the run, resolved by :meth:`Codec.set_run`.

A codec never calls a collective: :mod:`lowcomm.comm.transport` does, for the DDP comm hooks
and for the scheduling engine alike. Codecs register themselves in :data:`CODECS` (one module
under ``lowcomm/compress/`` per compressor; the registry imports every module of the package
on first use, so a new compressor needs no edit anywhere else).

Conventions every codec follows (the transports rely on them):

* ``flat`` given to :meth:`Codec.encode` is this worker's gradient in unscaled units when the
  codec is :attr:`~Codec.stateful` (the transport divides out an AMP loss scale first);
* ``finite`` is a 0-dim bool device tensor; when it is False the message must decode to a
  non-finite result on *every* rank (NaN policy) and state must be left unchanged, all
  without a host synchronization (``torch.where``, see :mod:`lowcomm.compress.feedback`);
* decode produces the mean over workers (the transport never divides);
* :attr:`Codec.step` counts synchronized steps; the transport calls :meth:`Codec.end_step`
  once per step, compressed or not, and carries a plain all-reduce while
  :attr:`Codec.active` is False (the ``start_iter`` warm-up).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import torch

from lowcomm.compress.base import pack as pack, unpack as unpack  # codecs import them from here
from lowcomm.compress.cost import CodecCost as CodecCost, Round as Round, Work as Work
from lowcomm.compress.feedback import Velocity
from lowcomm.compress.options import is_relative, parse_duration, resolve_duration
from lowcomm.errors import UsageError, check_count
from lowcomm.registry import Registry


class Aggregation(str, Enum):
    """How the workers' payloads combine."""

    #: payloads add up: all-reduce, or reduce-scatter + all-gather
    SUM = "sum"
    #: each payload is decoded separately: every worker receives every payload
    GATHER = "gather"


#: collectives a :class:`Message` may ask for (``none``: nothing to send, decode locally)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "none")

#: process groups a :class:`Message` or :class:`Round` may run on (:mod:`lowcomm.comm.topology`):
#: all workers, the workers of this node, or the same-local-rank workers of every node
SCOPES = ("world", "intra", "inter")


@dataclass(frozen=True)
class Layout:
    """The tensors fused in one flat buffer (a DDP bucket or an engine group), in order.

    ``index`` gives each name's position in ``model.named_parameters()``: seeds derived from
    it are identical on every rank and for every bucket layout.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    index: tuple[int, ...]

    @classmethod
    def of(cls, names: Sequence[str], shapes: Sequence[Sequence[int]],
           param_index: Mapping[str, int]) -> Layout:
        """Build from names and shapes; unknown names get index 0 (as the hooks always did)."""
        return cls(tuple(names), tuple(tuple(int(d) for d in s) for s in shapes),
                   tuple(param_index.get(n, 0) for n in names))

    @property
    def sizes(self) -> list[int]:
        """Elements of each tensor."""
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        """Elements of the whole flat buffer."""
        return sum(self.sizes)


@dataclass
class Message:
    """One thing to communicate, plus what the local decode needs (``ctx``, never sent).

    ``collective``: ``all_reduce`` (``buf`` is summed in place), ``all_gather`` (``buf`` is
    this worker's payload; every worker receives a ``(world, buf.numel())`` tensor), ``p2p``
    (``buf`` is sent to and/or a same-shaped tensor received from ``peer``, a rank of the
    process group) or ``none``. ``final=False``: the transport completes this message before
    the backward pass continues and hands what it received to :meth:`Codec.advance`.
    ``numel``: the meaningful length of ``buf`` (a transport may pad ``buf`` after it).

    ``reduce_scatter``: ``buf`` is this worker's full input (``numel`` divisible by the group's
    size n); the worker receives the summed chunk ``i`` of n equal chunks, ``i`` its rank in
    the group. ``scope``: the process group the collective runs on, ``world``, ``intra`` (this
    node's workers) or ``inter`` (this worker's same-local-rank peers on the other nodes),
    which lets a codec build hierarchical schedules. Without a hierarchical topology a scoped
    message runs on the world group (flat fallback: a codec works on one node unchanged). A
    scoped ``p2p`` message's ``peer`` is a rank of the scoped group.
    """

    buf: torch.Tensor
    collective: str
    final: bool = True
    name: str = ""
    peer: int | None = None
    send: bool = True
    recv: bool = True
    ctx: Any = None
    numel: int = -1
    scope: str = "world"

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {self.collective!r}; valid: {', '.join(COLLECTIVES)}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}; valid: {', '.join(SCOPES)}")
        if self.numel < 0:
            self.numel = self.buf.numel()


class Codec(Velocity, ABC):
    """One compressor and everything a transport, simulator or advisor needs of it.

    Subclasses set the class attributes, give an ``Options`` dataclass (the ``--method
    name:key=value`` fields; validated in its ``__post_init__``) and implement
    :meth:`encode`, :meth:`decode` and :meth:`cost` (and :meth:`advance` when a message is
    not final). Keep state per parameter *name* (:class:`~lowcomm.compress.feedback.ParamStore`)
    so a changed bucket layout, a regrouping or a resume finds it again.
    """

    #: the ``--method`` / ``compress=`` name
    name: ClassVar[str] = ""
    #: one line for tables (docs, ``lowcomm simulate --list``)
    summary: ClassVar[str] = ""
    #: under which conditions it keeps accuracy (the advisor prints it)
    caveat: ClassVar[str] = ""
    Options: ClassVar[type] = object
    aggregation: ClassVar[Aggregation] = Aggregation.SUM
    #: keeps state across steps (memory, momentum, factors): it sees unscaled gradients
    stateful: ClassVar[bool] = False
    #: a slice of the summed message decodes to the same slice of the mean gradient
    #: (casts), so a schedule may reduce-scatter it and decode only its shard (lee18)
    elementwise: ClassVar[bool] = False
    #: a later message needs the aggregate of an earlier one in the same step
    multi_round: ClassVar[bool] = False
    #: consecutive compressed steps run different kernels in a cycle of this length (ACP-SGD's P, Q: 2)
    step_cycle: ClassVar[int] = 1
    #: the :mod:`lowcomm.compress.native` modules of numba kernels its CPU path calls, compiled
    #: before training by :func:`lowcomm.compress.warm.compile_kernels`
    compiled_kernels: ClassVar[tuple[str, ...]] = ()
    #: options that are durations (steps, ``"Nep"``, ``"N%"``) -> the steps a *default*
    #: relative value falls back to when the run's length is unknown (hooks API without
    #: ``steps_per_epoch=``/``total_steps=``): the fixed count the option had before
    durations: ClassVar[Mapping[str, int]] = {"start_iter": 10}

    def __init__(self, options: Any = None, *, world: int = 1, rank: int = 0) -> None:
        self.options = options if options is not None else self.Options()
        self.world = int(world)
        #: this worker's rank in the process group (codecs with ``p2p`` messages address
        #: their peers relative to it)
        self.rank = int(rank)
        self.step = 0
        Velocity.__init__(self)
        self._run: tuple[int | None, int | None] = (None, None)
        self._durations: dict[str, tuple[Any, int]] = {}

    # --- life cycle ---------------------------------------------------------------------
    def set_run(self, *, steps_per_epoch: int | None, total_steps: int | None) -> None:
        """Resolve the options given as durations (``"2ep"``, ``"5%"``) into steps.

        Called by the trainer / method / engine before the first step, and by
        ``lowcomm.hooks.register`` (with None where the user gave no run information). An
        explicit relative value whose base is unknown is a :class:`~lowcomm.errors.UsageError`
        raised here; a relative *default* falls back to :attr:`durations`' fixed count."""
        for what, value in (("steps_per_epoch", steps_per_epoch), ("total_steps", total_steps)):
            if value is not None:
                check_count(what, value)
        self._run = (steps_per_epoch, total_steps)
        self._durations.clear()
        for name in self.durations:
            self.duration(name)

    def duration(self, name: str) -> int:
        """Steps of the duration option ``name`` for this run (0 when the options lack it)."""
        value = getattr(self.options, name, 0)
        if value is None:
            return 0
        hit = self._durations.get(name)
        if hit is not None and hit[0] == value:
            return hit[1]
        fallback = None
        if is_relative(value) and value == self._option_default(name):
            fallback = self.durations.get(name, 0)
        spe, total = self._run
        steps = resolve_duration(value, steps_per_epoch=spe, total_steps=total, default_steps=fallback, name=name)
        self._durations[name] = (value, steps)
        return steps

    def _option_default(self, name: str) -> Any:
        """The parsed default of option ``name`` (None when it has none)."""
        for f in dataclasses.fields(self.options) if dataclasses.is_dataclass(self.options) else ():
            if f.name == name and f.default is not dataclasses.MISSING:
                try:
                    return parse_duration(name, f.default)
                except UsageError:
                    return None
        return None

    @property
    def start_iter(self) -> int:
        """Steps of plain all-reduce before compressing (0 when the codec has no warm-up)."""
        return self.duration("start_iter")

    @property
    def active(self) -> bool:
        """Whether this step is compressed (False during the ``start_iter`` warm-up)."""
        return self.step >= self.start_iter

    @property
    def compresses(self) -> bool:
        """Whether a compressed step is still to come: False when the run's length is known
        (:meth:`set_run`) and the ``start_iter`` warm-up lasts to its end."""
        total = self._run[1]
        return total is None or self.start_iter < total

    def end_step(self) -> None:
        """Called by the transport once per synchronized step."""
        self.step += 1

    def blank(self) -> Codec:
        """A new codec of this class with this one's options, world, rank, run length and
        momentum, and none of its state (step, memory, factors): for work beside training
        that must leave this one as it is (:mod:`lowcomm.compress.warm`)."""
        fresh = type(self)(self.options, world=self.world, rank=self.rank)
        fresh.set_run(steps_per_epoch=self._run[0], total_steps=self._run[1])
        fresh.set_momentum(self.momentum_factor)
        return fresh

    # --- momentum correction (set_momentum, accumulate, mask_velocity: see Velocity) ----
    def as_trained(self) -> Codec:
        """This codec with the momentum the trainer moves into it by default (SGD's 0.9,
        when its ``momentum_correction`` is on), so what a simulator or profiler prices or
        times includes the velocity's passes, as ``lowcomm train`` runs it. Returns self."""
        if getattr(self.options, "momentum_correction", False):
            self.set_momentum(TRAINER_MOMENTUM)
        return self

    def velocity_work(self, shapes: Sequence[Sequence[int]]) -> Work:
        """Encode work of :meth:`accumulate` for a buffer fusing ``shapes`` (add it to
        :meth:`cost`'s encode work): two elementwise passes for the velocity when it is on,
        two for the clipping (the norms, then the scaling) when it is on."""
        passes = (2 if self.momentum_factor != 0.0 else 0) + (2 if self.clip_norm > 0 else 0)
        return Work(elementwise=passes * sum(math.prod(s) for s in shapes)) if passes else Work()

    # --- the payload ----------------------------------------------------------------------
    @abstractmethod
    def encode(self, flat: torch.Tensor, layout: Layout, finite: torch.Tensor, *,
               pad_to: int = 1) -> Message:
        """First message of one fused buffer (``flat.numel() == layout.numel``).

        ``pad_to``: a ``SUM`` codec's final message buffer must have a length divisible by it
        (zeros after ``numel``), so a schedule can reduce-scatter it without a copy.
        """

    def advance(self, msg: Message, received: torch.Tensor) -> Message:
        """The next message, from what the non-final ``msg`` received (see :class:`Message`).

        Only codecs that emit a non-final message override this; the transports call it for
        non-final messages only, so reaching this default is a codec bug (a message marked
        ``final=False`` by a codec with no next message), reported as such."""
        raise RuntimeError(f"{self.name} marked a message non-final but has no next message "
                           "(a codec with final=False messages must override advance)")

    @property
    def has_rounds(self) -> bool:
        """Whether this codec sends non-final messages (it overrides :meth:`advance`: gTop-k's
        exchanges, PowerSGD's P): a later message needs what an earlier one received. Wider
        than :attr:`multi_round`, which names only the ``SUM`` codecs whose next message needs
        a complete sum (what DeAR cannot carry)."""
        return type(self).advance is not Codec.advance

    @abstractmethod
    def decode(self, msg: Message, received: torch.Tensor, out: torch.Tensor) -> None:
        """Write the mean gradient into ``out`` from what the final ``msg`` received.

        ``received`` is ``msg.buf`` summed (``all_reduce``), ``(world, msg.numel)`` uint8 rows
        (``all_gather``), the peer's buffer (``p2p``) or ``msg.buf`` (``none``). ``out`` may
        alias the ``flat`` given to :meth:`encode`. An :attr:`elementwise` codec must also
        accept matching slices of ``received`` and ``out``.
        """

    @abstractmethod
    def cost(self, shapes: Sequence[Sequence[int]], *, world: int, dtype_bytes: int = 4,
             step: int | None = None) -> CodecCost:
        """Analytic cost of one compressed step of a buffer fusing ``shapes``.

        ``step``: for codecs whose messages alternate (ACP-SGD's P and Q), the step to cost;
        None gives the average over a period. Byte counts must match what the transport
        counts exactly (tests compare them).
        """

    # --- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (tensors on the CPU); subclasses extend it. The velocity of
        momentum correction is saved as ``velocity`` (only when there is one)."""
        state: dict[str, Any] = {"codec": self.name, "step": self.step}
        velocity = self.velocity.state_dict()
        if velocity:
            state["velocity"] = velocity
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; refuses another codec's state."""
        if state.get("codec", self.name) != self.name:
            raise ValueError(f"state is for compressor {state.get('codec')!r}, not {self.name!r}")
        self.step = int(state.get("step", 0))
        self.velocity.load_state_dict(dict(state.get("velocity", {})))

    def describe(self) -> dict[str, Any]:
        """What a run summary records about the codec."""
        return {"compress": self.name, "options": dataclasses.asdict(self.options), "compress_step": self.step,
                "momentum_factor": self.momentum_factor}


#: SGD momentum of ``lowcomm train``'s defaults (``--momentum``), which the trainer moves into
#: a codec with ``momentum_correction``: what :meth:`Codec.as_trained` assumes
TRAINER_MOMENTUM = 0.9

#: name -> codec class (``CODECS.get("topk")``); filled by the modules of ``lowcomm.compress``
#: (every public module of the package is imported on first look-up)
CODECS: Registry[Codec] = Registry("compressor", package="lowcomm.compress")


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: register a :class:`Codec` under ``cls.name``."""
    CODECS.register(cls.name)(cls)
    return cls


def codec_class(name: str) -> type[Codec]:
    """The codec class registered as ``name`` (UsageError listing valid names otherwise)."""
    return CODECS.get(name)  # type: ignore[return-value]

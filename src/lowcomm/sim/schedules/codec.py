"""Any registered codec inside the simulator: its declared cost, priced and issued as tasks.

Why: the simulator must carry every compressor of :data:`lowcomm.compress.codec.CODECS`
without a line of per-compressor code, so a new codec simulates the day it registers. A codec
declares one step of one fused buffer as :class:`~lowcomm.compress.codec.CodecCost`: encode
work, then rounds (a collective of ``nbytes`` per worker, then the compute that follows it).
The DDP hooks and the engine issue those rounds the same way, and so does :meth:`CodecPlan.hook`:

* encode on the compute stream once the buffer's last gradient is ready;
* a *blocking* round (a later message needs its result: PowerSGD's P, gTop-k's exchanges)
  stalls backward: its collective, then its ``then`` work on the compute stream;
* the last round is asynchronous: its collective overlaps backward and its ``then`` (the
  decode) runs in the collective's callback, on the comm chain;
* with ``beside`` (the DDP hooks on CPU workers over gloo run a codec's rounds on a thread of
  their own, :func:`lowcomm.comm.hooks.state.rounds_beside`) no round stalls backward: every
  round's ``then`` runs on the comm chain, in bucket order, as that one thread runs them.

Work is priced with the profile's per-unit kernel costs (:meth:`Sim.price`), except where the
profile holds measured times of the codec itself (``profile.compressors[name]``, from
:func:`lowcomm.sim.profiler.measure_compressors`): those replace the encode and the final
decode, ``decode_s_per_elem + P * decode_s_per_elem_per_worker`` per element.
"""

from __future__ import annotations

from typing import Any

from lowcomm.compress.codec import Aggregation, Codec, CodecCost, Round, codec_class
from lowcomm.errors import UsageError
from lowcomm.sched.pairing import Mode, mode_refusal
from lowcomm.sim.schedules.base import Bucket, Sim
from lowcomm.sim.timeline import Task

#: short task names of the collectives (``ar.b3``, ``ag1.b0``, ``x2.b0``)
TAGS = {"all_reduce": "ar", "all_gather": "ag", "p2p": "x", "reduce_scatter": "rs", "none": "local"}


class CodecPlan:
    """One codec bound to its options: per-bucket cost, priced phases, emitted tasks."""

    def __init__(self, name: str, options: Any = None, *, timed_as: str | None = None) -> None:
        self.name = name
        self.cls = codec_class(name)
        self.options = options
        #: the entry of ``profile.compressors`` holding this plan's measured times (None: the
        #: codec's own; another library's kernels carrying the same payload have their own,
        #: :mod:`.reference`); without it the declared work is priced
        self.timed_as = timed_as or name
        self._by_world: dict[tuple[int, int], Codec] = {}

    def check_pairing(self, mode: Mode, schedule: str) -> None:
        """Refuse an impossible schedule/codec pair with the engine's own reason
        (:func:`lowcomm.sched.pairing.mode_refusal`, read from the codec's declarations)."""
        why = mode_refusal(mode, schedule, self.cls)
        if why:
            raise UsageError(why)

    @property
    def gathered(self) -> bool:
        """Every worker's payload is decoded separately (no sum on the wire)."""
        return self.cls.aggregation is Aggregation.GATHER

    def codec(self, world: int, local_size: int | None = None) -> Codec:
        """The codec instance for ``world`` workers (built once), told the node layout
        (``local_size`` workers per node) when it plans by topology (``set_topology``)."""
        key = (world, local_size or world)
        if key not in self._by_world:
            codec = self.cls(self.options, world=world).as_trained()
            setter = getattr(codec, "set_topology", None)
            if setter is not None:
                from lowcomm.comm.topology import Topology

                setter(Topology(world, local_size or world, 0))
            self._by_world[key] = codec
        return self._by_world[key]

    def cost(self, sim: Sim, b: Bucket, it: int) -> CodecCost:
        """The declared cost of bucket ``b`` in iteration ``it`` (codec step ``it - 1``), on the
        network's node layout when it has two levels."""
        lv = sim.net.levels(sim.p)
        return self.codec(sim.p, lv[1] if lv else None).cost(b.shapes, world=sim.p, dtype_bytes=sim.bpe,
                                                             step=it - 1)

    def measured(self, sim: Sim) -> dict[str, float]:
        """The profile's measured times of this plan (empty: price the declared work)."""
        return sim.profile.compressors.get(self.timed_as) or {}

    def encode_s(self, sim: Sim, b: Bucket, cost: CodecCost) -> float:
        """Seconds of the encode: measured if the profile has it, else the priced work. A
        hook timed whole (``hook_s_per_elem``, :mod:`lowcomm.sim.hook_timing`) is all here."""
        measured = self.measured(sim)
        if "hook_s_per_elem" in measured:
            return b.numel * measured["hook_s_per_elem"]
        if "encode_s_per_elem" in measured:
            return b.numel * measured["encode_s_per_elem"]
        return sim.price(cost.encode)

    def round_s(self, sim: Sim, r: Round) -> float:
        """Seconds of a round's ``then`` before the last (priced; in a hook timed whole, 0)."""
        return 0.0 if "hook_s_per_elem" in self.measured(sim) else sim.price(r.then)

    def decode_s(self, sim: Sim, b: Bucket, last: Round) -> float:
        """Seconds of the final round's ``then`` (the decode): measured or priced."""
        measured = self.measured(sim)
        if "hook_s_per_elem" in measured:
            return 0.0
        if "decode_s_per_elem" in measured:
            per = measured["decode_s_per_elem"] + sim.p * measured.get("decode_s_per_elem_per_worker", 0.0)
            return b.numel * per
        return sim.price(last.then)

    def hook(self, sim: Sim, it: int, b: Bucket, ready: Task, *, last_as: str | None = None,
             defer: bool = False, algorithm: str | None = None, beside: bool = False) -> tuple[Task, CodecCost]:
        """Issue bucket ``b``'s step: encode, every round, the decode in the final round's
        callback; return the last task and the cost. ``algorithm``: the all-reduce algorithm of
        the world-scoped all-reduce rounds (the ``hier`` method's mode), else the network's.

        ``last_as``: the schedule carries the last (sum-compatible) round itself with this
        collective (DeAR/Lee'18: ``reduce_scatter``) and decodes later. ``defer``: the
        final collective is issued but its decode is left to the caller (the engine decodes
        in ``finish_sync``); the returned task is then that collective. ``beside``: the rounds
        run beside backward (module docstring).
        """
        cost = self.cost(sim, b, it)
        k = b.index
        last = sim.compute(f"enc.b{k}", self.encode_s(sim, b, cost), it, after=[ready])
        n = len(cost.rounds)
        for i, r in enumerate(cost.rounds):
            final = i == n - 1
            collective = last_as if final and last_as else r.collective
            tag = TAGS.get(collective, collective) + (str(i + 1) if n > 1 else "")
            if collective != "none":
                recv = r.recv_nbytes  # a receive-only p2p round still takes time
                last = sim.collective(f"{tag}.b{k}", collective, r.nbytes, it, after=[last],
                                      timed_bytes=max(r.nbytes, recv or 0),
                                      scope=getattr(r, "scope", "world"),
                                      algorithm=algorithm if collective == "all_reduce" else None)
            if final and (last_as or defer):
                break
            seconds = self.decode_s(sim, b, r) if final else self.round_s(sim, r)
            name = f"dec.b{k}" if final else f"after.{tag}.b{k}"
            if (r.blocking or collective == "none") and not beside:
                last = sim.compute(name, seconds, it, after=[last])
            else:
                last = sim.comm_side(name, seconds, it, after=[last])
        return last, cost

    def deferred_decode(self, sim: Sim, it: int, b: Bucket, cost: CodecCost, arrived: Task, *,
                        share: float = 1.0) -> Task:
        """The decode the engine runs in ``finish_sync`` (compute stream) once ``arrived``
        ends; ``share``: the fraction decoded (Lee'18 decodes its 1/P slice)."""
        seconds = self.decode_s(sim, b, cost.rounds[-1]) * share if cost.rounds else 0.0
        return sim.compute(f"dec.b{b.index}", seconds, it, after=[arrived])

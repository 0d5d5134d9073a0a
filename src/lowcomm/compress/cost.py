"""What one step of a codec costs: the compute of each phase and the collectives, in order.

A codec's :meth:`~lowcomm.compress.codec.Codec.cost` returns a :class:`CodecCost`; the
simulator, the profiler, the advisor and the byte-count tests read it. These are plain data,
kept out of :mod:`lowcomm.compress.codec` so that module holds the contract alone; it
re-exports the three names, so ``from lowcomm.compress.codec import Work`` works as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class Work:
    """Kernel amounts of one compute phase, priced by the simulator's measured costs."""

    elementwise: float = 0.0  # elements streamed once (a cast, an add, a sign pass)
    matmul_flops: float = 0.0  # 2*m*n*r per (m x n) @ (n x r)
    orthogonalize: float = 0.0  # m*r elements of a reduced QR
    topk: float = 0.0  # elements scanned by a top-k selection
    scatter: float = 0.0  # elements scatter-added

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def scaled(self, k: float) -> Work:
        """This work done ``k`` times (e.g. once per worker's payload)."""
        return Work(*(a * k for a in dataclasses.astuple(self)))


@dataclass
class Round:
    """One collective of a step and the compute that follows it.

    ``nbytes``: bytes of this worker's payload handed to the collective (the accounting
    layer's convention: what ``lowcomm.comm.accounting`` counts at the call). ``blocking``:
    the transport waits for it inside backward (a later round needs its result). ``then``:
    compute after it (for the last round: the decode, run in the collective's callback).
    """

    collective: str
    nbytes: int
    then: Work = field(default_factory=Work)
    blocking: bool = False
    #: bytes received in a ``p2p`` round, for timing (None: ``nbytes``); a receive-only
    #: round sends nothing but still waits for the peer's payload
    recv_nbytes: int | None = None
    #: the process group of the collective (``world``, ``intra``, ``inter``; see
    #: :class:`~lowcomm.compress.codec.Message`): byte counts and timing use that group's size and link
    scope: str = "world"


@dataclass
class CodecCost:
    """Cost of one step of one fused buffer: encode, then the rounds in order."""

    encode: Work
    rounds: list[Round]

    @property
    def nbytes(self) -> int:
        """Bytes this worker hands to collectives in the step."""
        return sum(r.nbytes for r in self.rounds)

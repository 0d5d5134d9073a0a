"""The search space of an elastic supernet: which architectural choices exist, and configs.

A config is a plain JSON-able ``dict[str, list[int]]`` (one list per dimension, one entry per
position, e.g. one kernel size per block), so it can be logged, saved next to a checkpoint and
passed on the command line without any class of ours. :class:`SearchSpace` knows the valid
values and does everything the training loop and the search need with them: sampling (OFA
samples each position independently and uniformly), validation with a message that names the
dimension and the valid choices, canonical forms (two configs that build the same network
compare equal, so the search does not count one network twice), one-hot features for the
accuracy predictor, and OFA's mutation and crossover.

Some positions are unreachable in some configs: the third block of a stage whose depth is 2
runs no matter which kernel it is given. :class:`Gate` records that ("positions ``levels[j]``
of dim ``dim`` exist only while dim ``control`` at ``position`` is at least ``j + 1``");
``depth_groups`` is the common case, sugar for the gates of "kernel" and "expand" under
"depth".
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from lowcomm.errors import UsageError

Config = dict[str, list[int]]

#: Per-block dimensions that ``depth_groups`` gates (a block beyond the active depth ignores them).
BLOCK_DIMS = ("kernel", "expand")


@dataclass(frozen=True)
class Dimension:
    """One elastic choice: its name, the valid values (ascending) and how many positions
    (blocks, stages, ...) choose it independently."""

    name: str
    choices: tuple[int, ...]
    positions: int

    def __post_init__(self) -> None:
        choices = tuple(int(c) for c in self.choices)
        if not choices or list(choices) != sorted(set(choices)):
            raise UsageError(
                f"dimension {self.name!r}: choices must be distinct and ascending, got {self.choices!r}"
            )
        if int(self.positions) < 1:
            raise UsageError(f"dimension {self.name!r}: positions must be >= 1, got {self.positions}")
        object.__setattr__(self, "choices", choices)
        object.__setattr__(self, "positions", int(self.positions))


@dataclass(frozen=True)
class Gate:
    """Positions ``levels[j]`` of ``dim`` only matter while ``config[control][position] > j``.

    ``levels[0]`` is normally always reachable (the smallest depth is >= 1); it is listed so
    that ``levels[j]`` reads as "the (j+1)-th block of the stage".
    """

    control: str
    position: int
    dim: str
    levels: tuple[tuple[int, ...], ...] = field(default=())


class SearchSpace:
    """The dimensions of a supernet and the operations on its configs (see the module doc)."""

    def __init__(
        self,
        dims: Sequence[Dimension],
        depth_groups: Sequence[Sequence[int]] | None = None,
        *,
        gates: Sequence[Gate] = (),
    ) -> None:
        self.dims: tuple[Dimension, ...] = tuple(dims)
        self.names: tuple[str, ...] = tuple(d.name for d in self.dims)
        if len(set(self.names)) != len(self.names):
            raise UsageError(f"search space has repeated dimension names: {list(self.names)}")
        self._by_name = {d.name: d for d in self.dims}
        self.depth_groups: tuple[tuple[int, ...], ...] | None = (
            None if depth_groups is None else tuple(tuple(int(b) for b in g) for g in depth_groups)
        )
        all_gates = list(gates)
        if self.depth_groups is not None:
            depth = self._by_name.get("depth")
            if depth is None or depth.positions != len(self.depth_groups):
                raise UsageError(
                    f"depth_groups has {len(self.depth_groups)} stages but the space's 'depth' "
                    f"dimension has {depth.positions if depth else 'no'} positions"
                )
            for s, group in enumerate(self.depth_groups):
                for name in BLOCK_DIMS:
                    if name in self._by_name:
                        all_gates.append(Gate("depth", s, name, tuple((b,) for b in group)))
        for g in all_gates:
            for name, pos in ((g.control, g.position), *((g.dim, p) for lvl in g.levels for p in lvl)):
                if name not in self._by_name or not 0 <= pos < self._by_name[name].positions:
                    raise UsageError(f"gate {g} refers to {name}[{pos}], which the space lacks")
        self._explicit_gates = tuple(gates)
        self.gates: tuple[Gate, ...] = tuple(all_gates)

    def __repr__(self) -> str:
        inner = ", ".join(f"{d.name}={list(d.choices)}x{d.positions}" for d in self.dims)
        return f"SearchSpace({inner})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SearchSpace) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def dim(self, name: str) -> Dimension:
        """The dimension called ``name`` (UsageError listing the names if unknown)."""
        if name not in self._by_name:
            raise UsageError(f"unknown dimension {name!r}; this space has {list(self.names)}")
        return self._by_name[name]

    # -- configs -------------------------------------------------------------------------
    def max_config(self) -> Config:
        """Every position at its largest choice (the full network)."""
        return {d.name: [d.choices[-1]] * d.positions for d in self.dims}

    def min_config(self) -> Config:
        """Every position at its smallest choice (the smallest network)."""
        return {d.name: [d.choices[0]] * d.positions for d in self.dims}

    def sample(self, rng: random.Random, elastic: Collection[str] | None = None) -> Config:
        """Dims in ``elastic`` (``None``: all) uniformly per position; the others at their max.

        Progressive shrinking passes the dims unlocked so far: a phase that trains elastic
        kernels keeps depth and expansion at their maximum.
        """
        chosen = set(self.names) if elastic is None else set(elastic)
        unknown = chosen - set(self.names)
        if unknown:
            raise UsageError(
                f"unknown elastic dimension(s) {sorted(unknown)}; this space has {list(self.names)}"
            )
        return {
            d.name: [rng.choice(d.choices) if d.name in chosen else d.choices[-1] for _ in range(d.positions)]
            for d in self.dims
        }

    def validate(self, config: Mapping[str, Sequence[int]]) -> Config:
        """A clean copy of ``config``; UsageError naming the bad dimension/value and the valid ones."""
        if not isinstance(config, Mapping):
            raise UsageError(f"a config is a dict of lists {{dim: [values]}}, got {type(config).__name__}")
        missing = [n for n in self.names if n not in config]
        extra = [n for n in config if n not in self._by_name]
        if missing or extra:
            raise UsageError(
                f"config dimensions do not match the space: missing {missing}, unknown {extra}; "
                f"expected {list(self.names)}"
            )
        out: Config = {}
        for d in self.dims:
            values = config[d.name]
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise UsageError(
                    f"config[{d.name!r}] must be a list of {d.positions} values from {list(d.choices)}, "
                    f"got {values!r}"
                )
            if len(values) != d.positions:
                raise UsageError(
                    f"config[{d.name!r}] needs {d.positions} values (one per position), got "
                    f"{len(values)}: {list(values)}"
                )
            clean: list[int] = []
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, Integral) or int(v) not in d.choices:
                    raise UsageError(
                        f"config[{d.name!r}][{i}] = {v!r} is not a valid {d.name}; "
                        f"valid choices: {list(d.choices)}"
                    )
                clean.append(int(v))
            out[d.name] = clean
        return out

    def canonical(self, config: Mapping[str, Sequence[int]]) -> Config:
        """Unreachable positions (blocks beyond the active depth, ...) set to their max, so
        two configs that build the same network are equal after this."""
        out = self.validate(config)
        for g in self.gates:
            active = out[g.control][g.position]
            top = self._by_name[g.dim].choices[-1]
            for j, level in enumerate(g.levels):
                if j >= active:
                    for p in level:
                        out[g.dim][p] = top
        return out

    def encode(self, config: Mapping[str, Sequence[int]]) -> list[float]:
        """One-hot features per position of the canonical config (accuracy-predictor input);
        length :attr:`num_features`."""
        cfg = self.canonical(config)
        feats: list[float] = []
        for d in self.dims:
            for v in cfg[d.name]:
                feats.extend(1.0 if c == v else 0.0 for c in d.choices)
        return feats

    @property
    def num_features(self) -> int:
        """Length of :meth:`encode`'s vector."""
        return sum(len(d.choices) * d.positions for d in self.dims)

    def mutate(self, config: Mapping[str, Sequence[int]], rng: random.Random, prob: float) -> Config:
        """OFA's mutation: each position independently re-sampled uniformly with probability ``prob``."""
        if not 0.0 <= prob <= 1.0:
            raise UsageError(f"mutation probability must be in [0, 1], got {prob}")
        out = self.validate(config)
        for d in self.dims:
            out[d.name] = [rng.choice(d.choices) if rng.random() < prob else v for v in out[d.name]]
        return out

    def crossover(
        self, a: Mapping[str, Sequence[int]], b: Mapping[str, Sequence[int]], rng: random.Random
    ) -> Config:
        """OFA's crossover: each position taken from ``a`` or ``b`` with equal probability."""
        ca, cb = self.validate(a), self.validate(b)
        return {
            d.name: [x if rng.random() < 0.5 else y for x, y in zip(ca[d.name], cb[d.name], strict=True)]
            for d in self.dims
        }

    def size(self) -> int:
        """Number of distinct configs (reachable or not; an upper bound on distinct networks)."""
        n = 1
        for d in self.dims:
            n *= len(d.choices) ** d.positions
        return n

    # -- serialisation -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """A JSON-able description that :meth:`from_json` turns back into an equal space."""
        return {
            "dims": [
                {"name": d.name, "choices": list(d.choices), "positions": d.positions} for d in self.dims
            ],
            "depth_groups": None if self.depth_groups is None else [list(g) for g in self.depth_groups],
            "gates": [
                {"control": g.control, "position": g.position, "dim": g.dim,
                 "levels": [list(lvl) for lvl in g.levels]}
                for g in self._explicit_gates
            ],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SearchSpace:
        """Inverse of :meth:`to_json`."""
        try:
            dims = [Dimension(x["name"], tuple(x["choices"]), int(x["positions"])) for x in d["dims"]]
            gates = [
                Gate(g["control"], int(g["position"]), g["dim"], tuple(tuple(lvl) for lvl in g["levels"]))
                for g in d.get("gates", [])
            ]
        except (KeyError, TypeError) as exc:
            raise UsageError(f"not a search-space description ({exc!r}): {d!r}") from exc
        return cls(dims, d.get("depth_groups"), gates=gates)


__all__ = ["BLOCK_DIMS", "Config", "Dimension", "Gate", "SearchSpace"]

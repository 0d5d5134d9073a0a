"""How the training set is split into clients, and which clients train in a round.

Kinds (``--partition``): ``iid`` (a shuffle cut into equal parts), ``dirichlet:alpha=A,
min_size=M`` (label skew: each class is spread over the clients with Dirichlet(alpha)
proportions, as flwr_datasets' ``DirichletPartitioner`` does), ``shards:per_client=S``
(McMahan et al. 2017's pathological non-IID: sort by label, cut ``clients * S`` shards, deal
``S`` to each client) and ``natural`` (one client per user of the data, e.g. a LEAF writer).

Why everything is a pure function of ``(spec, labels, num_clients, seed)``: every worker
process and the Flower side of the benchmark build the partition themselves, and a resumed
run must see the same clients, so nothing may depend on global RNG state or on who calls.
Why vectorised: 10,000 clients over a few hundred thousand samples must take well under a
second; the only Python loops run over classes or over a handful of retries, never samples.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lowcomm.errors import MAX_COUNT, UsageError

#: the accepted ``--partition`` forms, for error messages
VALID_FORMS = "iid, dirichlet[:alpha=A,min_size=M], shards[:per_client=S], natural"
KINDS = ("iid", "dirichlet", "shards", "natural")
_OPTIONS: dict[str, tuple[str, ...]] = {"iid": (), "dirichlet": ("alpha", "min_size"),
                                        "shards": ("per_client",), "natural": ()}
#: flwr_datasets' default ``min_partition_size``; capped to what the data allows (see below)
DEFAULT_MIN_SIZE = 10
#: fresh Dirichlet draws tried before the smallest clients are topped up (flwr also tries 10)
DIRICHLET_TRIES = 10
#: streams of the two generators, so that partition and client sampling never share draws
_PARTITION_STREAM = 0x70617274  # "part"
_SAMPLING_STREAM = 0x73616D70  # "samp"


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed ``--partition``; ``min_size=None`` means the default 10, capped to the data."""

    kind: str
    alpha: float = 0.5
    min_size: int | None = None
    per_client: int = 2

    def __str__(self) -> str:
        if self.kind == "dirichlet":
            tail = "" if self.min_size is None else f",min_size={self.min_size}"
            return f"dirichlet:alpha={self.alpha:g}{tail}"
        if self.kind == "shards":
            return f"shards:per_client={self.per_client}"
        return self.kind


@dataclass(frozen=True, eq=False)
class Partition:
    """Clients as slices of one index array: client ``c`` owns ``indices[offsets[c]:offsets[c+1]]``.

    Two flat arrays instead of a list of arrays: 10,000 clients cost two allocations, and a
    worker can hand a client's samples over as one slice. ``moved`` counts the samples that
    were moved to lift small Dirichlet clients to ``min_size`` (0 for the other kinds).
    """

    offsets: np.ndarray
    indices: np.ndarray
    moved: int = 0

    def client(self, cid: int) -> np.ndarray:
        """Training-sample indices of client ``cid`` (a view, do not modify)."""
        if not 0 <= cid < self.num_clients:
            raise UsageError(f"client id {cid} out of range; valid: 0..{self.num_clients - 1}")
        return self.indices[self.offsets[cid]:self.offsets[cid + 1]]

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client (int64, one per client)."""
        return np.diff(self.offsets)

    @property
    def num_clients(self) -> int:
        """How many clients the data is split into."""
        return len(self.offsets) - 1


def parse_partition(spec: str) -> PartitionSpec:
    """Parse ``iid`` | ``dirichlet:alpha=0.5,min_size=10`` | ``shards:per_client=2`` | ``natural``."""
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown partition {spec!r}{hint}; valid: {VALID_FORMS}")
    values: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not value:
            raise UsageError(f"partition option {item!r} must look like key=value; valid: {VALID_FORMS}")
        if key not in _OPTIONS[kind]:
            valid = ", ".join(_OPTIONS[kind]) or "none"
            raise UsageError(f"partition {kind!r} has no option {key!r}; its options: {valid}"
                             f" (forms: {VALID_FORMS})")
        values[key] = value
    if kind == "dirichlet":
        alpha = _number(values.get("alpha", "0.5"), "alpha", float)
        if not math.isfinite(alpha) or alpha <= 0:
            raise UsageError(f"dirichlet alpha must be a finite number > 0, got {values['alpha']!r}")
        min_size = _number(values["min_size"], "min_size", int) if "min_size" in values else None
        if min_size is not None and not 1 <= min_size <= MAX_COUNT:
            raise UsageError(f"dirichlet min_size must be an integer >= 1, got {min_size}")
        return PartitionSpec("dirichlet", alpha=alpha, min_size=min_size)
    if kind == "shards":
        per_client = _number(values.get("per_client", "2"), "per_client", int)
        if not 1 <= per_client <= MAX_COUNT:
            raise UsageError(f"shards per_client must be an integer >= 1, got {per_client}")
        return PartitionSpec("shards", per_client=per_client)
    return PartitionSpec(kind)


def _number(text: str, name: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"partition option {name} must be {what}, got {text!r}") from None


def make_partition(spec: PartitionSpec | str, *, labels: np.ndarray, num_clients: int, seed: int,
                   users: np.ndarray | None = None) -> Partition:
    """Split the training samples (``labels[i]`` is sample ``i``'s class) into ``num_clients``.

    Deterministic in ``(spec, labels, num_clients, seed)``; ``users`` (one user index per
    sample) is read by ``natural`` only. Every client gets at least one sample; requests the
    data cannot meet are refused with the largest valid values.
    """
    parsed = parse_partition(spec) if isinstance(spec, str) else spec
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise UsageError(f"partition needs a non-empty 1-D array of integer labels, got shape "
                         f"{labels.shape} dtype {labels.dtype}")
    if labels.min() < 0:
        raise UsageError(f"partition needs class labels >= 0, got {int(labels.min())}")
    labels = labels.astype(np.int64, copy=False)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise UsageError(f"number of clients must be an integer >= 1, got {num_clients!r}")
    num_clients = int(num_clients)
    n = len(labels)
    if parsed.kind == "natural":
        return _natural(users, n, num_clients)
    if num_clients > n:
        raise UsageError(f"{num_clients} clients need at least {num_clients} training samples (one each); "
                         f"the data has {n}: use at most {n} clients")
    rng = np.random.default_rng([_PARTITION_STREAM, seed % 2**63, KINDS.index(parsed.kind)])
    if parsed.kind == "iid":
        return _from_owner(_equal_cuts(rng.permutation(n), num_clients), num_clients, rng)
    if parsed.kind == "shards":
        return _shards(labels, num_clients, parsed.per_client, rng)
    return _dirichlet(labels, num_clients, parsed, rng)


def _equal_cuts(order: np.ndarray, parts: int) -> np.ndarray:
    """Owner (part index) of each element when ``order`` is cut into equal parts (sizes +-1)."""
    n = len(order)
    owner = np.empty(n, dtype=np.int64)
    owner[order] = np.arange(n, dtype=np.int64) * parts // n
    return owner


def _from_owner(owner: np.ndarray, num_clients: int, rng: np.random.Generator, moved: int = 0) -> Partition:
    """Group sample indices by owning client, each client's samples in a random order."""
    shuffled = rng.permutation(len(owner))
    indices = shuffled[np.argsort(owner[shuffled], kind="stable")]
    offsets = np.zeros(num_clients + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=num_clients), out=offsets[1:])
    return Partition(offsets=offsets, indices=indices.astype(np.int64), moved=moved)


def _shards(labels: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator) -> Partition:
    """Sort by label (ties in random order), cut ``clients * S`` equal shards, deal ``S`` each.

    A shard straddles two labels only where a class's count is not a multiple of the shard
    size, so a client holds at most ``S`` classes when they are, at most ``2S`` otherwise.
    """
    n = len(labels)
    num_shards = num_clients * per_client
    if num_shards > n:
        raise UsageError(f"shards:per_client={per_client} with {num_clients} clients needs {num_shards} "
                         f"samples (one per shard); the data has {n}: use per_client <= "
                         f"{max(1, n // num_clients)} or at most {n // per_client} clients")
    tie = rng.permutation(n)
    by_label = tie[np.argsort(labels[tie], kind="stable")]
    shard_of_sample = _equal_cuts(np.arange(n), num_shards)  # position in by_label -> shard
    client_of_shard = np.empty(num_shards, dtype=np.int64)
    client_of_shard[rng.permutation(num_shards)] = np.arange(num_shards) // per_client
    owner = np.empty(n, dtype=np.int64)
    owner[by_label] = client_of_shard[shard_of_sample]
    return _from_owner(owner, num_clients, rng)


def _dirichlet(labels: np.ndarray, num_clients: int, spec: PartitionSpec,
               rng: np.random.Generator) -> Partition:
    """Per class, Dirichlet(alpha) proportions over the clients; then enforce ``min_size``.

    As flwr_datasets' DirichletPartitioner: a draw whose smallest client is under
    ``min_size`` is redrawn (up to :data:`DIRICHLET_TRIES` times). Unlike it, we do not give
    up then: with 1000 clients of ~40 samples and alpha 0.5 about one client in ten is under
    10 in *every* draw, so the best draw is kept and its small clients are topped up from
    the largest ones (``Partition.moved`` says how many samples that took; the label skew of
    the moved samples is kept, see :func:`_top_up`).
    """
    n = len(labels)
    most = n // num_clients
    if spec.min_size is None:
        min_size = min(DEFAULT_MIN_SIZE, most)
    elif spec.min_size > most:
        raise UsageError(f"dirichlet min_size={spec.min_size} with {num_clients} clients needs "
                         f"{spec.min_size * num_clients} training samples; the data has {n}: use "
                         f"min_size <= {most} or at most {n // spec.min_size} clients")
    else:
        min_size = spec.min_size
    classes = np.unique(labels)
    members = [np.flatnonzero(labels == k) for k in classes]
    best: list[np.ndarray] | None = None
    best_min = -1
    for _ in range(DIRICHLET_TRIES):
        counts = [_split_counts(rng.dirichlet(np.full(num_clients, spec.alpha)), len(m)) for m in members]
        smallest = int(np.sum(counts, axis=0).min())
        if smallest > best_min:
            best, best_min = counts, smallest
        if smallest >= min_size:
            break
    assert best is not None
    owner = np.empty(n, dtype=np.int64)
    for m, class_counts in zip(members, best):
        owner[rng.permutation(m)] = np.repeat(np.arange(num_clients, dtype=np.int64), class_counts)
    moved = 0
    if best_min < min_size:
        moved = _top_up(owner, labels, num_clients, min_size, rng)
    return _from_owner(owner, num_clients, rng, moved)


def _split_counts(proportions: np.ndarray, total: int) -> np.ndarray:
    """Integer counts that sum to ``total``, cut at ``floor(cumsum(p) * total)`` like flwr."""
    cuts = np.floor(np.cumsum(proportions) * total).astype(np.int64)
    cuts[-1] = total  # the float cumsum may end at 0.999...
    return np.diff(cuts, prepend=0)


def _top_up(owner: np.ndarray, labels: np.ndarray, num_clients: int, min_size: int,
            rng: np.random.Generator) -> int:
    """Move samples from the largest clients to those under ``min_size``; returns how many.

    The donors are levelled down (the largest give first, none goes under ``min_size``), the
    taken samples are sorted by label and dealt to the small clients in runs, so a topped-up
    client receives one or two classes and stays skewed. Feasible whenever
    ``n >= clients * min_size``, which the caller checked.
    """
    sizes = np.bincount(owner, minlength=num_clients)
    need = np.maximum(min_size - sizes, 0)
    total = int(need.sum())
    # largest level L >= min_size at which the clients above L hold >= total surplus samples
    lo, hi = min_size, int(sizes.max())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.maximum(sizes - mid, 0).sum()) >= total:
            lo = mid
        else:
            hi = mid - 1
    take = np.maximum(sizes - (lo + 1), 0)
    short = total - int(take.sum())  # < number of clients at or above lo + 1, by maximality of lo
    take[np.flatnonzero(sizes >= lo + 1)[:short]] += 1
    # pick `take[c]` random samples of each donor c: rank the samples within their owner
    order = rng.permutation(len(owner))
    order = order[np.argsort(owner[order], kind="stable")]
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    rank = np.arange(len(owner)) - starts[owner[order]]
    taken = order[rank < take[owner[order]]]
    taken = taken[np.argsort(labels[taken], kind="stable")]
    owner[taken] = np.repeat(np.arange(num_clients, dtype=np.int64), need)
    return total


def _natural(users: np.ndarray | None, n: int, num_clients: int) -> Partition:
    """One client per user, in user-index order; a user's samples keep their data order."""
    if users is None:
        raise UsageError("partition 'natural' needs data with users (e.g. --data leaf); this data has "
                         f"none; valid for it: {VALID_FORMS.replace(', natural', '')}")
    users = np.asarray(users)
    if users.shape != (n,) or not np.issubdtype(users.dtype, np.integer):
        raise UsageError(f"users must be one integer per training sample ({n}), got shape {users.shape}")
    ids, owner = np.unique(users, return_inverse=True)
    if len(ids) != num_clients:
        raise UsageError(f"partition 'natural' makes one client per user: the data has {len(ids)} users, "
                         f"so use {len(ids)} clients (got {num_clients})")
    indices = np.argsort(owner, kind="stable").astype(np.int64)
    offsets = np.zeros(num_clients + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=num_clients), out=offsets[1:])
    return Partition(offsets=offsets, indices=indices)


def client_stats(p: Partition, labels: np.ndarray, num_classes: int) -> dict[str, Any]:
    """What the report shows about the clients, as plain JSON types.

    Sizes (min/median/mean/max and a 10-bin histogram), classes per client (min/mean/max)
    and the mean label entropy in bits (0: one class per client; ``log2(num_classes)``:
    uniform), next to its maximum so that skew can be read without knowing the data.
    """
    sizes = p.sizes
    owner = np.repeat(np.arange(p.num_clients, dtype=np.int64), sizes)
    counts = np.bincount(owner * num_classes + np.asarray(labels)[p.indices],
                         minlength=p.num_clients * num_classes).reshape(p.num_clients, num_classes)
    present = (counts > 0).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = counts / np.maximum(sizes, 1)[:, None]
        entropy = -np.where(counts > 0, frac * np.log2(frac), 0.0).sum(axis=1)
    hist, edges = np.histogram(sizes, bins=min(10, max(1, int(sizes.max() - sizes.min()) + 1)))
    return {
        "clients": int(p.num_clients),
        "samples": int(sizes.sum()),
        "size_min": int(sizes.min()),
        "size_median": float(np.median(sizes)),
        "size_mean": float(sizes.mean()),
        "size_max": int(sizes.max()),
        "size_histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in hist]},
        "classes_per_client_min": int(present.min()),
        "classes_per_client_mean": float(present.mean()),
        "classes_per_client_max": int(present.max()),
        "label_entropy_bits_mean": float(entropy.mean()),
        "label_entropy_bits_max": float(math.log2(num_classes)) if num_classes > 0 else 0.0,
        "moved_for_min_size": int(p.moved),
    }


def sample_clients(num_clients: int, per_round: int, *, seed: int, round: int) -> np.ndarray:
    """The ``per_round`` distinct clients of round ``round``, sorted (int64).

    Drawn from a generator seeded by ``(seed, round)`` alone, so any worker, a resumed run
    and the Flower side all pick the same clients without talking to each other.
    """
    for name, value in (("number of clients", num_clients), ("clients per round", per_round)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
    if per_round > num_clients:
        raise UsageError(f"clients per round ({per_round}) cannot exceed the number of clients "
                         f"({num_clients}); valid: 1..{num_clients}")
    if round < 0:
        raise UsageError(f"round must be >= 0, got {round}")
    if per_round == num_clients:
        return np.arange(num_clients, dtype=np.int64)
    rng = np.random.default_rng([_SAMPLING_STREAM, seed % 2**63, round])
    return np.sort(rng.choice(num_clients, size=per_round, replace=False)).astype(np.int64)


__all__ = ["DEFAULT_MIN_SIZE", "DIRICHLET_TRIES", "KINDS", "VALID_FORMS", "Partition", "PartitionSpec",
           "client_stats", "make_partition", "parse_partition", "sample_clients"]

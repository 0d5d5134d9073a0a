"""Seeded, stratified train/test splits and subsets that every process computes alike.

Rows are ordered by a keyed hash (BLAKE2b of ``salt:seed:name``), not by a random generator:
the edge and the cloud, possibly on two machines with different numpy versions, must pick the
same rows, and a hash gives that with no shared state and no dependence on numpy's streams.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def hash_keys(names: Sequence[str], seed: int, salt: str) -> np.ndarray:
    """A pseudo-random uint64 per name, the same on every machine and numpy version."""
    keys = np.empty(len(names), dtype=np.uint64)
    for i, name in enumerate(names):
        digest = hashlib.blake2b(f"{salt}:{seed}:{name}".encode(), digest_size=8).digest()
        keys[i] = int.from_bytes(digest, "little")
    return keys


def _row_names(n: int) -> list[str]:
    return [str(i) for i in range(n)]


def stratified_split(labels: np.ndarray, *, test_fraction: float, seed: int,
                     groups: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Train and test row indices (each sorted), every class split ``1 - f : f``.

    Class ``c`` with ``n_c`` rows should give ``t_c = floor(n_c * f + 0.5)`` rows to the test
    set. Rows with the same ``groups`` entry (for tweets: the same text) go to the same side,
    so a duplicated text can never be trained on and then tested; without ``groups`` every
    row is its own group. Groups are visited in the order of their hash keys and one joins the
    test set if no class would then exceed its ``t_c``: with single-row groups every class
    gets exactly ``t_c``; a large group that does not fit stays in train.
    """
    labels = np.asarray(labels, dtype=np.int64)
    names = list(groups) if groups is not None else _row_names(len(labels))
    if len(names) != len(labels):
        raise ValueError(f"{len(labels)} labels but {len(names)} group names")
    index: dict[str, int] = {}
    group_of = np.array([index.setdefault(g, len(index)) for g in names], dtype=np.int64)
    classes, class_of = np.unique(labels, return_inverse=True)
    sizes = np.zeros((len(index), len(classes)), dtype=np.int64)
    np.add.at(sizes, (group_of, class_of), 1)
    target = np.floor(sizes.sum(axis=0) * test_fraction + 0.5).astype(np.int64)
    keys = hash_keys(list(index), seed, "split")
    taken = np.zeros(len(classes), dtype=np.int64)
    in_test = np.zeros(len(index), dtype=bool)
    for g in np.lexsort((np.arange(len(index)), keys)).tolist():
        if np.array_equal(taken, target):
            break
        if np.all(taken + sizes[g] <= target):
            taken += sizes[g]
            in_test[g] = True
    test_rows = in_test[group_of]
    return np.flatnonzero(~test_rows).astype(np.int64), np.flatnonzero(test_rows).astype(np.int64)


def _allocate(counts: np.ndarray, k: int) -> np.ndarray:
    """Split ``k`` over classes in proportion to ``counts`` (largest remainder, ties to the
    lower class), never more than a class has."""
    quota = counts * (k / counts.sum())
    take = np.minimum(np.floor(quota).astype(np.int64), counts)
    order = sorted(range(len(counts)), key=lambda c: (-(quota[c] - np.floor(quota[c])), c))
    while take.sum() < k:
        for c in order:
            if take.sum() < k and take[c] < counts[c]:
                take[c] += 1
    return take


def stratified_subset(labels: np.ndarray, k: int, *, seed: int, salt: str = "subset") -> np.ndarray:
    """``min(k, len(labels))`` row indices (sorted) with the class shares of ``labels``.

    The rows of each class are taken in hash-key order, so a larger ``k`` keeps every row a
    smaller one chose (up to the one-row rounding of each class's share).
    """
    labels = np.asarray(labels, dtype=np.int64)
    if k >= len(labels):
        return np.arange(len(labels), dtype=np.int64)
    keys = hash_keys(_row_names(len(labels)), seed, salt)
    classes, counts = np.unique(labels, return_counts=True)
    take = _allocate(counts.astype(np.int64), k)
    chosen = []
    for c, t in zip(classes, take):
        members = np.flatnonzero(labels == c)
        chosen.append(members[np.lexsort((members, keys[members]))][:t])
    return np.sort(np.concatenate(chosen)).astype(np.int64)

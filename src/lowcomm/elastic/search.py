"""Latency-constrained architecture search over a supernet's space: evolution and random.

Once-for-All's EvolutionFinder: a population of random configs that meet the latency budget;
each iteration keeps the best ``parents`` fraction and refills the population with mutations
(each position resampled with probability ``mutate_prob``) of random parents and crossovers
(each position taken from one of two parents) of random pairs. A child over the budget is
rejected and redrawn, so every config ever scored meets the budget. Random search (``n``
random configs under the budget, best by score) is the baseline the issue asks it to beat.

Configs are compared after ``space.canonical`` (positions a config cannot reach, e.g. blocks past
the active depth, do not make a new network), and ``score_fn``/``latency_fn`` are called once per
canonical config: scoring may mean evaluating a network on held-out data.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from functools import partial

from lowcomm.elastic.space import Config, SearchSpace
from lowcomm.errors import UsageError

__all__ = ["evolution_search", "random_search", "SearchResult"]

#: (best config, its score, best score so far after each iteration / sample).
SearchResult = tuple[Config, float, list[float]]


class _Cached:
    """``score_fn``/``latency_fn`` memoized per canonical config (JSON of it as the key)."""

    def __init__(self, space: SearchSpace, fn: Callable[[Config], float]) -> None:
        self.space, self.fn = space, fn
        self.cache: dict[str, float] = {}

    def key(self, config: Config, *, canonical: bool = False) -> str:
        return json.dumps(config if canonical else self.space.canonical(config), sort_keys=True)

    def __call__(self, config: Config, *, canonical: bool = False) -> float:
        if not canonical:
            config = self.space.canonical(config)
        key = self.key(config, canonical=True)
        if key not in self.cache:
            self.cache[key] = float(self.fn(config))
        return self.cache[key]


def _check_budget(space: SearchSpace, latency: _Cached, budget_ms: float) -> None:
    if not (isinstance(budget_ms, (int, float)) and math.isfinite(budget_ms) and budget_ms > 0):
        raise UsageError(f"the latency budget must be a positive number of ms, got {budget_ms!r}")
    smallest = space.min_config()
    floor = latency(smallest)
    if floor > budget_ms:
        raise UsageError(
            f"latency budget {budget_ms:g} ms is below the smallest network's latency "
            f"{floor:.4g} ms (config {smallest}): no sub-network meets it; "
            f"use a budget >= {floor:.4g} ms"
        )


def _draw(
    make: Callable[[], Config],
    latency: _Cached,
    budget_ms: float,
    seen: set[str],
    tries: int,
) -> Config | None:
    """A new (canonical-unseen) config from ``make`` under the budget, or None after ``tries``."""
    for _ in range(tries):
        config = latency.space.canonical(make())
        key = latency.key(config, canonical=True)
        if key not in seen and latency(config, canonical=True) <= budget_ms:
            seen.add(key)
            return config
    return None


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")


def evolution_search(
    space: SearchSpace,
    score_fn: Callable[[Config], float],
    latency_fn: Callable[[Config], float],
    budget_ms: float,
    *,
    population: int = 100,
    iterations: int = 50,
    mutate_prob: float = 0.1,
    parents: float = 0.25,
    mutation_ratio: float = 0.5,
    rng: random.Random | None = None,
    max_tries: int = 100,
) -> SearchResult:
    """The highest-``score_fn`` config with ``latency_fn(config) <= budget_ms`` found by evolution.

    ``parents``: fraction of the population kept each iteration; ``mutation_ratio``: fraction of
    the population made by mutation (the rest of the refill by crossover). ``max_tries``: draws
    per child before giving up on it (a tight budget admits few configs; the population then
    stays smaller rather than looping forever). Raises UsageError when even the smallest
    network (``space.min_config()``) is over the budget.
    """
    _check_counts(population=population, iterations=iterations, max_tries=max_tries)
    for name, value in (("mutate_prob", mutate_prob), ("parents", parents),
                        ("mutation_ratio", mutation_ratio)):
        if not 0.0 <= value <= 1.0:
            raise UsageError(f"{name} must be in [0, 1], got {value!r}")
    rng = rng or random.Random(0)
    score, latency = _Cached(space, score_fn), _Cached(space, latency_fn)
    _check_budget(space, latency, budget_ms)
    seen: set[str] = set()
    members: list[Config] = []
    for _ in range(population):
        child = _draw(lambda: space.sample(rng), latency, budget_ms, seen, max_tries)
        if child is not None:
            members.append(child)
    if not members:  # random draws never fit: start from the smallest network, which does
        smallest = space.canonical(space.min_config())
        seen.add(latency.key(smallest))
        members.append(smallest)
    keep = max(1, int(round(parents * population)))
    mutations = int(round(mutation_ratio * population))
    best_config, best_score = members[0], score(members[0])
    history: list[float] = []
    for _ in range(iterations):
        members.sort(key=lambda c: score(c, canonical=True), reverse=True)
        if score(members[0]) > best_score:
            best_config, best_score = members[0], score(members[0])
        history.append(best_score)
        elders = members[:keep]
        # Distinct within the population only: a child equal to a config dropped earlier is
        # allowed back (its score is cached), which keeps a converged population refillable.
        seen = {latency.key(c) for c in elders}
        children: list[Config] = []
        for i in range(max(0, population - len(elders))):
            if i < mutations:
                make = partial(space.mutate, rng.choice(elders), rng, mutate_prob)
            else:
                make = partial(space.crossover, rng.choice(elders), rng.choice(elders), rng)
            child = _draw(make, latency, budget_ms, seen, max_tries)
            if child is not None:
                children.append(child)
        members = elders + children
    members.sort(key=lambda c: score(c, canonical=True), reverse=True)
    if score(members[0]) > best_score:
        best_config, best_score = members[0], score(members[0])
        history[-1] = best_score
    return best_config, best_score, history


def random_search(
    space: SearchSpace,
    score_fn: Callable[[Config], float],
    latency_fn: Callable[[Config], float],
    budget_ms: float,
    n: int = 50,
    rng: random.Random | None = None,
    *,
    max_tries: int = 10_000,
) -> SearchResult:
    """The best of ``n`` distinct random configs (``space.sample``) that meet the budget.

    Raises UsageError when the smallest network is over the budget, or when ``max_tries`` draws
    did not find ``n`` distinct configs under it (a budget so tight that "50 random
    sub-networks meeting it" do not exist or are too rare to draw).
    """
    _check_counts(n=n, max_tries=max_tries)
    rng = rng or random.Random(0)
    score, latency = _Cached(space, score_fn), _Cached(space, latency_fn)
    _check_budget(space, latency, budget_ms)
    seen: set[str] = set()
    best_config: Config | None = None
    history: list[float] = []
    best_score, tries = -math.inf, 0
    while len(history) < n:
        if tries >= max_tries:
            raise UsageError(
                f"only {len(history)} of n={n} distinct random configs under {budget_ms:g} ms "
                f"found in {max_tries} draws: raise the budget or lower n"
            )
        tries += 1
        config = space.canonical(space.sample(rng))
        key = latency.key(config, canonical=True)
        if key in seen or latency(config, canonical=True) > budget_ms:
            seen.add(key)
            continue
        seen.add(key)
        if best_config is None or score(config) > best_score:
            best_config, best_score = config, score(config)
        history.append(best_score)
    assert best_config is not None
    return best_config, best_score, history

"""Evolutionary and random search under a latency budget, and the accuracy predictor.

Synthetic problem with a known answer: 8 positions choosing 1..3, score = weighted sum (weights
differ per position), latency = sum + extra cost on the first half. Small enough (3^8 configs)
to find the true optimum under the budget by enumeration.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from lowcomm.elastic.predictor import AccuracyPredictor, rank_correlation, split_configs
from lowcomm.elastic.search import evolution_search, random_search
from lowcomm.elastic.space import Config, Dimension, SearchSpace
from lowcomm.errors import UsageError

WEIGHTS = [5, 1, 4, 2, 7, 3, 6, 2]
SPACE = SearchSpace([Dimension("expand", (1, 2, 3), 8)])
BUDGET = 20.0


def score(config: Config) -> float:
    return float(sum(w * v for w, v in zip(WEIGHTS, config["expand"])))


def latency(config: Config) -> float:
    v = config["expand"]
    return float(sum(v) + 0.5 * sum(x * x for x in v[:4]))


def optimum(budget: float) -> float:
    configs = ({"expand": list(v)} for v in itertools.product((1, 2, 3), repeat=8))
    return max(score(c) for c in configs if latency(c) <= budget)


def test_evolution_finds_the_known_optimum_and_beats_random_search() -> None:
    best = optimum(BUDGET)
    evo_scores, random_scores = [], []
    for seed in range(3):
        config, value, history = evolution_search(
            SPACE, score, latency, BUDGET, population=20, iterations=15, rng=random.Random(seed)
        )
        assert latency(config) <= BUDGET and value == score(config)
        assert len(history) == 15 and history == sorted(history)  # best so far never drops
        evo_scores.append(value)
        _, rvalue, rhistory = random_search(SPACE, score, latency, BUDGET, n=50, rng=random.Random(seed))
        assert len(rhistory) == 50
        random_scores.append(rvalue)
    assert max(evo_scores) == best
    assert sum(evo_scores) > sum(random_scores)
    assert all(e >= r for e, r in zip(evo_scores, random_scores))


def test_every_config_scored_meets_the_budget() -> None:
    scored: list[Config] = []

    def spy(config: Config) -> float:
        scored.append(config)
        return score(config)

    evolution_search(SPACE, spy, latency, 14.0, population=10, iterations=5, rng=random.Random(1))
    random_search(SPACE, spy, latency, 14.0, n=10, rng=random.Random(1))
    assert scored and all(latency(c) <= 14.0 for c in scored)


def test_score_is_computed_once_per_canonical_config() -> None:
    # Depth 1 makes the second block's kernel unreachable: {3,7} and {3,3} are one network.
    space = SearchSpace(
        [Dimension("kernel", (3, 5, 7), 2), Dimension("depth", (1, 2), 1)], depth_groups=[[0, 1]]
    )
    calls: list[str] = []

    def counted(config: Config) -> float:
        calls.append(json.dumps(config, sort_keys=True))
        return float(sum(config["kernel"]) * config["depth"][0])

    evolution_search(space, counted, lambda c: 1.0, 10.0, population=8, iterations=6,
                     rng=random.Random(0))
    assert len(calls) == len(set(calls))
    decoded = [json.loads(c) for c in calls]
    assert all(c["kernel"][1] == 7 for c in decoded if c["depth"] == [1])
    assert len(calls) <= 3 + 9  # the distinct networks: depth 1 (3 kernels) + depth 2 (9)


def test_a_budget_below_the_smallest_network_names_the_minimum() -> None:
    floor = latency(SPACE.min_config())  # 10.0
    with pytest.raises(UsageError, match=r"smallest network's latency 10 ms"):
        evolution_search(SPACE, score, latency, floor - 0.5, population=5, iterations=2)
    with pytest.raises(UsageError, match=r"below the smallest"):
        random_search(SPACE, score, latency, floor - 0.5, n=5)


def test_a_budget_only_the_smallest_network_meets_still_returns_it() -> None:
    floor = latency(SPACE.min_config())
    config, _, _ = evolution_search(SPACE, score, latency, floor, population=5, iterations=2,
                                    rng=random.Random(0))
    assert config == SPACE.min_config()
    with pytest.raises(UsageError, match=r"only [01] of n=5 distinct random configs"):
        random_search(SPACE, score, latency, floor, n=5, max_tries=200)


@pytest.mark.parametrize("kwargs", [{"population": 0}, {"parents": 1.5}, {"iterations": -1}])
def test_bad_search_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        evolution_search(SPACE, score, latency, BUDGET, **kwargs)


def test_predictor_learns_a_linear_score_well_enough_to_rank() -> None:
    rng = random.Random(0)
    configs = [SPACE.sample(rng) for _ in range(300)]
    scores = [score(c) for c in configs]
    train, held = split_configs(configs, 0.3, seed=0)
    predictor = AccuracyPredictor(SPACE, hidden=32)
    losses = predictor.fit([configs[i] for i in train], [scores[i] for i in train], epochs=60)
    assert losses[-1] < losses[0]
    predicted = predictor.predict([configs[i] for i in held])
    assert rank_correlation(predicted, [scores[i] for i in held]) > 0.9
    assert predictor(configs[0]) == pytest.approx(predictor.predict([configs[0]])[0])


def test_predictor_save_load_round_trip(tmp_path) -> None:
    rng = random.Random(1)
    configs = [SPACE.sample(rng) for _ in range(40)]
    predictor = AccuracyPredictor(SPACE, hidden=8)
    predictor.fit(configs, [score(c) for c in configs], epochs=3)
    predictor.save(tmp_path / "p.pt")
    again = AccuracyPredictor.load(tmp_path / "p.pt", space=SPACE)
    assert again.predict(configs) == predictor.predict(configs)
    other = SearchSpace([Dimension("expand", (1, 2), 8)])
    with pytest.raises(UsageError, match="trained for"):
        AccuracyPredictor.load(tmp_path / "p.pt", space=other)


def test_rank_correlation_matches_known_values() -> None:
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1], "spearman") == pytest.approx(-1.0)
    # Kendall tau-b with one tie: (C - D) / sqrt((C+D+Tx)(C+D+Ty)) = (5-0)/sqrt(5*6)
    assert rank_correlation([1, 2, 3, 4], [1, 2, 2, 3]) == pytest.approx(5 / 30**0.5)
    scipy_stats = pytest.importorskip("scipy.stats")
    a, b = [3.0, 1, 4, 1, 5, 9, 2, 6], [2.0, 7, 1, 8, 2, 8, 1, 8]
    assert rank_correlation(a, b) == pytest.approx(scipy_stats.kendalltau(a, b)[0])
    assert rank_correlation(a, b, "spearman") == pytest.approx(scipy_stats.spearmanr(a, b)[0])
    with pytest.raises(UsageError, match="kendall"):
        rank_correlation(a, b, "pearson")


def test_evolution_on_the_elastic_cnn1d_space_with_a_table_stays_under_the_budget() -> None:
    from lowcomm.elastic.classifier import elastic_cnn1d
    from lowcomm.elastic.latency import LatencyTable

    net = elastic_cnn1d()

    def size(module, shapes) -> float:  # deterministic stand-in for time
        return float(sum(p.numel() for p in module.parameters()))

    table = LatencyTable.measure(net, net.space, (40,), samples=2, timer=size)
    low, high = table.predict(net.space.min_config()), table.predict(net.space.max_config())
    budget = low + 0.3 * (high - low)
    wide = lambda c: float(sum(c["width"]) + sum(c["depth"]))  # noqa: E731
    config, value, _ = evolution_search(net.space, wide, table.predict, budget, population=12,
                                        iterations=4, rng=random.Random(0))
    assert table.predict(config) <= budget and value == wide(config)
    assert value > wide(net.space.min_config())

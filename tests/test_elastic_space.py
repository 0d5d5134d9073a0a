"""Search-space behaviour: sampling, validation, canonical forms, features, mutation, crossover."""

from __future__ import annotations

import json
import random

import pytest

from lowcomm.elastic.space import Dimension, Gate, SearchSpace
from lowcomm.errors import UsageError


def small_space() -> SearchSpace:
    # two stages of three blocks: blocks 0-2 and 3-5
    return SearchSpace(
        [
            Dimension("kernel", (3, 5, 7), 6),
            Dimension("expand", (2, 3, 4), 6),
            Dimension("depth", (1, 2, 3), 2),
            Dimension("width", (50, 75, 100), 2),
        ],
        depth_groups=[[0, 1, 2], [3, 4, 5]],
    )


def test_max_and_min_configs_take_the_extreme_choice_everywhere() -> None:
    space = small_space()
    assert space.max_config() == {"kernel": [7] * 6, "expand": [4] * 6, "depth": [3, 3], "width": [100, 100]}
    assert space.min_config() == {"kernel": [3] * 6, "expand": [2] * 6, "depth": [1, 1], "width": [50, 50]}


def test_sample_keeps_non_elastic_dims_at_max_and_is_seeded() -> None:
    space = small_space()
    configs = [space.sample(random.Random(i), elastic={"kernel"}) for i in range(20)]
    for c in configs:
        assert c["expand"] == [4] * 6 and c["depth"] == [3, 3] and c["width"] == [100, 100]
        assert space.validate(c) == c
    assert len({tuple(c["kernel"]) for c in configs}) > 1
    assert space.sample(random.Random(5)) == space.sample(random.Random(5))


def test_sample_refuses_unknown_elastic_dimension() -> None:
    with pytest.raises(UsageError, match="scales"):
        small_space().sample(random.Random(0), elastic={"scales"})


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"kernel": [3, 5, 7, 9, 3, 3]}, ["kernel", "9", "[3, 5, 7]"]),
        ({"depth": [1]}, ["depth", "2 values"]),
        ({"width": [50, True]}, ["width", "[50, 75, 100]"]),
        ({"scales": [1]}, ["unknown", "scales"]),
    ],
)
def test_validate_names_the_bad_dimension_and_the_valid_choices(change: dict, words: list[str]) -> None:
    space = small_space()
    config = {**space.max_config(), **change}
    with pytest.raises(UsageError) as err:
        space.validate(config)
    for w in words:
        assert w in str(err.value)


def test_validate_reports_missing_dimension() -> None:
    config = small_space().max_config()
    del config["expand"]
    with pytest.raises(UsageError, match="missing \\['expand'\\]"):
        small_space().validate(config)


def test_canonical_sets_blocks_beyond_depth_to_max() -> None:
    space = small_space()
    a = {"kernel": [3, 3, 3, 5, 5, 5], "expand": [2, 2, 2, 3, 3, 3], "depth": [1, 2], "width": [50, 75]}
    b = {"kernel": [3, 5, 7, 5, 5, 3], "expand": [2, 4, 3, 3, 3, 2], "depth": [1, 2], "width": [50, 75]}
    assert space.canonical(a) == space.canonical(b)
    assert space.canonical(a) == {
        "kernel": [3, 7, 7, 5, 5, 7], "expand": [2, 4, 4, 3, 3, 4], "depth": [1, 2], "width": [50, 75]
    }
    assert space.encode(a) == space.encode(b)
    c = {**a, "kernel": [5, 3, 3, 5, 5, 5]}  # a reachable position differs
    assert space.canonical(a) != space.canonical(c)


def test_explicit_gate_hides_positions_of_unused_scales() -> None:
    space = SearchSpace(
        [Dimension("scales", (1, 2, 3), 1), Dimension("kernel", (3, 5), 3)],
        gates=[Gate("scales", 0, "kernel", ((0,), (1,), (2,)))],
    )
    assert space.canonical({"scales": [1], "kernel": [3, 3, 3]}) == {"scales": [1], "kernel": [3, 5, 5]}
    assert SearchSpace.from_json(json.loads(json.dumps(space.to_json()))) == space


def test_encode_is_one_hot_per_position() -> None:
    space = small_space()
    feats = space.encode(space.min_config())
    assert len(feats) == space.num_features == 3 * 6 + 3 * 6 + 3 * 2 + 3 * 2
    assert sum(feats) == 6 + 6 + 2 + 2
    assert feats[:3] == [1.0, 0.0, 0.0]


def test_mutate_with_zero_probability_is_identity_and_with_one_stays_valid() -> None:
    space = small_space()
    rng = random.Random(0)
    c = space.sample(rng)
    assert space.mutate(c, rng, 0.0) == c
    changed = [space.mutate(c, rng, 1.0) for _ in range(5)]
    for m in changed:
        assert space.validate(m) == m
    assert any(m != c for m in changed)
    with pytest.raises(UsageError, match="probability"):
        space.mutate(c, rng, 1.5)


def test_crossover_takes_each_position_from_a_parent() -> None:
    space = small_space()
    a, b = space.min_config(), space.max_config()
    child = space.crossover(a, b, random.Random(3))
    for name in space.names:
        for x, y, z in zip(a[name], b[name], child[name], strict=True):
            assert z in (x, y)
    assert child not in (a, b)


def test_json_round_trip_gives_an_equal_space() -> None:
    space = small_space()
    again = SearchSpace.from_json(json.loads(json.dumps(space.to_json())))
    assert again == space
    assert again.canonical(space.min_config()) == space.canonical(space.min_config())


def test_dimension_refuses_unsorted_choices() -> None:
    with pytest.raises(UsageError, match="ascending"):
        Dimension("kernel", (5, 3), 1)

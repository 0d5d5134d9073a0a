"""Client partitions (iid, Dirichlet, shards, natural), their statistics, and client sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lowcomm.errors import UsageError
from lowcomm.fl.partition import (
    VALID_FORMS,
    Partition,
    PartitionSpec,
    client_stats,
    make_partition,
    parse_partition,
    sample_clients,
)


def _labels(n: int = 4000, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, n).astype(np.int64)


def _balanced(per_class: int = 100, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(1).permutation(np.repeat(np.arange(classes), per_class)).astype(np.int64)


def _assert_exact_cover(p: Partition, n: int) -> None:
    assert p.offsets[0] == 0 and p.offsets[-1] == n and np.all(np.diff(p.offsets) >= 1)
    assert np.array_equal(np.sort(p.indices), np.arange(n))  # every sample once, none twice
    assert p.sizes.sum() == n
    assert np.array_equal(np.concatenate([p.client(c) for c in range(p.num_clients)]), p.indices)


@pytest.mark.parametrize("spec", ["iid", "dirichlet:alpha=0.5", "dirichlet:alpha=0.05,min_size=5",
                                  "shards:per_client=2"])
def test_every_sample_belongs_to_exactly_one_client(spec: str) -> None:
    labels = _labels()
    p = make_partition(spec, labels=labels, num_clients=100, seed=3)
    assert p.num_clients == 100
    _assert_exact_cover(p, len(labels))


@pytest.mark.parametrize("spec", ["iid", "dirichlet:alpha=0.3", "shards:per_client=3"])
def test_partition_is_a_function_of_spec_labels_clients_and_seed(spec: str) -> None:
    labels = _labels()
    a = make_partition(spec, labels=labels, num_clients=50, seed=7)
    b = make_partition(parse_partition(spec), labels=labels.copy(), num_clients=50, seed=7)
    c = make_partition(spec, labels=labels, num_clients=50, seed=8)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.indices, b.indices)
    assert not np.array_equal(a.indices, c.indices)


def test_partition_does_not_touch_or_depend_on_the_global_rng() -> None:
    labels = _labels()
    np.random.seed(0)
    untouched = np.random.random()
    np.random.seed(0)
    a = make_partition("dirichlet:alpha=0.5", labels=labels, num_clients=40, seed=1)
    assert np.random.random() == untouched
    np.random.seed(123)
    b = make_partition("dirichlet:alpha=0.5", labels=labels, num_clients=40, seed=1)
    assert np.array_equal(a.indices, b.indices)


def test_iid_sizes_differ_by_at_most_one() -> None:
    p = make_partition("iid", labels=_labels(1003), num_clients=10, seed=0)
    assert set(p.sizes.tolist()) == {100, 101} and p.sizes.sum() == 1003


def test_dirichlet_holds_min_size_and_keeps_the_label_skew() -> None:
    labels = _labels()
    p = make_partition("dirichlet:alpha=0.1,min_size=20", labels=labels, num_clients=100, seed=0)
    assert p.sizes.min() >= 20
    stats = client_stats(p, labels, 10)
    iid = client_stats(make_partition("iid", labels=labels, num_clients=100, seed=0), labels, 10)
    assert stats["label_entropy_bits_mean"] < iid["label_entropy_bits_mean"] - 1.0


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    labels = _labels()
    entropy = [client_stats(make_partition(f"dirichlet:alpha={a}", labels=labels, num_clients=50, seed=2),
                            labels, 10)["label_entropy_bits_mean"] for a in (100.0, 1.0, 0.1)]
    assert entropy[0] > entropy[1] > entropy[2]


def test_dirichlet_at_the_issue_scale_tops_up_small_clients_instead_of_failing() -> None:
    # 1000 clients of ~40 samples with alpha 0.5: a pure redraw almost never leaves every client
    # with >= 10 samples, so the smallest are topped up (and the report says how many moved)
    labels = _labels(40_000)
    p = make_partition("dirichlet:alpha=0.5", labels=labels, num_clients=1000, seed=0)
    _assert_exact_cover(p, len(labels))
    assert p.sizes.min() >= 10
    assert 0 <= p.moved < len(labels) // 100
    assert client_stats(p, labels, 10)["moved_for_min_size"] == p.moved


def test_dirichlet_default_min_size_is_capped_to_the_data() -> None:
    # 300 samples over 100 clients: the default 10 cannot hold, 3 per client can
    p = make_partition("dirichlet:alpha=0.5", labels=_labels(300), num_clients=100, seed=0)
    assert p.sizes.min() >= 3 and p.sizes.sum() == 300


def test_dirichlet_impossible_min_size_names_the_data_and_the_limits() -> None:
    with pytest.raises(UsageError, match=r"10000 training samples; the data has 4000: use min_size <= 4 "
                                         r"or at most 400 clients"):
        make_partition("dirichlet:alpha=0.5,min_size=10", labels=_labels(), num_clients=1000, seed=0)


def test_shards_give_each_client_at_most_per_client_classes() -> None:
    labels = _balanced(per_class=100)  # 40 shards of 25: every shard holds one label
    p = make_partition("shards:per_client=2", labels=labels, num_clients=20, seed=4)
    _assert_exact_cover(p, len(labels))
    assert np.all(p.sizes == 50)
    assert client_stats(p, labels, 10)["classes_per_client_max"] <= 2


def test_shards_refuse_more_shards_than_samples() -> None:
    with pytest.raises(UsageError, match="the data has 100: use per_client <= 1 or at most 50 clients"):
        make_partition("shards:per_client=2", labels=_labels(100), num_clients=60, seed=0)


def test_natural_makes_one_client_per_user() -> None:
    users = np.array([2, 0, 2, 1, 0, 2], dtype=np.int64)
    p = make_partition("natural", labels=np.zeros(6, dtype=np.int64), num_clients=3, seed=0, users=users)
    assert [p.client(c).tolist() for c in range(3)] == [[1, 4], [3], [0, 2, 5]]


def test_natural_needs_users_and_the_matching_number_of_clients() -> None:
    labels = np.zeros(6, dtype=np.int64)
    with pytest.raises(UsageError, match="needs data with users"):
        make_partition("natural", labels=labels, num_clients=3, seed=0)
    with pytest.raises(UsageError, match="the data has 2 users, so use 2 clients"):
        make_partition("natural", labels=labels, num_clients=3, seed=0, users=np.array([0, 1] * 3))


def test_ten_thousand_clients_build_without_per_sample_python_loops() -> None:
    labels = _labels(200_000)
    for spec in ("iid", "dirichlet:alpha=0.5"):
        p = make_partition(spec, labels=labels, num_clients=10_000, seed=0)
        assert p.num_clients == 10_000 and p.sizes.sum() == len(labels) and p.sizes.min() >= 10


def test_more_clients_than_samples_is_refused() -> None:
    with pytest.raises(UsageError, match="the data has 5: use at most 5 clients"):
        make_partition("iid", labels=_labels(5), num_clients=6, seed=0)


@pytest.mark.parametrize("text, expected", [
    ("iid", PartitionSpec("iid")),
    ("natural", PartitionSpec("natural")),
    ("dirichlet", PartitionSpec("dirichlet", alpha=0.5)),
    ("dirichlet:alpha=0.3,min_size=5", PartitionSpec("dirichlet", alpha=0.3, min_size=5)),
    (" shards:per_client=4 ", PartitionSpec("shards", per_client=4)),
])
def test_specs_parse_and_print_back(text: str, expected: PartitionSpec) -> None:
    assert parse_partition(text) == expected
    assert parse_partition(str(expected)) == expected


@pytest.mark.parametrize("text, message", [
    ("dirichelt:alpha=0.5", "did you mean 'dirichlet'"),
    ("random", "unknown partition"),
    ("dirichlet:beta=1", "has no option 'beta'; its options: alpha, min_size"),
    ("iid:alpha=1", "has no option 'alpha'; its options: none"),
    ("dirichlet:alpha", "must look like key=value"),
    ("dirichlet:alpha=0", "alpha must be a finite number > 0"),
    ("dirichlet:alpha=nan", "alpha must be a finite number > 0"),
    ("dirichlet:min_size=0", "min_size must be an integer >= 1"),
    ("shards:per_client=1.5", "per_client must be an integer"),
    ("shards:per_client=0", "per_client must be an integer >= 1"),
])
def test_bad_specs_are_refused_with_the_valid_forms(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        parse_partition(text)
    if "option" in message or "unknown" in message or "did you mean" in message:
        assert VALID_FORMS in str(info.value)


def test_client_stats_are_plain_json() -> None:
    labels = _labels(1000)
    stats = client_stats(make_partition("dirichlet:alpha=0.5", labels=labels, num_clients=20, seed=0),
                         labels, 10)
    assert json.loads(json.dumps(stats)) == stats
    assert stats["clients"] == 20 and stats["samples"] == 1000
    assert stats["size_min"] <= stats["size_median"] <= stats["size_max"]
    assert sum(stats["size_histogram"]["counts"]) == 20
    assert 1 <= stats["classes_per_client_min"] <= stats["classes_per_client_max"] <= 10
    assert 0.0 <= stats["label_entropy_bits_mean"] <= stats["label_entropy_bits_max"]


def test_sampled_clients_are_distinct_sorted_and_reproducible_per_round() -> None:
    a = sample_clients(1000, 100, seed=5, round=3)
    assert a.dtype == np.int64 and len(np.unique(a)) == 100 and np.all(np.diff(a) > 0)
    assert np.array_equal(a, sample_clients(1000, 100, seed=5, round=3))
    assert not np.array_equal(a, sample_clients(1000, 100, seed=5, round=4))
    assert not np.array_equal(a, sample_clients(1000, 100, seed=6, round=3))
    assert np.array_equal(sample_clients(7, 7, seed=0, round=0), np.arange(7))


def test_sampling_more_clients_than_exist_is_refused() -> None:
    with pytest.raises(UsageError, match=r"cannot exceed the number of clients \(10\); valid: 1..10"):
        sample_clients(10, 11, seed=0, round=0)

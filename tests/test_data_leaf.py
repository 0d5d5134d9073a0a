"""The ``leaf`` dataset: LEAF's JSON layout read into a DataBundle that knows its users."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lowcomm import data
from lowcomm.errors import UsageError
from lowcomm.fl.partition import make_partition


def _user(n: int, label: int, dim: int = 3) -> dict[str, Any]:
    return {"x": [[float(label) + i / 10] * dim for i in range(n)], "y": [label] * n}


def _write(path: Path, users: dict[str, dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"users": list(users), "num_samples": [len(u["y"]) for u in users.values()], "user_data": users}
    path.write_text(json.dumps(doc))


@pytest.fixture
def leaf_dir(tmp_path: Path) -> Path:
    # users listed out of name order and spread over two train files
    _write(tmp_path / "train" / "b.json", {"w2": _user(3, 4), "w0": _user(2, 1)})
    _write(tmp_path / "train" / "a.json", {"w1": _user(4, 0)})
    _write(tmp_path / "test" / "a.json", {"w0": _user(1, 1), "w1": _user(1, 6), "w2": _user(2, 4)})
    return tmp_path


def test_leaf_numbers_users_by_sorted_name_one_index_per_training_sample(leaf_dir: Path) -> None:
    bundle = data.create("leaf", data_dir=leaf_dir)
    assert bundle.task == "classification" and bundle.input_shape == (3,)
    assert bundle.num_classes == 7  # max label over train and test (6) + 1
    assert bundle.users is not None and bundle.users.dtype == np.int64
    assert bundle.users.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2]  # w0 (2), w1 (4), w2 (3)
    x, y = bundle.train.tensors  # type: ignore[attr-defined]
    assert x.dtype == torch.float32 and x.shape == (9, 3)
    assert y.tolist() == [1, 1, 0, 0, 0, 0, 4, 4, 4]
    assert bundle.test.tensors[1].tolist() == [1, 6, 4, 4]  # type: ignore[attr-defined]


def test_leaf_users_give_the_natural_partition(leaf_dir: Path) -> None:
    bundle = data.create("leaf", data_dir=leaf_dir)
    labels = bundle.train.tensors[1].numpy()  # type: ignore[attr-defined]
    p = make_partition("natural", labels=labels, num_clients=3, seed=0, users=bundle.users)
    assert [set(labels[p.client(c)].tolist()) for c in range(3)] == [{1}, {0}, {4}]


def test_leaf_max_users_keeps_the_first_users_and_their_test_samples(leaf_dir: Path) -> None:
    bundle = data.create("leaf", data_dir=leaf_dir, max_users=2)
    assert bundle.users is not None and bundle.users.tolist() == [0, 0, 1, 1, 1, 1]
    assert sorted(bundle.test.tensors[1].tolist()) == [1, 6]  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match="max_users must be an integer >= 1"):
        data.create("leaf", data_dir=leaf_dir, max_users=0)


def test_leaf_user_split_over_two_files_is_concatenated(tmp_path: Path) -> None:
    _write(tmp_path / "train" / "a.json", {"u": _user(2, 0)})
    _write(tmp_path / "train" / "b.json", {"u": _user(1, 2)})
    _write(tmp_path / "test" / "a.json", {"u": _user(1, 0)})
    bundle = data.create("leaf", data_dir=tmp_path)
    assert bundle.users is not None and bundle.users.tolist() == [0, 0, 0]
    assert bundle.train.tensors[1].tolist() == [0, 0, 2]  # type: ignore[attr-defined]


def test_leaf_missing_folders_name_the_expected_layout(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"train/\*\.json and test/\*\.json.*found no train/\*\.json"):
        data.create("leaf", data_dir=tmp_path)
    with pytest.raises(UsageError, match="none given"):
        data.create("leaf")
    _write(tmp_path / "train" / "a.json", {"u": _user(2, 0)})
    with pytest.raises(UsageError, match=r"found no test/\*\.json"):
        data.create("leaf", data_dir=tmp_path)


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read .* as JSON"),
    (json.dumps({"users": ["u"]}), "lacks the keys 'users' and 'user_data'"),
    (json.dumps({"users": ["u"], "user_data": {}}), "needs user_data\\['u'\\] with keys 'x' and 'y'"),
    (json.dumps({"users": ["u"], "user_data": {"u": {"x": ["the cat"], "y": ["t"]}}}),
     "numeric features, not text"),
    (json.dumps({"users": ["u"], "user_data": {"u": {"x": [[1.0], [2.0]], "y": [1]}}}),
     "one y per sample"),
    (json.dumps({"users": ["u"], "user_data": {"u": {"x": [[1.0]], "y": [-1]}}}),
     "integer class ids >= 0"),
])
def test_leaf_malformed_files_are_usage_errors(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.json").write_text(content)
    _write(tmp_path / "test" / "a.json", {"u": _user(1, 0, dim=1)})
    with pytest.raises(UsageError, match=message):
        data.create("leaf", data_dir=tmp_path)


def test_data_without_users_has_none() -> None:
    assert data.create("synthetic", input_shape="4", num_samples=8).users is None

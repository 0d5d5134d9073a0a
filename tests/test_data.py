"""Behaviour of the dataset registry, each loader on tiny files in the real formats."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm import data
from lowcomm.data.augment import random_crop
from lowcomm.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from lowcomm.data.embedded import mnist1d_cache_path
from lowcomm.errors import UsageError
from tolerance import assert_close_eps


def test_registry_lists_the_builtin_datasets() -> None:
    assert data.names() == sorted(
        ["mnist1d", "digits", "cifar10", "cifar100", "imagefolder", "wikitext2", "synthetic", "leaf", "stereo", "stdlib",
         "sceneflow"])


def test_unknown_dataset_is_a_usage_error_listing_names() -> None:
    with pytest.raises(UsageError, match="cifar10.*mnist1d"):
        data.create("cifar11")


def test_unknown_dataset_option_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="bptt"):
        data.create("digits", bptt=3)


# ---------------------------------------------------------------- mnist1d / digits


@pytest.fixture(scope="module")
def mnist1d_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mnist1d")


def test_mnist1d_is_generated_offline_cached_and_deterministic(mnist1d_dir: Path) -> None:
    np_state = np.random.get_state()
    a = data.create("mnist1d", data_dir=mnist1d_dir)
    # Generation must not disturb the caller's numpy RNG.
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    cached = mnist1d_cache_path(mnist1d_dir)
    assert cached.is_file()
    assert [p.name for p in mnist1d_dir.iterdir()] == [cached.name]  # no temp files left
    x, y = a.train.tensors
    xt, yt = a.test.tensors
    assert x.shape == (4000, 40) and x.dtype == torch.float32
    assert xt.shape == (1000, 40) and y.dtype == torch.int64
    assert set(y.tolist()) == set(range(10))
    assert a.task == "classification" and a.num_classes == 10 and a.input_shape == (40,)
    assert not a.synthetic and a.label == "mnist1d"

    mtime = cached.stat().st_mtime_ns
    b = data.create("mnist1d", data_dir=mnist1d_dir)  # from cache
    assert cached.stat().st_mtime_ns == mtime
    assert torch.equal(b.train.tensors[0], x) and torch.equal(b.test.tensors[1], yt)


def test_mnist1d_regenerates_identically_without_cache(mnist1d_dir: Path, tmp_path: Path) -> None:
    fresh = data.create("mnist1d", data_dir=tmp_path)
    cached = data.create("mnist1d", data_dir=mnist1d_dir)
    assert torch.equal(fresh.train.tensors[0], cached.train.tensors[0])


def test_mnist1d_replaces_a_corrupt_cache_file(tmp_path: Path) -> None:
    path = mnist1d_cache_path(tmp_path, num_samples=200)
    path.write_bytes(b"half a file")
    bundle = data.create("mnist1d", data_dir=tmp_path, num_samples=200)
    assert len(bundle.train) == 160 and len(bundle.test) == 40
    with np.load(path) as f:
        assert f["x"].shape == (160, 40)


def test_digits_is_a_standardized_stratified_split() -> None:
    b = data.create("digits")
    x, y = b.train.tensors
    xt, yt = b.test.tensors
    assert x.shape[1] == 64 and len(x) + len(xt) == 1797
    assert len(xt) == pytest.approx(0.2 * 1797, abs=1)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert abs(float(x.mean())) < 0.05
    assert torch.bincount(yt, minlength=10).min() >= 35  # stratified: every class present
    again = data.create("digits", seed=5)
    assert torch.equal(again.test.tensors[0], xt)  # split does not depend on seed


# ---------------------------------------------------------------- CIFAR


def _write_cifar_batch(path: Path, n: int, label_key: bytes, num_classes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": b"testing batch",
        label_key: rng.integers(0, num_classes, n).tolist(),
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img{i}.png".encode() for i in range(n)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(batch, f)


@pytest.fixture
def cifar10_root(tmp_path: Path) -> Path:
    folder = tmp_path / "cifar-10-batches-py"
    for i in range(1, 6):
        _write_cifar_batch(folder / f"data_batch_{i}", 4, b"labels", 10, seed=i)
    _write_cifar_batch(folder / "test_batch", 3, b"labels", 10, seed=9)
    return tmp_path


def test_cifar10_reads_pickle_batches_and_normalizes(cifar10_root: Path) -> None:
    b = data.create("cifar10", data_dir=cifar10_root)
    assert len(b.train) == 20 and len(b.test) == 3
    assert b.num_classes == 10 and b.input_shape == (3, 32, 32)
    x, y = b.train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    # Independent reference: the raw bytes, reshaped row-major as CIFAR documents.
    with open(cifar10_root / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    img = torch.tensor(raw[b"data"][0], dtype=torch.float32).view(3, 32, 32) / 255
    expected = (img - torch.tensor(CIFAR10_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(x, expected)
    assert int(y) == raw[b"labels"][0]
    xt, _ = b.test[0]  # the test split is normalized too
    assert xt.min() < 0 < xt.max()
    # Batched fetch (DataLoader's __getitems__ path) equals per-item fetch.
    loader = torch.utils.data.DataLoader(b.train, batch_size=5)
    bx, by = next(iter(loader))
    torch.testing.assert_close(bx[0], x)
    assert by.shape == (5,)


def test_cifar10_accepts_the_batches_folder_itself(cifar10_root: Path) -> None:
    b = data.create("cifar10", data_dir=cifar10_root / "cifar-10-batches-py")
    assert len(b.train) == 20


def test_cifar100_uses_fine_labels(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    _write_cifar_batch(folder / "train", 6, b"fine_labels", 100, seed=1)
    _write_cifar_batch(folder / "test", 2, b"fine_labels", 100, seed=2)
    b = data.create("cifar100", data_dir=tmp_path)
    assert b.num_classes == 100 and len(b.train) == 6
    with open(folder / "train", "rb") as f:
        labels = pickle.load(f, encoding="bytes")[b"fine_labels"]
    assert [int(b.train[i][1]) for i in range(6)] == labels


def test_cifar_missing_files_name_the_expected_layout(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        data.create("cifar10", data_dir=tmp_path)
    msg = str(err.value)
    assert "cifar-10-batches-py/data_batch_1..5 and test_batch" in msg
    assert str(tmp_path) in msg and "docs/data.md" in msg and "\n" not in msg
    with pytest.raises(UsageError, match="--data-dir"):
        data.create("cifar100")


def test_cifar_malformed_batch_is_a_usage_error(cifar10_root: Path) -> None:
    (cifar10_root / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="data_batch_3 is not a CIFAR python batch"):
        data.create("cifar10", data_dir=cifar10_root)


def test_cifar_augmentation_keeps_shape_and_depends_on_the_seed(cifar10_root: Path) -> None:
    b = data.create("cifar10", data_dir=cifar10_root)
    x = torch.stack([b.train[i][0] for i in range(8)])
    assert b.train_transform is not None
    torch.manual_seed(0)
    a1 = b.train_transform(x)
    torch.manual_seed(0)
    a2 = b.train_transform(x)
    torch.manual_seed(1)
    a3 = b.train_transform(x)
    assert a1.shape == x.shape and a1.dtype == x.dtype
    assert torch.equal(a1, a2)
    assert not torch.equal(a1, a3)
    assert not torch.equal(a1, x)


def test_random_crop_shifts_images_and_pads_with_fill() -> None:
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).view(2, 1, 4, 4)
    out = random_crop(x, padding=2, fill=[-1.0], generator=torch.Generator().manual_seed(3))
    for i in range(2):
        # Every crop is a window of the padded image: find it by brute force.
        padded = torch.full((1, 8, 8), -1.0)
        padded[:, 2:6, 2:6] = x[i]
        windows = [padded[:, r:r + 4, c:c + 4] for r in range(5) for c in range(5)]
        assert any(torch.equal(out[i], w) for w in windows)


# ---------------------------------------------------------------- imagefolder


def _write_png(path: Path, color: tuple[int, int, int], size: tuple[int, int]) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def test_imagefolder_loads_pngs_lazily_with_sorted_class_indices(tmp_path: Path) -> None:
    _write_png(tmp_path / "train" / "cat" / "a.png", (255, 0, 0), (40, 30))
    _write_png(tmp_path / "train" / "cat" / "b.PNG", (255, 0, 0), (20, 50))
    _write_png(tmp_path / "train" / "ant" / "c.png", (0, 0, 255), (33, 33))
    (tmp_path / "train" / "ant" / "notes.txt").write_text("ignored")
    _write_png(tmp_path / "val" / "cat" / "d.png", (255, 0, 0), (64, 64))
    b = data.create("imagefolder", data_dir=tmp_path, image_size=16)
    assert b.classes == ["ant", "cat"] and b.num_classes == 2
    assert len(b.train) == 3 and len(b.test) == 1
    assert b.input_shape == (3, 16, 16)
    x, y = b.train[0]  # ant/c.png: pure blue
    assert x.shape == (3, 16, 16) and int(y) == 0
    blue = (torch.tensor([0.0, 0.0, 1.0]) - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor(
        [0.229, 0.224, 0.225])
    # /255, - mean, / std (3 roundings per pixel), then a mean over 16 x 16 pixels
    assert_close_eps(x.mean((1, 2)), blue, torch.float32, ops=3 + 16 * 16)
    assert [int(b.train[i][1]) for i in range(3)] == [0, 1, 1]
    assert b.test[0][0].shape == (3, 16, 16)
    assert b.train_transform is not None
    assert b.train_transform(x[None]).shape == (1, 3, 16, 16)


def test_imagefolder_missing_layout_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="train/<class>.*val/<class>"):
        data.create("imagefolder", data_dir=tmp_path)
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "val" / "a").mkdir(parents=True)
    with pytest.raises(UsageError, match="no .png/.jpg images"):
        data.create("imagefolder", data_dir=tmp_path)


# ---------------------------------------------------------------- wikitext2


def _write_wikitext(root: Path, names: tuple[str, str, str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / names[0]).write_text(" = Title = \n the cat sat on the mat \n the dog sat \n" * 3)
    (root / names[1]).write_text(" the bird flew \n")
    (root / names[2]).write_text(" a cat and a dog \n the end \n")


def test_wikitext2_builds_vocab_and_bptt_windows(tmp_path: Path) -> None:
    _write_wikitext(tmp_path, ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"))
    b = data.create("wikitext2", data_dir=tmp_path, bptt=4)
    words = ("= Title = <eos> the cat sat on the mat <eos> the dog sat <eos> ".split() * 3
             + "the bird flew <eos> a cat and a dog <eos> the end <eos>".split())
    vocab = list(dict.fromkeys(words))
    assert b.vocab_size == len(vocab) and b.task == "language_model"
    assert b.input_shape == (4,) and b.num_classes is None
    n_train = 3 * 15  # tokens in the training file, <eos> included
    assert len(b.train) == (n_train - 1) // 4
    x, y = b.train[1]
    assert x.dtype == torch.int64 and x.shape == (4,)
    assert [vocab[i] for i in x.tolist()] == words[4:8]
    assert [vocab[i] for i in y.tolist()] == words[5:9]  # targets: next tokens
    xt, yt = b.test[0]
    assert [vocab[i] for i in xt.tolist()] == "a cat and a".split()
    assert b.valid is None  # 4 tokens: too short for one window, and optional anyway
    assert len(data.create("wikitext2", data_dir=tmp_path, bptt=3).valid) == 1


def test_wikitext2_accepts_txt_names_in_a_subfolder(tmp_path: Path) -> None:
    _write_wikitext(tmp_path / "wikitext-2", ("train.txt", "valid.txt", "test.txt"))
    b = data.create("wikitext2", data_dir=tmp_path, bptt=3)
    assert len(b.train) == (45 - 1) // 3


def test_wikitext2_missing_files_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="wiki.train.tokens.*train.txt"):
        data.create("wikitext2", data_dir=tmp_path)


# ---------------------------------------------------------------- synthetic


def test_synthetic_images_are_labelled_timing_only_and_seeded() -> None:
    a = data.create("synthetic", input_shape="3,8,8", num_classes=5, num_samples=16, seed=1)
    b = data.create("synthetic", input_shape=(3, 8, 8), num_classes=5, num_samples=16, seed=1)
    c = data.create("synthetic", input_shape=(3, 8, 8), num_classes=5, num_samples=16, seed=2)
    assert a.synthetic and "synthetic (timing only)" in a.label
    assert a.train.tensors[0].shape == (16, 3, 8, 8) and len(a.test) == 4
    assert int(a.train.tensors[1].max()) < 5 and a.num_classes == 5
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])


def test_synthetic_tokens_are_shifted_sequences() -> None:
    b = data.create("synthetic", vocab_size=20, input_shape=(7,), num_samples=8)
    assert b.task == "language_model" and b.vocab_size == 20 and b.input_shape == (7,)
    x, y = b.train[0]
    assert x.shape == (7,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])


def test_synthetic_bad_shape_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="input_shape"):
        data.create("synthetic", input_shape="3,a,32")


def test_mnist1d_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOWCOMM_CACHE_DIR", str(tmp_path))
    assert mnist1d_cache_path(None).parent == tmp_path
    assert os.fspath(mnist1d_cache_path(tmp_path / "x").parent) == os.fspath(tmp_path / "x")

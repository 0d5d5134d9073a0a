"""The input pipeline: DataLoader workers read the same batches, resume mid-epoch exactly, and
the decoded-sample cache fills in epoch 1 and is read (not decoded again) in epoch 2.

Everything runs on a tiny ImageFolder tree of PNG and JPEG files made here; decodes are
counted (in shared memory, so counts made in worker processes are seen), never timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm import data
from lowcomm.cli import main
from lowcomm.data.cifar import NormalizedImages
from lowcomm.data.imagefolder import ImageFiles
from lowcomm.data import sample_cache
from lowcomm.data.sample_cache import CachedDataset, DiskStore, MemoryStore, with_cache
from lowcomm.errors import UsageError
from lowcomm.runtime.config import TrainConfig
from lowcomm.runtime.workload import Batches, cache_samples

SIZE = 12  # crop size: tiny, decoding is still real (Pillow resize + crop)


def make_images(root: Path, *, per_class: int = 12, classes: int = 3, seed: int = 0) -> Path:
    """``root/train|val/<class>/*.png|jpg``: random images of varying size, half PNG, half JPEG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", 2)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(n):
                pixels = rng.integers(0, 256, (14 + k % 5, 16 + k % 3, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{k}.{'png' if k % 2 else 'jpg'}")
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_images(tmp_path_factory.mktemp("images"))


class CountingImages(ImageFiles):
    """ImageFiles that counts each sample's decodes in shared memory (workers included)."""

    def __init__(self, source: ImageFiles) -> None:
        super().__init__(source.samples, image_size=source.image_size)
        self.counts = torch.zeros(len(source.samples), dtype=torch.int32).share_memory_()

    def decode(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        self.counts[i] += 1
        return super().decode(i)


def counting(images: Path) -> CountingImages:
    train = data.create("imagefolder", data_dir=images, image_size=SIZE).train
    assert isinstance(train, ImageFiles)
    return CountingImages(train)


def epochs(batches: Batches, n: int, *, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = [(x.clone(), y.clone()) for e in range(n) for x, y in batches.epoch(e, first if e == 0 else 0)]
    batches.close()
    return out


def assert_same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert len(a) == len(b) and len(a) > 0
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # bit-identical, not close


# ------------------------------------------------------------------ workers = in-process


@pytest.mark.parametrize("rank", [0, 1])
def test_batches_read_by_two_workers_equal_the_in_process_batches(images: Path, rank: int) -> None:
    train = data.create("imagefolder", data_dir=images, image_size=SIZE).train
    in_process = epochs(Batches(train, 5, rank, 2, seed=3), 2)
    workers = epochs(Batches(train, 5, rank, 2, seed=3, workers=2, prefetch=3), 2)
    assert_same(in_process, workers)


def test_tensor_data_read_by_workers_equals_the_in_process_batches() -> None:
    train = data.create("digits").train
    assert_same(epochs(Batches(train, 64, 0, 1, seed=0), 2), epochs(Batches(train, 64, 0, 1, seed=0, workers=2), 2))


def test_workers_do_not_draw_from_the_global_rng(images: Path) -> None:
    # the trainer's augmentation draws from it: workers must not shift what it draws
    train = data.create("imagefolder", data_dir=images, image_size=SIZE).train
    before = torch.get_rng_state()
    epochs(Batches(train, 5, 0, 1, seed=0, workers=2), 2)
    assert torch.equal(torch.get_rng_state(), before)


# ------------------------------------------------------------------ exact mid-epoch resume


def test_resume_mid_epoch_with_workers_skips_without_decoding(images: Path) -> None:
    dataset = counting(images)
    whole = epochs(Batches(dataset, 4, 0, 1, seed=5), 1)
    dataset.counts.zero_()
    batches = Batches(dataset, 4, 0, 1, seed=5, workers=2)
    skipped = [i for idx in batches.plan(0)[:3] for i in idx]
    resumed = epochs(batches, 1, first=3)
    assert_same(resumed, whole[3:])
    assert dataset.counts[skipped].sum() == 0  # the skipped samples were never decoded


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_resume_mid_epoch_with_a_cache_gives_the_uninterrupted_batches(images: Path, tmp_path: Path, kind: str) -> None:
    train = data.create("imagefolder", data_dir=images, image_size=SIZE).train
    whole = epochs(Batches(train, 4, 1, 2, seed=7), 2)
    # interrupted after 2 batches of epoch 0; the new process (new memory cache, same disk
    # cache) continues at batch 2
    first = with_cache(train, kind, directory=tmp_path, identity={"t": 1})
    cut = Batches(first, 4, 1, 2, seed=7, workers=2)
    stream = cut.epoch(0)
    head = [(x.clone(), y.clone()) for _, (x, y) in zip(range(2), stream)]
    cut.close()
    again = with_cache(train, kind, directory=tmp_path, identity={"t": 1})
    tail = epochs(Batches(again, 4, 1, 2, seed=7, workers=2), 2, first=2)
    assert_same(head + tail, whole)


def test_training_resumed_mid_epoch_with_workers_and_cache_matches_an_uninterrupted_run(
        images: Path, tmp_path: Path) -> None:
    def train(name: str, *runs: list[str]) -> list[tuple[int, float]]:
        log = tmp_path / f"{name}.jsonl"
        argv = [sys.executable, "-m", "lowcomm", "train", "--data", "imagefolder", "--data-dir", str(images),
                "--data-arg", f"image_size={SIZE}", "--model", "mlp", "--model-arg", f"input_dim={3 * SIZE * SIZE}",
                "--epochs", "2", "--batch-size", "8", "--no-progress", "--quiet", "--log", str(log)]
        for extra in runs:
            done = subprocess.run(argv + extra, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
        records = [json.loads(line) for line in log.read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if r.get("event") == "step"]

    plain = train("plain", [])
    pipeline = ["--data-workers", "2", "--data-cache", f"disk:{tmp_path / 'cache'}",
                "--checkpoint-dir", str(tmp_path / "ck")]
    resumed = train("resumed", [*pipeline, "--stop-after-steps", "3"], [*pipeline, "--resume"])
    assert len(plain) == 10 and resumed == plain  # the same losses, step for step


# ------------------------------------------------------------------ the cache


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_cache_fills_in_epoch_one_and_is_read_in_epoch_two(images: Path, tmp_path: Path, kind: str,
                                                          workers: int) -> None:
    dataset = counting(images)
    plain = epochs(Batches(ImageFiles(dataset.samples, image_size=SIZE), 6, 0, 1, seed=1), 2)
    cached = with_cache(dataset, kind, directory=tmp_path, identity={"t": 2})
    assert isinstance(cached, CachedDataset)
    batches = Batches(cached, 6, 0, 1, seed=1, workers=workers)
    first = [(x.clone(), y.clone()) for x, y in batches.epoch(0)]
    assert dataset.counts.tolist() == [1] * len(dataset)  # every sample decoded once
    if workers == 0:
        assert cached.decodes == len(dataset)  # the cache's own count (per process) agrees
    second = [(x.clone(), y.clone()) for x, y in batches.epoch(1)]
    batches.close()
    assert dataset.counts.tolist() == [1] * len(dataset)  # epoch 2: none decoded again
    assert_same(first + second, plain)  # and the samples are the decoded ones, bit for bit


def test_disk_cache_is_shared_by_a_new_process_and_keyed_by_the_files(images: Path, tmp_path: Path) -> None:
    dataset = counting(images)
    epochs(Batches(with_cache(dataset, "disk", directory=tmp_path, identity={"t": 3}), 6, 0, 1, seed=0), 1)
    dataset.counts.zero_()
    epochs(Batches(with_cache(dataset, "disk", directory=tmp_path, identity={"t": 3}), 6, 0, 1, seed=0), 1)
    assert dataset.counts.sum() == 0  # a later run (or another rank) reads the files
    other = with_cache(dataset, "disk", directory=tmp_path, identity={"t": 3, "image_size": 99})
    assert isinstance(other, CachedDataset) and isinstance(other.store, DiskStore)
    assert other[0] is not None and dataset.counts[0] == 1  # other identity, other key: decoded


def test_disk_cache_never_reads_a_partial_file(images: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = counting(images)
    store = DiskStore(tmp_path / "key")
    cached = CachedDataset(dataset, store)
    real_replace = os.replace
    seen = []

    def checked_replace(src: str, dst: str) -> None:
        # the entry appears under its name only whole: written in full under another name first
        assert not os.path.exists(dst) and sample_cache._unpack(bytearray(Path(src).read_bytes())) is not None
        seen.append(str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", checked_replace)
    x0, y0 = cached[0]
    assert seen == [str(store.path(0))]

    def killed(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        cached[1]
    monkeypatch.undo()
    assert store.get(1) is None and sorted(p.name for p in store.path(1).parent.iterdir()) == ["0.sample"]

    # a stray temporary file (a writer killed hard) is never taken for the sample
    (store.path(1).parent / ".1.abc.tmp").write_bytes(store.path(0).read_bytes())
    assert store.get(1) is None
    # a cut-off entry (not written by the cache) is a miss, decoded and written again
    whole = store.path(0).read_bytes()
    store.path(0).write_bytes(whole[: len(whole) // 2])
    assert store.get(0) is None
    x1, y1 = cached[0]
    assert torch.equal(x0, x1) and torch.equal(y0, y1) and dataset.counts[0] == 2
    assert store.path(0).read_bytes() == whole


def test_the_cache_keeps_augmentation_outside_and_leaves_tensor_data_alone(images: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(data="imagefolder", data_dir=str(images), data_args={"image_size": SIZE},
                      data_cache=f"disk:{tmp_path}")
    bundle = data.create("imagefolder", data_dir=images, image_size=SIZE)
    cached = cache_samples(cfg, bundle)
    assert isinstance(cached.train, CachedDataset) and isinstance(cached.test, CachedDataset)
    assert cached.train_transform is bundle.train_transform  # random flips stay per batch, after the cache
    digits = data.create("digits")
    assert cache_samples(TrainConfig(data="digits", data_cache="memory"), digits).train is digits.train
    cifar_like = NormalizedImages(torch.zeros((4, 3, 2, 2), dtype=torch.uint8), torch.zeros(4, dtype=torch.int64),
                                  mean=(0.5,) * 3, std=(0.5,) * 3)
    assert with_cache(cifar_like, "memory") is cifar_like  # uint8 in memory already: nothing to decode


def test_a_memory_cache_larger_than_the_machine_is_refused_in_one_line() -> None:
    huge = (np.zeros((3, 1024, 1024), np.uint8), np.asarray(0))
    with pytest.raises(UsageError, match="needs .* GiB per rank .* use --data-cache disk"):
        sample_cache.check_room(10**7, huge)  # 29 TiB
    sample_cache.check_room(10, huge)


def test_memory_store_skips_samples_of_another_shape() -> None:
    store = MemoryStore(3, (np.zeros((2, 2), np.uint8), np.asarray(1)))
    store.put(1, np.ones((3, 2), np.uint8), np.asarray(1))
    assert store.get(1) is None
    store.put(2, np.ones((2, 2), np.uint8), np.asarray(4))
    got = store.get(2)
    assert got is not None and got[0].sum() == 4 and int(got[1]) == 4


# ------------------------------------------------------------------ flags


@pytest.mark.parametrize("argv, fragment", [
    (["--data-cache", "ram"], "--data-cache"),
    (["--data-cache", "memory:/tmp/x"], "only disk takes a folder"),
    (["--data-cache", "disk:"], "needs a folder"),
    (["--data-workers", "-1"], "--data-workers"),
    (["--data-workers", "1000"], "--data-workers"),
    (["--data-workers", "two"], "--data-workers"),
    (["--prefetch", "2"], "--prefetch needs --data-workers"),
    (["--data-workers", "2", "--prefetch", "0"], "--prefetch"),
])
def test_bad_pipeline_flags_exit_2_with_one_line(argv: list[str], fragment: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        code = main(["train", "--model", "mlp", "--data", "mnist1d", *argv])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_bad_cache_flag_in_a_real_process_prints_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "lowcomm", "train", "--data-cache", "disk:"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr

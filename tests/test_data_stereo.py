"""Stereo data: the procedural generator is exact, the Scene Flow loader reads the real layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lowcomm.data
from lowcomm.data.pfm import read_pfm, write_pfm
from lowcomm.data.stereo import IMAGENET_MEAN, IMAGENET_STD
from lowcomm.data.stereo_render import (
    FULL, GRADIENT, NONE, Layers, generate, occlusion_mask, render, sample_layers,
    support_mask, texture_value,
)
from lowcomm.errors import UsageError

H, W, MAXD = 24, 48, 12


def _scenes(kind: str, n: int = 8, seed: int = 0) -> Layers:
    return sample_layers(np.random.default_rng(seed), n, height=H, width=W, max_disp=MAXD, kind=kind)


def _warp_nearest(right: np.ndarray, disparity: np.ndarray) -> np.ndarray:
    """Left view rebuilt from the right one: left[x] = right[x - d(x)] (integer d)."""
    n, c, h, w = right.shape
    xr = np.clip(np.arange(w)[None, None, :] - disparity.astype(np.int64), 0, w - 1)
    return np.take_along_axis(right, np.broadcast_to(xr[:, None], (n, c, h, w)), axis=3)


def test_dots_right_view_reproduces_left_at_every_visible_pixel() -> None:
    layers = _scenes("dots")
    left, right, disparity = render(layers, H, W)
    assert np.array_equal(disparity, np.round(disparity))     # random-dot stereograms: integer
    visible = ~occlusion_mask(layers, disparity)
    assert visible.mean() > 0.5
    warped = _warp_nearest(right, disparity)
    mism = np.abs(warped - left).max(axis=1)
    assert mism[visible].max() == 0.0
    # and the occluded ones are not trivially matching: most of them differ
    occluded_in_view = ~visible & (np.arange(W) - disparity >= 0)
    assert occluded_in_view.any()
    assert (mism[occluded_in_view] > 0).mean() > 0.3


def test_uint8_dots_pairs_are_exact_too() -> None:
    arrays = generate(6, height=H, width=W, max_disp=MAXD, kind="dots", seed=3)
    layers = sample_layers(np.random.default_rng([3, 0]), 6, height=H, width=W, max_disp=MAXD, kind="dots")
    visible = ~occlusion_mask(layers, arrays["disparity"])
    warped = _warp_nearest(arrays["right"], arrays["disparity"])
    assert np.array_equal(np.moveaxis(warped, 1, -1)[visible], np.moveaxis(arrays["left"], 1, -1)[visible])


def _single_plane(d0: float, gx: float, gy: float) -> Layers:
    """One slanted background plane with a linear colour gradient, plus an unused slot."""
    def a(*v: float) -> np.ndarray:
        return np.array([list(v)], dtype=np.float64)

    return Layers(
        support=np.array([[FULL, NONE]]), cx=a(0, 0), cy=a(0, 0), rx=a(1, 1), ry=a(1, 1),
        angle=a(0, 0), vertices=np.zeros((1, 2, 6, 2)), d0=a(d0, 0), gx=a(gx, 0), gy=a(gy, 0),
        texture=np.array([[GRADIENT, GRADIENT]]), color0=np.zeros((1, 2, 3)),
        color1=np.array([[[1.0, 0.5, 0.2], [1, 1, 1]]]), scale=a(400, 400), direction=a(0.3, 0),
        phase=a(0.1, 0), detail=a(0, 0), seed=np.zeros((1, 2), dtype=np.uint32))


def test_slanted_plane_subpixel_disparity_is_exact_under_linear_interpolation() -> None:
    layers = _single_plane(d0=3.3, gx=0.07, gy=0.05)
    left, right, disparity = render(layers, H, W)
    assert not np.array_equal(disparity, np.round(disparity))
    xr = np.arange(W)[None, :] - disparity[0]                 # (H, W) fractional
    inside = (xr >= 0) & (xr <= W - 1)
    assert inside.mean() > 0.5
    lo = np.clip(np.floor(xr).astype(np.int64), 0, W - 2)
    t = xr - lo
    rows = np.arange(H)[:, None]
    warped = right[0][:, rows, lo] * (1 - t) + right[0][:, rows, lo + 1] * t
    # a linear texture on a plane seen by a linear map: interpolation is exact up to rounding
    assert np.abs(warped - left[0])[:, inside].max() < 1e-12


def _reference_right(layers: Layers, s: int) -> np.ndarray:
    """Brute-force right view of scene ``s``: per pixel, per surface, solve x_l - d(x_l) = x_r
    by fixed-point iteration (independent of the closed form) and keep the front-most."""
    out = np.zeros((3, H, W))
    one = layers.take(np.array([s]))
    for y in range(H):
        for xr in range(W):
            best, colour = -np.inf, None
            for k in range(layers.slots):
                if layers.support[s, k] == NONE:
                    continue
                xl = float(xr)
                for _ in range(60):
                    xl = xr + layers.d0[s, k] + layers.gx[s, k] * xl + layers.gy[s, k] * y
                d = layers.d0[s, k] + layers.gx[s, k] * xl + layers.gy[s, k] * y
                if not support_mask(one, k, np.array([[[xl]]]), np.array([[[float(y)]]]))[0, 0, 0]:
                    continue
                if d > best:
                    kind = int(layers.texture[s, k])
                    w = texture_value(kind, np.array([xl]), np.array([float(y)]),
                                      np.array([layers.scale[s, k]]), np.array([layers.direction[s, k]]),
                                      np.array([layers.phase[s, k]]), np.array([layers.seed[s, k]]))
                    best = d
                    colour = layers.color0[s, k] + (layers.color1[s, k] - layers.color0[s, k]) * w[0]
            assert colour is not None
            out[:, y, xr] = colour
    return out


def test_right_view_matches_a_brute_force_renderer() -> None:
    layers = _scenes("shapes", n=2, seed=5)
    layers.detail[:] = 0.0        # the reference has no detail grain
    _, right, _ = render(layers, H, W)
    for s in range(2):
        ref = _reference_right(layers, s)
        assert np.abs(np.clip(ref, 0, 1) - right[s]).max() < 1e-9


def test_shapes_scenes_have_occlusions() -> None:
    layers = _scenes("shapes")
    _, _, disparity = render(layers, H, W)
    hidden = occlusion_mask(layers, disparity)
    in_view = np.arange(W) - disparity >= 0
    assert (hidden & in_view).mean() > 0.01


@pytest.mark.parametrize("kind", ["mixed", "dots", "planes", "shapes"])
def test_disparities_stay_in_range(kind: str) -> None:
    d = generate(16, height=H, width=W, max_disp=MAXD, min_disp=1.0, kind=kind, seed=1)["disparity"]
    assert d.dtype == np.float32 and d.shape == (16, H, W)
    assert d.min() >= 1.0 and d.max() < MAXD
    assert d.max() - d.min() > MAXD / 4        # scenes use the range, not one depth


def test_generation_is_deterministic_and_seeded() -> None:
    a = generate(4, height=H, width=W, max_disp=MAXD, seed=7)
    b = generate(4, height=H, width=W, max_disp=MAXD, seed=7)
    c = generate(4, height=H, width=W, max_disp=MAXD, seed=8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["left"], c["left"])


def test_bad_kind_or_range_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="kind"):
        lowcomm.data.create("stereo", kind="cubes")
    with pytest.raises(UsageError, match="max_disp"):
        lowcomm.data.create("stereo", max_disp=0.5, min_disp=1.0)
    with pytest.raises(UsageError, match="data_seed"):
        lowcomm.data.create("stereo", data_seed=-1)


def test_stereo_bundle_shapes_normalization_and_cache(tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(height=16, width=32, max_disp=8, train_size=5, test_size=3, kind="shapes")
    b = lowcomm.data.create("stereo", data_dir=tmp_path, seed=0, **kw)
    assert b.task == "stereo" and b.input_shape == (6, 16, 32) and b.num_classes is None
    assert (len(b.train), len(b.test)) == (5, 3)                # type: ignore[arg-type]
    x, y = b.train[2]
    assert x.shape == (6, 16, 32) and x.dtype == torch.float32
    assert y.shape == (16, 32) and y.dtype == torch.float32
    raw = b.train.images[2].float() / 255                       # type: ignore[attr-defined]
    mean = torch.tensor(IMAGENET_MEAN * 2).view(6, 1, 1)
    std = torch.tensor(IMAGENET_STD * 2).view(6, 1, 1)
    assert torch.allclose(x, (raw - mean) / std, atol=1e-5)
    batch = b.train.__getitems__([0, 2])                        # type: ignore[attr-defined]
    assert torch.equal(batch[1][0], x) and torch.equal(batch[1][1], y)
    assert len(list(tmp_path.glob("stereo-v*.npz"))) == 1
    # another run seed trains on the same data (read from the cache)
    b2 = lowcomm.data.create("stereo", data_dir=tmp_path, seed=5, **kw)
    assert torch.equal(b2.train.images, b.train.images)         # type: ignore[attr-defined]
    b3 = lowcomm.data.create("stereo", data_dir=tmp_path, data_seed=1, **kw)
    assert not torch.equal(b3.train.images, b.train.images)     # type: ignore[attr-defined]
    assert not torch.equal(b.test.images[:3], b.train.images[:3])  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# PFM


@pytest.mark.parametrize("little_endian", [True, False])
@pytest.mark.parametrize("channels", [1, 3])
def test_pfm_round_trip(tmp_path: Path, little_endian: bool, channels: int) -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 7) if channels == 1 else (5, 7, 3)).astype(np.float32) * 100
    path = tmp_path / "x.pfm"
    write_pfm(path, a, little_endian=little_endian)
    head = path.read_bytes().split(b"\n")
    assert head[0] == (b"Pf" if channels == 1 else b"PF") and head[1] == b"7 5"
    assert float(head[2]) < 0 if little_endian else float(head[2]) > 0
    b = read_pfm(path)
    assert b.dtype == np.float32 and np.array_equal(a, b)


def test_pfm_rows_are_stored_bottom_up(tmp_path: Path) -> None:
    rows = np.array([[1, 2], [3, 4], [5, 6]], dtype="<f4")       # top row 1 2
    path = tmp_path / "x.pfm"
    path.write_bytes(b"Pf\n2 3\n-1.0\n" + rows[::-1].tobytes())
    assert np.array_equal(read_pfm(path), rows)
    path.write_bytes(b"Pf 2\n3 1.0\n" + rows[::-1].astype(">f4").tobytes())   # big-endian, odd breaks
    assert np.array_equal(read_pfm(path), rows)


def test_bad_pfm_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "x.pfm"
    path.write_bytes(b"P6\n2 2\n255\n")
    with pytest.raises(UsageError, match="PF or Pf"):
        read_pfm(path)
    path.write_bytes(b"Pf\n2 3\n-1.0\n" + b"\0" * 8)
    with pytest.raises(UsageError, match="truncated"):
        read_pfm(path)


# ---------------------------------------------------------------------------------------
# Scene Flow layout


FH, FW = 12, 20


def _frame(root: Path, rel: str, seed: int, passes: tuple[str, ...] = ("clean", "final")
           ) -> dict[str, np.ndarray]:
    """Write one frame (left/right PNG per pass, left PFM) at ``root``/<pass>/``rel``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for p in passes:
        for view in ("left", "right"):
            img = rng.integers(0, 256, (FH, FW, 3), dtype=np.uint8)
            path = root / f"frames_{p}pass" / rel.replace("VIEW", view)
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(path.with_suffix(".png"))
            out[f"{p}_{view}"] = img
    d = rng.uniform(0.5, 30, (FH, FW)).astype(np.float32)
    d[0, 0] = np.inf
    d[0, 1] = -2.0
    pfm = (root / "disparity" / rel.replace("VIEW", "left")).with_suffix(".pfm")
    pfm.parent.mkdir(parents=True, exist_ok=True)
    write_pfm(pfm, d, little_endian=seed % 2 == 0)
    out["disparity"] = d
    return out


def test_sceneflow_reads_train_test_layout_with_crops(tmp_path: Path) -> None:
    frames: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for split, count in (("TRAIN", 3), ("TEST", 2)):
        for i in range(count):
            rel = f"{split}/A/0000/VIEW/{i:04d}"
            frames[(split, i)] = _frame(tmp_path, rel, seed=len(frames))
    b = lowcomm.data.create("sceneflow", data_dir=tmp_path, height=8, width=16)
    assert b.task == "stereo" and b.input_shape == (6, 8, 16)
    assert (len(b.train), len(b.test)) == (3, 2)                # type: ignore[arg-type]
    # test: centre crop; values are what was written
    pixels, disp = b.test.decode(1)                             # type: ignore[attr-defined]
    f = frames[("TEST", 1)]
    top, left = (FH - 8) // 2, (FW - 16) // 2
    want = np.concatenate([f["clean_left"], f["clean_right"]], axis=2)[top:top + 8, left:left + 16]
    assert np.array_equal(pixels, want.transpose(2, 0, 1))
    expect = f["disparity"][top:top + 8, left:left + 16]
    assert np.array_equal(disp, np.where(np.isfinite(expect) & (expect > 0), expect, 0))
    x, y = b.test[1]
    assert x.shape == (6, 8, 16) and torch.equal(y, torch.from_numpy(disp))
    # train: a fixed crop per frame, inside the frame, the same on every read
    for i in range(3):
        top, left, _, _ = b.train._window(i, FH, FW)            # type: ignore[attr-defined]
        assert 0 <= top <= FH - 8 and 0 <= left <= FW - 16
        p1, d1 = b.train.decode(i)                              # type: ignore[attr-defined]
        f = frames[("TRAIN", i)]
        assert np.array_equal(p1[:3], f["clean_left"][top:top + 8, left:left + 16].transpose(2, 0, 1))
        expect = f["disparity"][top:top + 8, left:left + 16]
        assert np.array_equal(d1, np.where(np.isfinite(expect) & (expect > 0), expect, 0))
        assert np.array_equal(b.train.decode(i)[0], p1)         # type: ignore[attr-defined]
    # the crop depends on the frame, not on where the data lives or which pass is read
    fixed = [b.train._window(i, FH, FW) for i in range(3)]    # type: ignore[attr-defined]
    assert len(set(fixed)) > 1
    final = lowcomm.data.create("sceneflow", data_dir=tmp_path, pass_="final", height=8, width=16)
    assert [final.train._window(i, FH, FW) for i in range(3)] == fixed  # type: ignore[attr-defined]
    # the final pass reads the other images
    fb = lowcomm.data.create("sceneflow", data_dir=tmp_path, pass_="final", height=None, width=None)
    assert fb.input_shape == (6, FH, FW)
    pixels, _ = fb.test.decode(0)                               # type: ignore[attr-defined]
    assert np.array_equal(pixels[3:], frames[("TEST", 0)]["final_right"].transpose(2, 0, 1))


def test_sceneflow_samples_read_through_the_disk_sample_cache_are_identical(tmp_path: Path) -> None:
    from lowcomm.data.sample_cache import with_cache

    data = tmp_path / "data"
    _frame(data, "TRAIN/A/0000/VIEW/0000", seed=0, passes=("clean",))
    _frame(data, "TEST/A/0000/VIEW/0000", seed=1, passes=("clean",))
    b = lowcomm.data.create("sceneflow", data_dir=data, height=8, width=16)
    cached = with_cache(b.train, "disk", directory=tmp_path / "cache", identity={"name": "sceneflow"})
    for _ in range(2):      # fill, then read back
        x, y = cached[0]
        assert torch.equal(x, b.train[0][0]) and torch.equal(y, b.train[0][1])
    # the in-memory generator data is never cached again
    held = lowcomm.data.create("stereo", data_dir=tmp_path, height=8, width=16, train_size=2,
                               test_size=1).train
    assert with_cache(held, "memory") is held


def test_sceneflow_driving_layout_splits_by_stable_hash(tmp_path: Path) -> None:
    root = tmp_path / "Driving"
    for i in range(30):
        _frame(root, f"35mm_focallength/scene_forwards/fast/VIEW/{i:04d}", seed=i, passes=("clean",))
    b = lowcomm.data.create("sceneflow", data_dir=tmp_path, height=8, width=16)
    again = lowcomm.data.create("sceneflow", data_dir=tmp_path, height=8, width=16)
    n_train, n_test = len(b.train), len(b.test)                 # type: ignore[arg-type]
    assert n_train + n_test == 30 and 0 < n_test < 10
    assert b.test.samples == again.test.samples                 # type: ignore[attr-defined]


def test_sceneflow_unsplit_roots_train_when_flyingthings_test_exists(tmp_path: Path) -> None:
    _frame(tmp_path / "FlyingThings3D", "TRAIN/A/0000/VIEW/0000", seed=0, passes=("clean",))
    _frame(tmp_path / "FlyingThings3D", "TEST/A/0000/VIEW/0000", seed=1, passes=("clean",))
    for i in range(12):
        _frame(tmp_path / "Monkaa", f"a_rain_of_stones_x2/VIEW/{i:04d}", seed=i, passes=("clean",))
    b = lowcomm.data.create("sceneflow", data_dir=tmp_path, height=8, width=16)
    assert (len(b.train), len(b.test)) == (13, 1)               # type: ignore[arg-type]
    assert "FlyingThings3D" in str(b.test.samples[0][0])        # type: ignore[attr-defined]


def test_sceneflow_missing_or_empty_folders_name_the_layout(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="frames_cleanpass"):
        lowcomm.data.create("sceneflow", data_dir=tmp_path / "nope")
    with pytest.raises(UsageError, match="frames_cleanpass"):
        lowcomm.data.create("sceneflow", data_dir=tmp_path)
    _frame(tmp_path, "TRAIN/A/0000/VIEW/0000", seed=0, passes=("clean",))
    with pytest.raises(UsageError, match="0 test pairs"):
        lowcomm.data.create("sceneflow", data_dir=tmp_path)
    with pytest.raises(UsageError, match="frames_finalpass"):
        lowcomm.data.create("sceneflow", data_dir=tmp_path, pass_="final")
    with pytest.raises(UsageError, match="pass_"):
        lowcomm.data.create("sceneflow", data_dir=tmp_path, pass_="albedo")


def test_sceneflow_crop_larger_than_frame_is_a_usage_error(tmp_path: Path) -> None:
    _frame(tmp_path, "TRAIN/A/0000/VIEW/0000", seed=0, passes=("clean",))
    _frame(tmp_path, "TEST/A/0000/VIEW/0000", seed=1, passes=("clean",))
    b = lowcomm.data.create("sceneflow", data_dir=tmp_path)       # default crop 256x512
    with pytest.raises(UsageError, match="smaller than the crop"):
        b.test[0]


def test_stereo_datasets_are_registered() -> None:
    assert {"stereo", "sceneflow"} <= set(lowcomm.data.names())

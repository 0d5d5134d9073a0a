"""Procedural stereo scenes rendered exactly: layered planar surfaces with analytic textures.

Why procedural and why exact: a stereo network needs ground-truth disparity at every pixel,
and a generator whose right view is an *approximate* warp of the left teaches the network
the warp's artefacts. Here a scene is a stack of surfaces (a background plane, then shapes in
front of it), each with

* a support mask (everything, a rotated rectangle, a rotated ellipse or a convex polygon),
* a planar disparity ``d(x, y) = d0 + gx*x + gy*y`` in left-view pixel coordinates, and
* a texture that is a *function of the surface coordinates* ``(u, v)`` = the point's left-view
  position (random dots, value noise, stripes, gradients over two colours).

The left view at pixel ``(x, y)`` shows the front-most (largest-disparity) surface whose mask
contains ``(x, y)``; the right view at ``(x_r, y)`` shows the front-most surface whose point
``x_l`` with ``x_l - d(x_l, y) = x_r`` lies in its mask; for a plane that point is closed
form, ``x_l = (x_r + d0 + gy*y) / (1 - gx)``. Both views point-sample the same texture
functions, so the right image is exact (sub-pixel disparities included) and occlusions come
out of the depth test, never from a warp. The ground truth is the disparity of the front-most
surface at every left pixel, occluded ones included (as in Scene Flow).

Everything is vectorized over samples with numpy: per surface slot, masks and disparities for
all samples at once; textures once per pixel, for the surface that won it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lowcomm.data.stereo_textures import (
    DOTS, GRADIENT, NOISE, STRIPES, texture_value, value_noise,
)
from lowcomm.errors import UsageError

KINDS = ("mixed", "dots", "planes", "shapes")

# surface support types (0 = slot unused in this sample)
NONE, FULL, RECT, ELLIPSE, POLYGON = 0, 1, 2, 3, 4
#: vertices of a polygon shape (fewer-sided polygons repeat their last vertex)
VERTICES = 6
#: shape slots after the background plane
MAX_SHAPES = 6
#: |gx| bound: keeps x_l -> x_l - d(x_l) strictly increasing (a plane never folds over itself)
MAX_SLOPE = 0.25


@dataclass
class Layers:
    """Surface parameters, arrays of shape ``(n, L)`` (``L`` slots, back to front; slot 0 is
    the background plane). Field meanings as in the module docstring; angles in radians,
    lengths in pixels, colours in [0, 1]."""

    support: np.ndarray      # int (n, L): NONE/FULL/RECT/ELLIPSE/POLYGON
    cx: np.ndarray           # shape centre
    cy: np.ndarray
    rx: np.ndarray           # half sizes (rect) / semi-axes (ellipse) / polygon ellipse
    ry: np.ndarray
    angle: np.ndarray        # shape rotation
    vertices: np.ndarray     # (n, L, VERTICES, 2) polygon vertices relative to the centre, convex, CCW
    d0: np.ndarray           # disparity plane d = d0 + gx*x + gy*y
    gx: np.ndarray
    gy: np.ndarray
    texture: np.ndarray      # int (n, L): DOTS/NOISE/STRIPES/GRADIENT
    color0: np.ndarray       # (n, L, 3)
    color1: np.ndarray       # (n, L, 3)
    scale: np.ndarray        # dot cell / noise cell / stripe period / gradient length (pixels)
    direction: np.ndarray    # stripe / gradient direction
    phase: np.ndarray        # stripe phase
    detail: np.ndarray       # weight of fine noise added to the texture (0 = pure texture)
    seed: np.ndarray         # uint32 (n, L): hash seed of the dot/noise lattices

    def take(self, idx: np.ndarray) -> Layers:
        """The scenes of samples ``idx``."""
        return Layers(**{f: getattr(self, f)[idx] for f in self.__dataclass_fields__})

    @property
    def n(self) -> int:
        """Number of scenes."""
        return int(self.support.shape[0])

    @property
    def slots(self) -> int:
        """Surface slots per scene (background included)."""
        return int(self.support.shape[1])


# ---------------------------------------------------------------------------------------
# geometry


def _local(layers: Layers, k: int, idx: np.ndarray, u: np.ndarray, v: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(u, v)`` of samples ``idx`` in slot ``k``'s rotated frame centred on the shape."""
    ang = layers.angle[idx, k][:, None, None]
    du = u - layers.cx[idx, k][:, None, None]
    dv = v - layers.cy[idx, k][:, None, None]
    c, s = np.cos(ang), np.sin(ang)
    return c * du + s * dv, -s * du + c * dv


def support_mask(layers: Layers, k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether surface slot ``k`` covers the points ``(u, v)`` (each ``(n, H, W)``)."""
    v = np.broadcast_to(v, u.shape)
    kinds = layers.support[:, k]
    mask = np.zeros(u.shape, dtype=bool)
    mask[kinds == FULL] = True
    for kind in (RECT, ELLIPSE):
        idx = np.nonzero(kinds == kind)[0]
        if len(idx) == 0:
            continue
        a, b = _local(layers, k, idx, u[idx], v[idx])
        rx = layers.rx[idx, k][:, None, None]
        ry = layers.ry[idx, k][:, None, None]
        if kind == RECT:
            mask[idx] = (np.abs(a) <= rx) & (np.abs(b) <= ry)
        else:
            mask[idx] = (a / rx) ** 2 + (b / ry) ** 2 <= 1.0
    idx = np.nonzero(kinds == POLYGON)[0]
    if len(idx):
        du = u[idx] - layers.cx[idx, k][:, None, None]
        dv = v[idx] - layers.cy[idx, k][:, None, None]
        verts = layers.vertices[idx, k]                       # (m, V, 2)
        edge = np.roll(verts, -1, axis=1) - verts                # (m, V, 2)
        # inside a convex CCW polygon: left of every edge, ex*(dv-py) - ey*(du-px) >= 0
        bound = (edge[..., 0] * verts[..., 1] - edge[..., 1] * verts[..., 0])[..., None, None]
        ex, ey = edge[..., 0, None, None], edge[..., 1, None, None]
        inside = ex[:, 0] * dv - ey[:, 0] * du >= bound[:, 0]
        for i in range(1, VERTICES):
            inside &= ex[:, i] * dv - ey[:, i] * du >= bound[:, i]
        mask[idx] = inside
    return mask


def plane_disparity(layers: Layers, k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Disparity of slot ``k``'s plane at left-view points ``(u, v)``."""
    return (layers.d0[:, k][:, None, None] + layers.gx[:, k][:, None, None] * u
            + layers.gy[:, k][:, None, None] * v)


def right_to_surface(layers: Layers, k: int, xr: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The left-view ``x_l`` of slot ``k``'s plane seen at right-view ``x_r``:
    the solution of ``x_l - d(x_l, v) = x_r`` (unique because ``gx < 1``)."""
    return ((xr + layers.d0[:, k][:, None, None] + layers.gy[:, k][:, None, None] * v)
            / (1.0 - layers.gx[:, k][:, None, None]))


def _depth_test(layers: Layers, xs: np.ndarray, v: np.ndarray, right: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Front-most surface per pixel: (winning slot, its surface u, its disparity).

    Each slot is evaluated only for the samples that use it (shape counts vary)."""
    n = layers.n
    best = np.full(xs.shape, -np.inf)
    slot = np.zeros(xs.shape, dtype=np.int64)
    u_best = np.zeros(xs.shape) if right else xs
    for k in range(layers.slots):
        idx = np.nonzero(layers.support[:, k] != NONE)[0]
        if len(idx) == 0:
            continue
        part = layers if len(idx) == n else layers.take(idx)
        x = xs if len(idx) == n else xs[idx]
        u = right_to_surface(part, k, x, v) if right else x
        d = plane_disparity(part, k, u, v)
        if k == 0 and len(idx) == n and (part.support[:, 0] == FULL).all():
            take = np.ones(d.shape, dtype=bool)     # the background plane covers everything
        else:
            take = support_mask(part, k, u, v)
        if len(idx) == n:
            take &= d > best
            np.copyto(best, d, where=take)
            np.copyto(slot, k, where=take)
            if right:
                np.copyto(u_best, u, where=take)
        else:
            take &= d > best[idx]
            best[idx] = np.where(take, d, best[idx])
            slot[idx] = np.where(take, k, slot[idx])
            if right:
                u_best[idx] = np.where(take, u, u_best[idx])
    return slot, u_best, best


# ---------------------------------------------------------------------------------------
# shading


def _shade(layers: Layers, slot: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """RGB ``(n, 3, H, W)`` of the winning surfaces at their surface points."""
    n, h, w = slot.shape
    L = layers.slots
    # one flat id per (sample, slot): 1-D takes are much cheaper than 2-D fancy indexing
    flat = (np.arange(n)[:, None, None] * L + slot).ravel()
    uf, vf = u.ravel(), np.broadcast_to(v, slot.shape).ravel()

    def param(a: np.ndarray, sel: np.ndarray) -> np.ndarray:
        return np.take(a.reshape(n * L, *a.shape[2:]), sel, axis=0)

    kinds = param(layers.texture, flat)
    weight = np.empty(uf.shape)
    for kind in (DOTS, NOISE, STRIPES, GRADIENT):
        sel = np.nonzero(kinds == kind)[0]
        if len(sel) == 0:
            continue
        ids = flat[sel]
        weight[sel] = texture_value(kind, uf[sel], vf[sel], param(layers.scale, ids),
                                    param(layers.direction, ids), param(layers.phase, ids),
                                    param(layers.seed, ids))
    detail = param(layers.detail, flat)
    fine = np.nonzero(detail > 0)[0]
    if len(fine):
        grain = value_noise(uf[fine], vf[fine], np.full(len(fine), 1.5),
                             param(layers.seed, flat[fine]) ^ np.uint32(0x85EBCA6B))
        weight[fine] = (1 - detail[fine]) * weight[fine] + detail[fine] * grain
    c0 = param(layers.color0, flat)                                      # (P, 3)
    c1 = param(layers.color1, flat)
    c1 -= c0
    c1 *= weight[:, None]
    c1 += c0
    return c1.reshape(n, h, w, 3).transpose(0, 3, 1, 2)


def render(layers: Layers, height: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(left, right, disparity)``: float64 RGB ``(n, 3, H, W)`` in [0, 1] for both views and
    the left view's disparity ``(n, H, W)`` (pixel centres at integer coordinates)."""
    n = layers.n
    xs = np.broadcast_to(np.arange(width, dtype=np.float64)[None, None, :], (n, height, width))
    v = np.arange(height, dtype=np.float64)[None, :, None]
    slot, u, disparity = _depth_test(layers, xs, v, right=False)
    left = _shade(layers, slot, u, v)
    slot, u, _ = _depth_test(layers, xs, v, right=True)
    right = _shade(layers, slot, u, v)
    return np.clip(left, 0, 1), np.clip(right, 0, 1), disparity


def occlusion_mask(layers: Layers, disparity: np.ndarray, *, tol: float = 1e-6) -> np.ndarray:
    """Left pixels the right camera does not see: the point lands outside the right image, or
    a surface with a larger disparity lies on its right-view ray."""
    n, height, width = disparity.shape
    x = np.arange(width, dtype=np.float64)[None, None, :]
    v = np.arange(height, dtype=np.float64)[None, :, None]
    d = disparity.astype(np.float64)
    xr = x - d
    hidden = (xr < -0.5) | (xr > width - 0.5)
    for k in range(layers.slots):
        u = right_to_surface(layers, k, xr, v)
        dk = plane_disparity(layers, k, u, v)
        hidden |= support_mask(layers, k, u, v) & (dk > d + tol * np.maximum(1.0, np.abs(d)))
    return hidden


# ---------------------------------------------------------------------------------------
# random scenes


def _fit_plane(rng: np.random.Generator, centre: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               cx: np.ndarray, cy: np.ndarray, ex: np.ndarray, ey: np.ndarray,
               slant: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A plane with disparity ``centre`` at ``(cx, cy)`` whose values over the box
    ``cx +- ex, cy +- ey`` stay in ``[lo, hi]``: random slopes, shrunk until they fit."""
    n = centre.shape
    gx = rng.uniform(-1, 1, n) * slant * MAX_SLOPE
    gy = rng.uniform(-1, 1, n) * slant * MAX_SLOPE
    spread = np.abs(gx) * ex + np.abs(gy) * ey
    room = np.minimum(centre - lo, hi - centre)
    shrink = np.where(spread > room, room / np.maximum(spread, 1e-12), 1.0)
    gx, gy = gx * shrink, gy * shrink
    return centre - gx * cx - gy * cy, gx, gy


def sample_layers(rng: np.random.Generator, n: int, *, height: int, width: int,
                  max_disp: float, min_disp: float = 1.0, kind: str = "mixed") -> Layers:
    """``n`` random scenes of ``kind``: ``dots`` (random-dot stereograms: fronto-parallel
    shapes at integer disparities), ``planes`` (slanted textured planes), ``shapes`` (many
    textured shapes at constant disparities over a possibly slanted background) or ``mixed``
    (each sample one of the three, textures and slants varied)."""
    if kind not in KINDS:
        raise UsageError(f"stereo kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not 0 <= min_disp < max_disp:
        raise UsageError(f"stereo needs 0 <= min_disp < max_disp, got {min_disp}, {max_disp}")
    L = 1 + MAX_SHAPES
    style = {"dots": 0, "planes": 1, "shapes": 2}
    which = (rng.integers(0, 3, n) if kind == "mixed" else np.full(n, style[kind]))
    dots, planes = which == 0, which == 1
    span = max_disp - min_disp
    top = max_disp - max(1e-3 * span, 1e-4)     # disparities stay strictly below max_disp
    count = np.where(dots, rng.integers(2, 6, n),
                     np.where(planes, rng.integers(2, 5, n), rng.integers(3, MAX_SHAPES + 1, n)))
    support = np.zeros((n, L), dtype=np.int64)
    support[:, 0] = FULL
    for k in range(1, L):
        support[:, k] = np.where(k <= count, rng.integers(RECT, POLYGON + 1, n), NONE)
    size = min(height, width)
    big = np.where(planes, 1.25, 1.0)[:, None]
    rx = rng.uniform(0.12, 0.45, (n, L)) * size * big
    ry = rng.uniform(0.12, 0.45, (n, L)) * size * big
    cx = rng.uniform(0, width, (n, L))
    cy = rng.uniform(0, height, (n, L))
    cx[:, 0], cy[:, 0] = (width - 1) / 2, (height - 1) / 2
    rx[:, 0], ry[:, 0] = (width - 1) / 2, (height - 1) / 2
    angle = rng.uniform(0, np.pi, (n, L)) * ~dots[:, None]
    theta = np.sort(rng.uniform(0, 2 * np.pi, (n, L, VERTICES)), axis=-1)
    sides = rng.integers(3, VERTICES + 1, (n, L))
    theta = np.where(np.arange(VERTICES) < sides[..., None], theta,
                     np.take_along_axis(theta, sides[..., None] - 1, axis=-1))
    ca, sa = np.cos(angle)[..., None], np.sin(angle)[..., None]
    px, py = rx[..., None] * np.cos(theta), ry[..., None] * np.sin(theta)
    vertices = np.stack([ca * px - sa * py, sa * px + ca * py], axis=-1)

    # disparities: background in the back part of the range, shapes sorted front-wards
    centre = np.empty((n, L))
    centre[:, 0] = min_disp + rng.uniform(0.0, 0.45, n) * span
    front = np.sort(rng.uniform(0.25, 1.0, (n, L - 1)), axis=1)
    centre[:, 1:] = min_disp + front * span
    slant = np.where(dots, 0.0, np.where(planes, 1.0, 0.0))[:, None] * np.ones((n, L))
    slant[:, 0] = np.where(dots, 0.0, np.where(planes, 1.0, rng.uniform(0, 1, n) < 0.5))
    centre = np.where(dots[:, None], np.floor(centre), centre)
    centre = np.clip(centre, min_disp, top)
    if dots.any():   # integer disparities: the floor may not fall below min_disp
        centre = np.where(dots[:, None], np.maximum(centre, np.ceil(min_disp)), centre)
    reach = np.sqrt(rx ** 2 + ry ** 2)
    ex = np.where(np.arange(L) == 0, (width - 1) / 2, reach)
    ey = np.where(np.arange(L) == 0, (height - 1) / 2, reach)
    # the background keeps to the back of the range, so that shapes in front of it show
    lo = np.full((n, L), float(min_disp))
    hi = np.full((n, L), top)
    hi[:, 0] = min(top, min_disp + 0.6 * span)
    d0, gx, gy = _fit_plane(rng, centre, lo, hi, cx, cy, ex, ey, slant)

    texture = rng.integers(DOTS, GRADIENT + 1, (n, L))
    texture = np.where(dots[:, None], DOTS, texture)
    color0 = rng.uniform(0, 1, (n, L, 3))
    color1 = rng.uniform(0, 1, (n, L, 3))
    gray = dots[:, None, None]
    color0 = np.where(gray, rng.uniform(0.0, 0.3, (n, L, 1)), color0)
    color1 = np.where(gray, rng.uniform(0.7, 1.0, (n, L, 1)), color1)
    scale = np.select(
        [texture == DOTS, texture == NOISE, texture == STRIPES],
        [rng.integers(1, 4, (n, L)).astype(np.float64), rng.uniform(2, 10, (n, L)),
         rng.uniform(3, 14, (n, L))],
        rng.uniform(0.5, 2.0, (n, L)) * (width + max_disp))
    direction = rng.uniform(0, 2 * np.pi, (n, L))
    phase = np.where(texture == GRADIENT, rng.uniform(0, 0.5, (n, L)), rng.uniform(0, 2 * np.pi, (n, L)))
    detail = np.where((texture == DOTS) | dots[:, None], 0.0, rng.uniform(0.0, 0.35, (n, L)))
    seed = rng.integers(0, 2 ** 32, (n, L), dtype=np.uint64).astype(np.uint32)
    return Layers(support=support, cx=cx, cy=cy, rx=rx, ry=ry, angle=angle, vertices=vertices,
                  d0=d0, gx=gx, gy=gy, texture=texture, color0=color0, color1=color1,
                  scale=scale, direction=direction, phase=phase, detail=detail, seed=seed)


def generate(n: int, *, height: int, width: int, max_disp: float, min_disp: float = 1.0,
             kind: str = "mixed", seed: int = 0, chunk: int = 64) -> dict[str, np.ndarray]:
    """``n`` stereo pairs: ``left``/``right`` uint8 ``(n, 3, H, W)`` and ``disparity`` float32
    ``(n, H, W)``. Chunk ``i`` draws from its own generator seeded ``(seed, i)``, so the
    result depends on the arguments only (not on memory or threads)."""
    if n < 0 or height < 1 or width < 1:
        raise UsageError(f"stereo needs n >= 0 and a positive size, got n={n}, {height}x{width}")
    left = np.empty((n, 3, height, width), dtype=np.uint8)
    right = np.empty_like(left)
    disparity = np.empty((n, height, width), dtype=np.float32)
    for i, start in enumerate(range(0, n, chunk)):
        stop = min(n, start + chunk)
        rng = np.random.default_rng([seed, i])
        layers = sample_layers(rng, stop - start, height=height, width=width,
                               max_disp=max_disp, min_disp=min_disp, kind=kind)
        lv, rv, d = render(layers, height, width)
        left[start:stop] = np.rint(lv * 255)
        right[start:stop] = np.rint(rv * 255)
        disparity[start:stop] = d
    return {"left": left, "right": right, "disparity": disparity}

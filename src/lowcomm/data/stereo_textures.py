"""Textures of the procedural stereo scenes: functions of surface coordinates, no tables.

Why functions: the right view must show the *same* surface point the left view shows at a
different pixel, at sub-pixel positions too. A texture that is a pure function of the surface
coordinates ``(u, v)`` (an integer hash for random lattices, closed forms for stripes and
gradients) is point-sampled exactly wherever a view looks, with no stored image to resample.
"""

from __future__ import annotations

import numpy as np

# texture types
DOTS, NOISE, STRIPES, GRADIENT = 0, 1, 2, 3


def _lattice(a: np.ndarray) -> np.ndarray:
    """Integer lattice coordinate ``floor(a)`` as uint32 (two's-complement wrap for negatives)."""
    return np.floor(a).astype(np.int64).astype(np.uint32)


def _hash(ix: np.ndarray, iy: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """A uniform float in [0, 1) per integer lattice point (uint32 coordinates; integer hash,
    no tables)."""
    h = ix * np.uint32(0x27D4EB2D) ^ iy * np.uint32(0x165667B1) ^ seed
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x2C1B3C6D)
    h ^= h >> np.uint32(12)
    h *= np.uint32(0x297A2D39)
    h ^= h >> np.uint32(15)
    return h.astype(np.float64) * (1.0 / 4294967296.0)


def value_noise(u: np.ndarray, v: np.ndarray, cell: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """Smooth (C1) value noise in [0, 1): lattice values blended with a smoothstep."""
    a, b = u / cell, v / cell
    fa, fb = a - np.floor(a), b - np.floor(b)
    ia, ib = _lattice(a), _lattice(b)
    one = np.uint32(1)
    fa, fb = fa * fa * (3 - 2 * fa), fb * fb * (3 - 2 * fb)
    h00, h10 = _hash(ia, ib, seed), _hash(ia + one, ib, seed)
    h01, h11 = _hash(ia, ib + one, seed), _hash(ia + one, ib + one, seed)
    return (h00 * (1 - fa) + h10 * fa) * (1 - fb) + (h01 * (1 - fa) + h11 * fa) * fb


def texture_value(kind: int, u: np.ndarray, v: np.ndarray, scale: np.ndarray,
                  direction: np.ndarray, phase: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """Texture ``kind`` at surface points ``(u, v)`` (1-D arrays, per-point parameters):
    the blend weight between the surface's two colours."""
    if kind == DOTS:   # random-dot stereogram: each scale x scale cell black or white
        return (_hash(_lattice(u / scale), _lattice(v / scale), seed) < 0.5).astype(np.float64)
    if kind == NOISE:
        return 0.65 * value_noise(u, v, scale, seed) + 0.35 * value_noise(
            u, v, np.maximum(scale / 3, 1.0), seed ^ np.uint32(0x9E3779B9))
    t = u * np.cos(direction) + v * np.sin(direction)
    if kind == STRIPES:
        return 0.5 + 0.5 * np.sin(2 * np.pi * t / scale + phase)
    if kind == GRADIENT:
        return np.clip(phase + t / scale, 0.0, 1.0)
    raise ValueError(f"unknown texture kind {kind}")

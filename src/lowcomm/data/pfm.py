"""PFM (Portable Float Map) read/write: the format of Scene Flow's disparity maps.

Layout: a text header of three whitespace-separated parts, ``PF`` (3 channels) or ``Pf``
(1 channel), ``width height``, and a scale whose *sign* is the byte order (negative =
little-endian, positive = big-endian; its magnitude is unused here), one whitespace byte, then
float32 rows stored **bottom to top**. Readers that forget the flip get upside-down
disparities, writers that forget the sign get byte-swapped garbage on the other side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lowcomm.errors import UsageError


def _header_tokens(data: bytes, path: Path) -> tuple[list[bytes], int]:
    """The four header tokens and the offset of the first data byte."""
    tokens: list[bytes] = []
    pos = 0
    while len(tokens) < 4:
        while pos < len(data) and data[pos:pos + 1].isspace():
            pos += 1
        start = pos
        while pos < len(data) and not data[pos:pos + 1].isspace():
            pos += 1
        if start == pos:
            raise UsageError(f"{path}: not a PFM file (header ends early)")
        tokens.append(data[start:pos])
        if len(tokens) == 1 and tokens[0] not in (b"PF", b"Pf"):
            raise UsageError(f"{path}: not a PFM file (starts with {tokens[0][:8]!r}, expected PF or Pf)")
    return tokens, pos + 1   # exactly one whitespace byte after the scale


def read_pfm(path: str | Path) -> np.ndarray:
    """The float32 image in ``path``: ``(H, W)`` for ``Pf``, ``(H, W, 3)`` for ``PF``, top row first."""
    path = Path(path)
    data = path.read_bytes()
    tokens, offset = _header_tokens(data, path)
    try:
        width, height, scale = int(tokens[1]), int(tokens[2]), float(tokens[3])
    except ValueError:
        raise UsageError(f"{path}: bad PFM header {b' '.join(tokens)!r}") from None
    if width <= 0 or height <= 0 or scale == 0:
        raise UsageError(f"{path}: bad PFM header (size {width}x{height}, scale {scale})")
    channels = 3 if tokens[0] == b"PF" else 1
    count = width * height * channels
    if len(data) - offset < 4 * count:
        raise UsageError(f"{path}: PFM data truncated ({len(data) - offset} bytes, need {4 * count})")
    dtype = np.dtype("<f4") if scale < 0 else np.dtype(">f4")
    values = np.frombuffer(data, dtype=dtype, count=count, offset=offset).astype(np.float32)
    shape = (height, width, 3) if channels == 3 else (height, width)
    return np.ascontiguousarray(values.reshape(shape)[::-1])


def write_pfm(path: str | Path, array: np.ndarray, *, little_endian: bool = True) -> None:
    """Write a ``(H, W)`` or ``(H, W, 3)`` array as PFM (float32, rows bottom to top)."""
    a = np.asarray(array)
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] != 3):
        raise UsageError(f"write_pfm: array must be (H, W) or (H, W, 3), got {a.shape}")
    dtype = np.dtype("<f4") if little_endian else np.dtype(">f4")
    header = f"{'PF' if a.ndim == 3 else 'Pf'}\n{a.shape[1]} {a.shape[0]}\n{-1.0 if little_endian else 1.0}\n"
    body = np.ascontiguousarray(a[::-1], dtype=dtype).tobytes()
    Path(path).write_bytes(header.encode("ascii") + body)

"""Encoded images (PNG/JPEG files, or their bytes in parquet) decoded to arrays: the records,
Pillow's decode, the scaling to [-1, 1] and the reasons a record cannot be read.

Imports no torch: Ray Data's tasks decode an image folder's rows with these, and torch would
be their dearest import (about 1.5 CPU-s a task worker). The torch loader's dataset over the
same records is ``convoy.data.encoded``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from convoy.errors import DataError


@dataclass(frozen=True)
class ImageRecord:
    """One labelled image: a file on disk, or encoded bytes from a shard."""

    name: str
    """How errors and reports name it: a file path, or ``<shard>#<row>``."""
    label: int
    path: Path | None = None
    data: bytes | None = None

    def read_bytes(self) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        return self.path.read_bytes()


def decode_rgb(raw: bytes, size: int) -> np.ndarray:
    """Encoded image -> RGB uint8 array (size, size, 3); Pillow's errors pass through."""
    with Image.open(io.BytesIO(raw)) as img:
        rgb = img.convert("RGB")
        if rgb.size != (size, size):
            rgb = rgb.resize((size, size))
        return np.asarray(rgb, dtype=np.uint8)


def rgb_to_array(rgb: np.ndarray) -> np.ndarray:
    """(H, W, 3) uint8 -> (3, H, W) float32 in [-1, 1]."""
    array = np.ascontiguousarray(np.transpose(rgb, (2, 0, 1)), dtype=np.float32)
    return (array / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)


UNREADABLE = (OSError, ValueError, SyntaxError)
"""Pillow's (and the file system's) ways of saying "this is not an image I can read"."""


def unreadable_reason(exc: BaseException) -> str:
    """A short, stable reason for a record that cannot be read."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, UnidentifiedImageError):
        return "not an image Pillow can identify"
    return str(exc) or type(exc).__name__


def decode_record(record: ImageRecord, size: int) -> np.ndarray:
    """Decode one record, or raise ``DataError`` naming it."""
    try:
        return decode_rgb(record.read_bytes(), size)
    except UNREADABLE as exc:
        raise DataError(
            f"data: cannot read image {record.name}: {unreadable_reason(exc)}"
        ) from None

"""Images stored encoded (PNG/JPEG files, or their bytes in parquet): one decode path for
every reader and both loaders, so a folder and its parquet conversion train identically.

Records are decoded with Pillow, converted to RGB, resized to the dataset's size and scaled
to [-1, 1]. ``data.on_bad_record`` decides what an unreadable record does: ``error`` names it
and stops; ``skip`` decodes every record once when the split is built, leaves out those that
fail and reports them, so the epoch length is known before training starts.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from convoy.data.base import augment
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


def rgb_to_tensor(rgb: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, H, W) float in [-1, 1]."""
    array = torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.float32) / 255.0)
    return (array.permute(2, 0, 1) - 0.5) / 0.5


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


class EncodedImageDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Decodes on access; optional training augmentation (random shift, horizontal flip)."""

    def __init__(
        self,
        records: list[ImageRecord],
        image_size: int,
        crop_padding: int = 0,
        flip: bool = False,
    ) -> None:
        self.records = records
        self.image_size = image_size
        self.crop_padding = crop_padding
        self.flip = flip

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self.records[index]
        image = rgb_to_tensor(decode_record(record, self.image_size))
        image = augment(image, self.crop_padding, self.flip, fill=-1.0)
        return image, torch.tensor(record.label)


def find_bad_records(records: Iterable[ImageRecord], size: int) -> list[tuple[ImageRecord, str]]:
    """Every record that does not decode, with the reason."""
    bad = []
    for record in records:
        try:
            decode_rgb(record.read_bytes(), size)
        except UNREADABLE as exc:
            bad.append((record, unreadable_reason(exc)))
    return bad


def apply_bad_record_policy(
    records: list[ImageRecord], policy: str, size: int, skipped: list[str]
) -> list[ImageRecord]:
    """``skip``: drop the records that do not decode and append their names to ``skipped``.

    ``error`` returns the records unchanged; a bad one stops the run when it is decoded.
    """
    if policy != "skip":
        return records
    bad = find_bad_records(records, size)
    names = {record.name for record, _ in bad}
    skipped += [f"{record.name} ({reason})" for record, reason in bad]
    return [r for r in records if r.name not in names]


def check_labels(records: Iterable[ImageRecord], num_classes: int) -> None:
    """A label outside 0..num_classes-1 is an error naming the record, whatever the policy."""
    for record in records:
        if not 0 <= record.label < num_classes:
            raise DataError(
                f"data: record {record.name} has label {record.label}; "
                f"labels must be in 0..{num_classes - 1} (the class map has {num_classes} classes)"
            )

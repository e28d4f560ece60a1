"""Images stored encoded (PNG/JPEG files, or their bytes in parquet): one decode path for
every reader and both loaders, so a folder and its parquet conversion train identically.

Records are decoded with Pillow, converted to RGB, resized to the dataset's size and scaled
to [-1, 1]. ``data.on_bad_record`` decides what an unreadable record does: ``error`` names it
and stops; ``skip`` decodes every record once when the split is built, leaves out those that
fail and reports them, so the epoch length is known before training starts. The decoding
itself is ``convoy.data.image_records`` (no torch: Ray Data's tasks use it); this module is
the torch loader's dataset over it and the checks a split's records get.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from convoy.data.base import augment
from convoy.data.image_records import (
    UNREADABLE,
    ImageRecord,
    decode_record,
    decode_rgb,
    rgb_to_array,
    unreadable_reason,
)
from convoy.errors import DataError


def rgb_to_tensor(rgb: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, H, W) float in [-1, 1]."""
    return torch.from_numpy(rgb_to_array(rgb))


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

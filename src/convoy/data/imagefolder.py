"""ImageFolder trees: ``<path>/<split>/<class>/<image>``, read lazily with Pillow.

``train/`` and ``val/`` are required; ``test/`` is used when present, otherwise the test
metrics are computed on ``val/`` (said in the run log). Classes are the sorted folder names
of ``train/``; every image is converted to RGB and resized to ``data.image_size`` (default 32)
(see ``convoy.data.encoded``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from convoy.config import DataConfig
from convoy.data.base import Splits, given_path, image_shape
from convoy.data.encoded import EncodedImageDataset, apply_bad_record_policy, check_labels
from convoy.data.image_records import ImageRecord
from convoy.data.sources import DATA_SEED
from convoy.errors import ConfigError, DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm"}


def list_classes(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def list_files(split_dir: Path, classes: list[str]) -> list[ImageRecord]:
    """The split's images in ImageFolder order: classes sorted, files sorted within each."""
    files = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if folder.is_dir():
            files += [
                ImageRecord(str(p), label, path=p)
                for p in sorted(folder.iterdir())
                if p.suffix.lower() in IMAGE_SUFFIXES
            ]
    return files


def check_imagefolder_path(path: str | None) -> Path:
    expected = "imagefolder reads <path>/train/<class>/*.png and <path>/val/<class>/*.png"
    root = given_path(path, expected)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError("data.path", path, f"there is no {split}/ folder in it; {expected}")
    return root


def load_imagefolder(cfg: DataConfig) -> Splits:
    root = check_imagefolder_path(cfg.path)
    classes = list_classes(root / "train")
    if not classes:
        raise DataError(f"data.path: {root / 'train'} has no class folders")
    train = list_files(root / "train", classes)
    val = list_files(root / "val", classes)
    test_dir = root / "test" if (root / "test").is_dir() else root / "val"
    test = list_files(test_dir, classes)
    for split, files in (("train", train), ("val", val)):
        if not files:
            raise DataError(f"data.path: {root / split} holds no images ({sorted(IMAGE_SUFFIXES)})")
    return encoded_splits(cfg, {"train": train, "val": val, "test": test}, len(classes))


def encoded_splits(cfg: DataConfig, records: dict[str, list[ImageRecord]], classes: int) -> Splits:
    """Splits of encoded images: the train_size cap, the bad-record policy, label checks."""
    size = cfg.image_size or 32
    train = records["train"]
    if cfg.train_size is not None:  # a seeded random subset: the first files are one class
        gen = torch.Generator().manual_seed(DATA_SEED)
        keep = torch.randperm(len(train), generator=gen)[: cfg.train_size]
        train = [train[i] for i in sorted(keep.tolist())]
    skipped: list[str] = []
    kept = {}
    for split, split_records in (
        ("train", train),
        ("val", records["val"]),
        ("test", records["test"]),
    ):
        check_labels(split_records, classes)
        kept[split] = apply_bad_record_policy(split_records, cfg.on_bad_record, size, skipped)
    return Splits(
        EncodedImageDataset(kept["train"], size, cfg.augment_crop_padding, cfg.augment_flip),
        EncodedImageDataset(kept["val"], size),
        EncodedImageDataset(kept["test"], size),
        image_shape(classes, 3, size),
        skipped=tuple(dict.fromkeys(skipped)),  # val doubles as test: report each record once
    )

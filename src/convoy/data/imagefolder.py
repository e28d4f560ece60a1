"""ImageFolder trees: ``<path>/<split>/<class>/<image>``, read lazily with Pillow.

``train/`` and ``val/`` are required; ``test/`` is used when present, otherwise the test
metrics are computed on ``val/`` (said in the run log). Classes are the sorted folder names
of ``train/``; every image is converted to RGB and resized to ``data.image_size`` (default 32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from convoy.config import DataConfig
from convoy.data.base import Splits
from convoy.data.sources import DATA_SEED
from convoy.errors import ConfigError, DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm"}


class ImageFolderDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, files: list[tuple[Path, int]], image_size: int) -> None:
        self.files = files
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        path, label = self.files[index]
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB").resize((self.image_size, self.image_size))
        except OSError as exc:
            raise DataError(f"data.path: cannot read image {path}: {exc}") from None
        array = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (array - 0.5) / 0.5, torch.tensor(label)


def list_classes(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def list_files(split_dir: Path, classes: list[str]) -> list[tuple[Path, int]]:
    files = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if folder.is_dir():
            files += [
                (p, label) for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES
            ]
    return files


def check_imagefolder_path(path: str | None) -> Path:
    expected = "imagefolder reads <path>/train/<class>/*.png and <path>/val/<class>/*.png"
    if not path:
        raise ConfigError("data.path", path, expected)
    root = Path(path).expanduser()
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise ConfigError("data.path", path, f"there is no {split}/ folder in it; {expected}")
    return root


def load_imagefolder(cfg: DataConfig) -> Splits:
    root = check_imagefolder_path(cfg.path)
    classes = list_classes(root / "train")
    if not classes:
        raise DataError(f"data.path: {root / 'train'} has no class folders")
    size = cfg.image_size or 32
    train = list_files(root / "train", classes)
    if cfg.train_size is not None:  # a seeded random subset: the first files are one class
        gen = torch.Generator().manual_seed(DATA_SEED)
        keep = torch.randperm(len(train), generator=gen)[: cfg.train_size]
        train = [train[i] for i in sorted(keep.tolist())]
    val = list_files(root / "val", classes)
    test_dir = root / "test" if (root / "test").is_dir() else root / "val"
    test = list_files(test_dir, classes)
    for split, files in (("train", train), ("val", val)):
        if not files:
            raise DataError(f"data.path: {root / split} holds no images ({sorted(IMAGE_SUFFIXES)})")
    return Splits(
        ImageFolderDataset(train, size),
        ImageFolderDataset(val, size),
        ImageFolderDataset(test, size),
        len(classes),
        3,
        size,
    )

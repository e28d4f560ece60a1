"""Parquet shards of encoded images, as ``convoy data convert`` writes them::

    <path>/classes.json            {"classes": [...names in label order...], ...}
    <path>/train/part-00000.parquet ...   columns: index, image (encoded bytes), label, name
    <path>/val/...                 optional: else a seeded val_fraction of train is held out
    <path>/test/...                optional: else val doubles as test

Images keep the bytes of their source file, so a converted ImageFolder tree decodes to the
same pixels and trains to the same metrics. pyarrow is imported only when this source is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from convoy.config import DataConfig
from convoy.data.base import Splits, given_path, seeded_split
from convoy.data.encoded import check_labels
from convoy.data.image_records import ImageRecord
from convoy.data.imagefolder import encoded_splits
from convoy.data.sources import DATA_SEED
from convoy.errors import ConfigError, DataError

CLASSES_FILE = "classes.json"
COLUMNS = ("index", "image", "label", "name")


def check_parquet_path(path: str | None) -> Path:
    expected = "parquet reads <path>/classes.json and <path>/train/*.parquet (convoy data convert)"
    root = given_path(path, expected)
    if not (root / CLASSES_FILE).is_file() or not (root / "train").is_dir():
        raise ConfigError("data.path", path, f"no {CLASSES_FILE} or train/ in it; {expected}")
    return root


def read_classes(root: Path) -> list[str]:
    classes: list[str] = json.loads((root / CLASSES_FILE).read_text())["classes"]
    return classes


def shard_files(split_dir: Path) -> list[Path]:
    return sorted(split_dir.glob("*.parquet"))


def read_records(split_dir: Path) -> list[ImageRecord]:
    """Every row of a split's shards, in shard and row order."""
    import pyarrow.parquet as pq  # 0.3 s to import: only where parquet is read

    records = []
    for shard in shard_files(split_dir):
        table = pq.read_table(shard, columns=list(COLUMNS))
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise DataError(f"data.path: {shard} lacks the column(s) {missing}; expected {COLUMNS}")
        columns: dict[str, list[Any]] = table.to_pydict()
        for row, (image, label) in enumerate(zip(columns["image"], columns["label"], strict=True)):
            records.append(ImageRecord(f"{shard}#{row}", int(label), data=image))
    return records


def streams_whole_train(cfg: DataConfig) -> bool:
    """Whether the train shards are used whole, row for row, so a reader can stream them:
    a val/ split of its own, no train_size cap, and no bad-record scan."""
    if cfg.name != "parquet" or cfg.train_size is not None or cfg.on_bad_record != "error":
        return False
    return bool(shard_files(check_parquet_path(cfg.path) / "val"))


def check_train_labels(cfg: DataConfig) -> int:
    """Rows of the train split, after checking its labels (reads the label column only)."""
    import pyarrow.parquet as pq  # 0.3 s to import: only where parquet is read

    root = check_parquet_path(cfg.path)
    classes = len(read_classes(root))
    rows = 0
    for shard in shard_files(root / "train"):
        labels = pq.read_table(shard, columns=["label"]).column("label").to_pylist()
        check_labels(
            (ImageRecord(f"{shard}#{i}", int(label)) for i, label in enumerate(labels)), classes
        )
        rows += len(labels)
    if not rows:
        raise DataError(f"data.path: {root / 'train'} holds no rows")
    return rows


def load_parquet(cfg: DataConfig, read_train: bool = True) -> Splits:
    """The splits; with ``read_train=False`` train is left empty for a streaming reader."""
    root = check_parquet_path(cfg.path)
    classes = read_classes(root)
    if not read_train:
        val = read_records(root / "val")
        test = read_records(root / "test") if shard_files(root / "test") else val
        return encoded_splits(cfg, {"train": [], "val": val, "test": test}, len(classes))
    train = read_records(root / "train")
    if not train:
        raise DataError(f"data.path: {root / 'train'} holds no rows")
    if shard_files(root / "val"):
        val = read_records(root / "val")
    else:  # hold out a seeded share of train, as for CIFAR-10
        val_idx, train_idx = seeded_split(len(train), (cfg.val_fraction,), DATA_SEED)
        val = [train[i] for i in sorted(val_idx.tolist())]
        train = [train[i] for i in sorted(train_idx.tolist())]
    test = read_records(root / "test") if shard_files(root / "test") else val
    return encoded_splits(cfg, {"train": train, "val": val, "test": test}, len(classes))

"""CIFAR-10 from the standard python-pickle batches, never downloaded.

``data.path`` is a directory holding ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``
(directly or in ``cifar-10-batches-py/``), or the ``cifar-10-python.tar.gz`` archive. The
batches are pickles, so they are read with an unpickler that only builds numpy arrays, lists,
dicts and bytes: a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.config import DataConfig
from convoy.data.base import Splits, TensorImageDataset, given_path, image_shape, seeded_split
from convoy.data.sources import DATA_SEED
from convoy.errors import ConfigError, DataError

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR-10 batch")


def _parse_batch(raw: bytes, origin: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        batch = _ArrayOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as exc:
        raise DataError(
            f"data.path: {origin} is not a CIFAR-10 python batch ({type(exc).__name__}: {exc}); "
            "expected a pickled dict with b'data' (N x 3072 uint8) and b'labels'"
        ) from None
    if len(data) != len(labels) or labels.min(initial=0) < 0 or labels.max(initial=0) > 9:
        raise DataError(f"data.path: {origin} has labels that do not match its images or 0..9")
    return data, labels


def _read_batches(path: Path) -> dict[str, bytes]:
    names = (*TRAIN_BATCHES, TEST_BATCH)
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz", ".tar")):
        found: dict[str, bytes] = {}
        try:
            with tarfile.open(path) as archive:
                for member in archive.getmembers():
                    base = Path(member.name).name
                    if base in names and member.isfile():
                        handle = archive.extractfile(member)
                        if handle is not None:
                            found[base] = handle.read()
        except tarfile.TarError as exc:
            raise DataError(f"data.path: {path} is not a readable tar archive ({exc})") from None
        return found
    for folder in (path, path / "cifar-10-batches-py"):
        if all((folder / n).is_file() for n in names):
            return {n: (folder / n).read_bytes() for n in names}
    return {n: (path / n).read_bytes() for n in names if (path / n).is_file()}


def check_cifar10_path(path: str | None) -> Path:
    """Fail before training if the CIFAR-10 path is unset or does not exist."""
    expected = (
        "cifar10 reads a directory with data_batch_1..5 and test_batch, or the "
        "cifar-10-python.tar.gz you give (Convoy never downloads)"
    )
    resolved = given_path(path, expected)
    if not resolved.exists():
        raise ConfigError("data.path", path, f"that path does not exist; {expected}")
    return resolved


CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"
)  # fmt: skip


def read_cifar10(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images, labels), "test": ...}``; images are (N, 3, 32, 32) uint8."""
    raw = _read_batches(path)
    missing = [n for n in (*TRAIN_BATCHES, TEST_BATCH) if n not in raw]
    if missing:
        raise DataError(f"data.path: {str(path)!r} is missing CIFAR-10 files: {', '.join(missing)}")
    train_parts = [_parse_batch(raw[n], f"{path}/{n}") for n in TRAIN_BATCHES]
    train = (
        np.concatenate([p[0] for p in train_parts]),
        np.concatenate([p[1] for p in train_parts]),
    )
    return {"train": train, "test": _parse_batch(raw[TEST_BATCH], f"{path}/{TEST_BATCH}")}


def load_cifar10(cfg: DataConfig) -> Splits:
    arrays = read_cifar10(check_cifar10_path(cfg.path))
    images, labels = (torch.from_numpy(a) for a in arrays["train"])
    test_images, test_labels = arrays["test"]
    val_idx, train_idx = seeded_split(len(labels), (cfg.val_fraction,), DATA_SEED)
    if cfg.train_size is not None:
        train_idx = train_idx[: cfg.train_size]

    def subset(x: torch.Tensor, y: torch.Tensor, train: bool = False) -> TensorImageDataset:
        crop, flip = (cfg.augment_crop_padding, cfg.augment_flip) if train else (0, False)
        return TensorImageDataset(x, y, MEAN, STD, 1 / 255.0, crop, flip)

    return Splits(
        subset(images[train_idx], labels[train_idx], train=True),
        subset(images[val_idx], labels[val_idx]),
        subset(torch.from_numpy(test_images), torch.from_numpy(test_labels)),
        image_shape(10, 3, 32),
    )

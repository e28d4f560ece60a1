"""In-memory sources: ``digits`` (scikit-learn's bundled 8x8 images), ``synthetic`` and
``numpy`` (arrays in .npz files).

Both are deterministic functions of the config and a fixed data seed, so every rank builds the
same splits without communicating.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from convoy.config import DataConfig
from convoy.data.base import Splits, TensorImageDataset, given_path, image_shape, seeded_split
from convoy.data.cache import cached_arrays
from convoy.errors import ConfigError, DataError

# The split of a dataset must not move when the training seed changes.
DATA_SEED = 20240601


def load_digits(cfg: DataConfig) -> Splits:
    """scikit-learn's 1,797 handwritten digits, 8x8 grey levels 0-16, split test/val/train."""
    arrays = cached_arrays("datasets", bundled_key("load_digits"), _decode_digits)
    images = torch.tensor(arrays["images"], dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(arrays["target"], dtype=torch.long)
    test_idx, val_idx, train_idx = seeded_split(
        len(labels), (cfg.test_fraction, cfg.val_fraction), DATA_SEED
    )
    if cfg.train_size is not None:
        train_idx = train_idx[: cfg.train_size]
    mean, std = _channel_stats(images[train_idx] / 16.0)

    def subset(idx: torch.Tensor, train: bool = False) -> TensorImageDataset:
        crop, flip = (cfg.augment_crop_padding, cfg.augment_flip) if train else (0, False)
        return TensorImageDataset(images[idx], labels[idx], mean, std, 1 / 16.0, crop, flip)

    train = subset(train_idx, train=True)
    return Splits(train, subset(val_idx), subset(test_idx), image_shape(10, 1, 8))


def bundled_key(loader: str) -> dict[str, str]:
    """The cache key of a dataset that ships inside scikit-learn: the loader and the release
    (read from the installed metadata, which does not import scikit-learn)."""
    return {"loader": f"sklearn.datasets.{loader}", "version": version("scikit-learn")}


def _decode_digits() -> dict[str, np.ndarray]:
    # Imported only on a cache miss: scikit-learn costs a worker about a second of CPU.
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    return {"images": bunch.images, "target": bunch.target}


def load_synthetic(cfg: DataConfig, num_classes: int = 10, channels: int = 3) -> Splits:
    """CIFAR-shaped images: a fixed random template per class plus Gaussian noise.

    The template's amplitude (0.5 against noise of 1.0) makes the classes separable but not
    trivially, so accuracy is a real signal that training works.
    """
    size = cfg.image_size or 32
    n_train = cfg.train_size or 5000
    n_val = max(1, round(n_train * cfg.val_fraction))
    n_test = max(1, round(n_train * cfg.test_fraction))
    gen = torch.Generator().manual_seed(DATA_SEED)
    templates = torch.randn(num_classes, channels, size, size, generator=gen)

    def make(n: int, train: bool = False) -> TensorImageDataset:
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        images = 0.5 * templates[labels] + torch.randn(n, channels, size, size, generator=gen)
        crop, flip = (cfg.augment_crop_padding, cfg.augment_flip) if train else (0, False)
        return TensorImageDataset(images, labels, crop_padding=crop, flip=flip)

    train = make(n_train, train=True)
    val, test = make(n_val), make(n_test)
    return Splits(train, val, test, image_shape(num_classes, channels, size))


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    mean = images.mean(dim=(0, 2, 3))
    std = images.std(dim=(0, 2, 3)).clamp_min(1e-6)
    return tuple(mean.tolist()), tuple(std.tolist())


def check_numpy_path(path: str | None) -> Path:
    expected = (
        "numpy reads <path>/train.npz (and optional val.npz, test.npz) holding 'images' "
        "(N, H, W) or (N, H, W, C) uint8 and 'labels' (N,)"
    )
    root = given_path(path, expected)
    if not (root / "train.npz").is_file():
        raise ConfigError("data.path", path, f"there is no train.npz in it; {expected}")
    return root


def _read_npz(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path, allow_pickle=False) as arrays:
        if "images" not in arrays or "labels" not in arrays:
            raise DataError(f"data.path: {path} needs arrays 'images' and 'labels'")
        images, labels = arrays["images"], arrays["labels"]
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[1] != images.shape[2] or len(images) != len(labels):
        raise DataError(
            f"data.path: {path} has images {images.shape} and labels {labels.shape}; "
            "expected square (N, H, W[, C]) images and N labels"
        )
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels)


def load_numpy(cfg: DataConfig) -> Splits:
    """Arrays in .npz files; val (test) is held out of train (val) when its file is absent."""
    root = check_numpy_path(cfg.path)
    images, labels = _read_npz(root / "train.npz")
    if (root / "val.npz").is_file():
        val_images, val_labels = _read_npz(root / "val.npz")
    else:
        val_idx, train_idx = seeded_split(len(labels), (cfg.val_fraction,), DATA_SEED)
        val_images, val_labels = images[val_idx], labels[val_idx]
        images, labels = images[train_idx], labels[train_idx]
    test_images, test_labels = (
        _read_npz(root / "test.npz") if (root / "test.npz").is_file() else (val_images, val_labels)
    )
    if cfg.train_size is not None:
        images, labels = images[: cfg.train_size], labels[: cfg.train_size]
    num_classes = int(max(labels.max(), val_labels.max(), test_labels.max())) + 1
    if min(labels.min(), val_labels.min(), test_labels.min()) < 0:
        raise DataError(f"data.path: {root} has negative labels; labels must be 0..classes-1")
    scale = 1 / 255.0 if images.dtype == torch.uint8 else 1.0
    mean, std = _channel_stats(images.float() * scale)
    crop, flip = cfg.augment_crop_padding, cfg.augment_flip

    def dataset(x: torch.Tensor, y: torch.Tensor, train: bool = False) -> TensorImageDataset:
        return TensorImageDataset(x, y, mean, std, scale, crop if train else 0, flip and train)

    return Splits(
        dataset(images, labels, train=True),
        dataset(val_images, val_labels),
        dataset(test_images, test_labels),
        image_shape(num_classes, images.shape[1], images.shape[2]),
    )

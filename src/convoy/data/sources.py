"""In-memory sources: ``digits`` (scikit-learn's bundled 8x8 images) and ``synthetic``.

Both are deterministic functions of the config and a fixed data seed, so every rank builds the
same splits without communicating.
"""

from __future__ import annotations

import torch

from convoy.config import DataConfig
from convoy.data.base import Splits, TensorImageDataset, seeded_split

# The split of a dataset must not move when the training seed changes.
DATA_SEED = 20240601


def load_digits(cfg: DataConfig) -> Splits:
    """scikit-learn's 1,797 handwritten digits, 8x8 grey levels 0-16, split test/val/train."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    test_idx, val_idx, train_idx = seeded_split(
        len(labels), (cfg.test_fraction, cfg.val_fraction), DATA_SEED
    )
    if cfg.train_size is not None:
        train_idx = train_idx[: cfg.train_size]
    mean, std = _channel_stats(images[train_idx] / 16.0)

    def subset(idx: torch.Tensor, crop_padding: int = 0) -> TensorImageDataset:
        return TensorImageDataset(images[idx], labels[idx], mean, std, 1 / 16.0, crop_padding)

    train = subset(train_idx, cfg.augment_crop_padding)
    return Splits(train, subset(val_idx), subset(test_idx), 10, 1, 8)


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

    def make(n: int, crop_padding: int = 0) -> TensorImageDataset:
        labels = torch.randint(0, num_classes, (n,), generator=gen)
        images = 0.5 * templates[labels] + torch.randn(n, channels, size, size, generator=gen)
        return TensorImageDataset(images, labels, crop_padding=crop_padding)

    train = make(n_train, cfg.augment_crop_padding)
    val, test = make(n_val), make(n_test)
    return Splits(train, val, test, num_classes, channels, size)


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    mean = images.mean(dim=(0, 2, 3))
    std = images.std(dim=(0, 2, 3)).clamp_min(1e-6)
    return tuple(mean.tolist()), tuple(std.tolist())

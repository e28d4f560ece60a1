"""Sensor time series: ``basicmotions``, the UEA BasicMotions classification problem.

Four students wore a smart watch while standing, walking, running and playing badminton; each
sample is 10 s of its 3-axis accelerometer and 3-axis gyroscope at 10 Hz: 6 channels x 100
steps, 40 train and 40 test samples, 4 balanced classes. The files ship inside sktime's wheel
(the ``sensors`` extra) and are read from disk, so nothing is downloaded.

The test split is the official TEST file; val is held out of the official TRAIN file
(``data.val_fraction``, seeded with ``DATA_SEED``). Each channel is standardized with the mean
and standard deviation of the training split (over samples and time). Labels are the sorted
class names' indices (``meta["classes"]``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from convoy.config import DataConfig
from convoy.data.base import Splits, hold_out
from convoy.data.sources import DATA_SEED
from convoy.errors import ConfigError, ConvoyError
from convoy.imports import missing_extra

CHANNELS = ("accel_x", "accel_y", "accel_z", "gyro_x", "gyro_y", "gyro_z")


def _read_basicmotions() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train series, train labels, test series, test labels); series (N, 6, 100)."""
    try:
        from sktime.datasets import load_basic_motions  # the sensors extra
    except ImportError:
        raise ConvoyError(missing_extra("data.name 'basicmotions'", "sktime", "sensors")) from None
    x_train, y_train = load_basic_motions(split="TRAIN", return_type="numpy3D")
    x_test, y_test = load_basic_motions(split="TEST", return_type="numpy3D")
    return x_train, np.asarray(y_train), x_test, np.asarray(y_test)


def load_basicmotions(cfg: DataConfig) -> Splits:
    """BasicMotions as (series (6, 100) float32, label) pairs; see the module docstring."""
    x_train, y_train, x_test, y_test = _read_basicmotions()
    classes = sorted({str(y) for y in (*y_train, *y_test)})
    index = {name: i for i, name in enumerate(classes)}
    series = torch.from_numpy(x_train).float()
    labels = torch.tensor([index[str(y)] for y in y_train])
    try:
        val_idx, train_idx = hold_out(len(labels), (cfg.val_fraction,), DATA_SEED)
    except ValueError as exc:
        raise ConfigError("data.val_fraction", cfg.val_fraction, str(exc)) from None
    if cfg.train_size is not None:
        train_idx = train_idx[: cfg.train_size]
    mean, std = channel_stats(series[train_idx])

    def dataset(x: torch.Tensor, y: torch.Tensor) -> TensorDataset:
        return TensorDataset((x - mean) / std, y)

    test_labels = torch.tensor([index[str(y)] for y in y_test])
    meta: dict[str, Any] = {"classes": classes, "channels": list(CHANNELS)}
    return Splits(
        dataset(series[train_idx], labels[train_idx]),
        dataset(series[val_idx], labels[val_idx]),
        dataset(torch.from_numpy(x_test).float(), test_labels),
        {"num_classes": len(classes), "in_channels": series.shape[1], "seq_len": series.shape[2]},
        meta=meta,
    )


def channel_stats(series: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation of (N, C, T) series, shaped (C, 1)."""
    mean = series.mean(dim=(0, 2)).unsqueeze(-1)
    std = series.std(dim=(0, 2), correction=0).unsqueeze(-1)
    return mean, torch.where(std > 0, std, torch.ones_like(std))

"""Tabular regression: ``diabetes``, and ``regression_splits`` for any (features, target) table.

``diabetes`` is scikit-learn's bundled diabetes set: 442 patients, 10 baseline features (age,
sex, body mass index, blood pressure, six blood serum measurements), and a measure of disease
progression one year later as the target.

``regression_splits`` holds out test and val (``data.test_fraction``, ``data.val_fraction``,
seeded with ``DATA_SEED``), then standardizes every feature and the target with the training
split's mean and standard deviation (population std, as scikit-learn's ``StandardScaler``).
``meta`` records ``target_mean`` and ``target_std``: a prediction ``p`` is
``p * target_std + target_mean`` in the original units, and an MSE is ``target_std**2`` times
the original one. R² is unchanged by the standardization, since it rescales the residual and
the total sum of squares alike. A future CSV source would read its columns into arrays and
call ``regression_splits``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from convoy.config import DataConfig
from convoy.data.base import Splits, hold_out
from convoy.data.cache import cached_arrays
from convoy.data.sources import DATA_SEED, bundled_key
from convoy.errors import ConfigError


def load_diabetes(cfg: DataConfig) -> Splits:
    """scikit-learn's diabetes regression set (442 x 10), split test/val/train."""
    arrays = cached_arrays("datasets", bundled_key("load_diabetes"), _decode_diabetes)
    names = [str(name) for name in arrays["feature_names"]]
    return regression_splits(arrays["data"], arrays["target"], cfg, names)


def _decode_diabetes() -> dict[str, np.ndarray]:
    # Imported only on a cache miss: scikit-learn costs a worker about a second of CPU.
    from sklearn.datasets import load_diabetes as sklearn_diabetes

    bunch = sklearn_diabetes(scaled=False)  # raw units: we standardize with train statistics
    return {
        "data": bunch.data,
        "target": bunch.target,
        "feature_names": np.array(bunch.feature_names, dtype=str),
    }


def regression_splits(
    features: np.ndarray, target: np.ndarray, cfg: DataConfig, feature_names: list[str]
) -> Splits:
    """(N, F) features and (N,) targets -> standardized (features (F,), target ()) splits."""
    x = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(target, dtype=torch.float32)
    try:
        test_idx, val_idx, train_idx = hold_out(
            len(y), (cfg.test_fraction, cfg.val_fraction), DATA_SEED
        )
    except ValueError as exc:
        raise ConfigError("data.test_fraction", cfg.test_fraction, str(exc)) from None
    if cfg.train_size is not None:
        train_idx = train_idx[: cfg.train_size]
    x_mean, x_std = mean_std(x[train_idx])
    y_mean, y_std = mean_std(y[train_idx])

    def dataset(idx: torch.Tensor) -> TensorDataset:
        return TensorDataset((x[idx] - x_mean) / x_std, (y[idx] - y_mean) / y_std)

    meta: dict[str, Any] = {
        "target_mean": float(y_mean),
        "target_std": float(y_std),
        "feature_names": feature_names,
    }
    shape = {"num_features": x.shape[1], "num_outputs": 1}
    return Splits(dataset(train_idx), dataset(val_idx), dataset(test_idx), shape, meta=meta)


def mean_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std over the first dimension; a constant column gets std 1."""
    mean, std = values.mean(dim=0), values.std(dim=0, correction=0)
    return mean, torch.where(std > 0, std, torch.ones_like(std))

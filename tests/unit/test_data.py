"""Data sources: split determinism and sizes, learnable synthetic data, files read from disk."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from convoy.config import DataConfig
from convoy.data.base import TensorImageDataset
from convoy.data.registry import load_splits
from convoy.errors import ConfigError, DataError

N_DIGITS = 1797
PER_BATCH = 20  # conftest.write_cifar_batches


def stack(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(dataset[i] for i in range(len(dataset))), strict=True)  # type: ignore[arg-type]
    return torch.stack(images), torch.stack(labels)


def rows(dataset: TensorImageDataset) -> Counter[tuple[bytes, int]]:
    """The multiset of (raw image, label) pairs of an in-memory split."""
    return Counter(
        (img.numpy().tobytes(), int(y))
        for img, y in zip(dataset.images, dataset.labels, strict=True)
    )


# --- digits -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("test_fraction", "val_fraction"), [(0.2, 0.1), (0.3, 0.15)])
def test_digits_splits_partition_every_sample(test_fraction: float, val_fraction: float) -> None:
    from sklearn.datasets import load_digits

    cfg = DataConfig(name="digits", test_fraction=test_fraction, val_fraction=val_fraction)
    splits = load_splits(cfg)
    n_test, n_val = round(N_DIGITS * test_fraction), round(N_DIGITS * val_fraction)
    assert (len(splits.test), len(splits.val)) == (n_test, n_val)
    assert len(splits.train) == N_DIGITS - n_test - n_val
    # train + val + test is the whole dataset, each sample exactly once.
    bunch = load_digits()
    everything = Counter(
        (img.astype(np.float32).tobytes(), int(y))
        for img, y in zip(bunch.images[:, None], bunch.target, strict=True)
    )
    assert rows(splits.train) + rows(splits.val) + rows(splits.test) == everything
    assert splits.shape == {"num_classes": 10, "in_channels": 1, "image_size": 8}


def test_digits_splits_are_deterministic() -> None:
    first, second = load_splits(DataConfig(name="digits")), load_splits(DataConfig(name="digits"))
    for split in ("train", "val", "test"):
        a, b = getattr(first, split), getattr(second, split)
        assert torch.equal(a.images, b.images)
        assert torch.equal(a.labels, b.labels)


def test_digits_train_size_caps_train_only() -> None:
    full = load_splits(DataConfig(name="digits"))
    capped = load_splits(DataConfig(name="digits", train_size=100))
    assert len(capped.train) == 100
    assert (len(capped.val), len(capped.test)) == (len(full.val), len(full.test))
    assert torch.equal(capped.train.images, full.train.images[:100])


# --- synthetic --------------------------------------------------------------------------------


def test_synthetic_has_a_learnable_signal() -> None:
    splits = load_splits(DataConfig(name="synthetic", train_size=1000, image_size=8))
    x_train, y_train = stack(splits.train)
    x_test, y_test = stack(splits.test)
    assert x_train.shape == (1000, 3, 8, 8)
    assert len(splits.test) == 200
    means = torch.stack([x_train[y_train == c].mean(0) for c in range(10)]).flatten(1)
    predicted = torch.cdist(x_test.flatten(1), means).argmin(1)
    assert (predicted == y_test).float().mean() > 0.8  # chance is 0.1


# --- cifar10 ----------------------------------------------------------------------------------


def cifar_cfg(path: Path | None, **kwargs: Any) -> DataConfig:
    return DataConfig(name="cifar10", path=None if path is None else str(path), **kwargs)


def test_cifar10_from_directory(cifar_dir: Path) -> None:
    for path in (cifar_dir, cifar_dir.parent):  # the batches or the folder above them
        splits = load_splits(cifar_cfg(path))
        assert len(splits.train) + len(splits.val) == 5 * PER_BATCH
        assert len(splits.val) == round(5 * PER_BATCH * 0.1)
        assert len(splits.test) == PER_BATCH
        image, label = splits.train[0]
        assert image.shape == (3, 32, 32)
        assert image.dtype == torch.float32
        assert 0 <= int(label) <= 9
    raw = pickle.loads((cifar_dir / "test_batch").read_bytes())
    assert torch.equal(splits.test.images, torch.from_numpy(raw[b"data"]).view(-1, 3, 32, 32))
    assert splits.test.labels.tolist() == raw[b"labels"]


def test_cifar10_tarball_matches_directory(cifar_dir: Path, cifar_tarball: Path) -> None:
    from_dir = load_splits(cifar_cfg(cifar_dir))
    from_tar = load_splits(cifar_cfg(cifar_tarball, train_size=50))
    assert (len(from_tar.train), len(from_tar.val), len(from_tar.test)) == (50, 10, PER_BATCH)
    assert torch.equal(from_tar.train.images, from_dir.train.images[:50])
    assert torch.equal(from_tar.test.images, from_dir.test.images)


@pytest.mark.parametrize("path", [None, "does/not/exist"])
def test_cifar10_missing_path_is_a_config_error(tmp_path: Path, path: str | None) -> None:
    with pytest.raises(ConfigError) as err:
        load_splits(cifar_cfg(None if path is None else tmp_path / path))
    assert err.value.field == "data.path"


@pytest.mark.parametrize(
    "payload",
    [
        os.urandom(512),
        pickle.dumps({b"labels": [1, 2]}),
        pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 12]}),
    ],
    ids=["random-bytes", "no-data-key", "label-out-of-range"],
)
def test_cifar10_malformed_batch_names_the_file(cifar_dir: Path, payload: bytes) -> None:
    (cifar_dir / "data_batch_3").write_bytes(payload)
    with pytest.raises(DataError, match="data_batch_3"):
        load_splits(cifar_cfg(cifar_dir))


def test_cifar10_missing_batch_is_named(cifar_dir: Path) -> None:
    (cifar_dir / "test_batch").unlink()
    with pytest.raises(DataError, match="test_batch"):
        load_splits(cifar_cfg(cifar_dir))


def test_cifar10_refuses_a_pickle_that_runs_code(cifar_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return os.system, (f"touch {marker}",)

    payload = pickle.dumps({b"data": Exploit(), b"labels": []})
    (cifar_dir / "data_batch_1").write_bytes(payload)
    with pytest.raises(DataError, match="data_batch_1"):
        load_splits(cifar_cfg(cifar_dir))
    assert not marker.exists()
    pickle.loads(payload)  # control: a plain unpickler would have run it
    assert marker.exists()


# --- imagefolder ------------------------------------------------------------------------------


def folder_cfg(root: Path, **kwargs: Any) -> DataConfig:
    return DataConfig(name="imagefolder", path=str(root), **kwargs)


def test_imagefolder_loads_sorted_classes_and_resizes(imagefolder: Path) -> None:
    splits = load_splits(folder_cfg(imagefolder, image_size=16))
    assert (len(splits.train), len(splits.val), len(splits.test)) == (12, 6, 6)
    assert splits.shape == {"num_classes": 2, "in_channels": 3, "image_size": 16}
    images, labels = stack(splits.train)
    assert images.shape == (12, 3, 16, 16)
    assert labels.tolist() == [0] * 6 + [1] * 6
    # class 0 is "dark" (sorted before "light"): darker pixels than class 1
    assert images[labels == 0].mean() < -0.5 < 0.5 < images[labels == 1].mean()
    assert splits.test.records == splits.val.records  # no test/: test metrics come from val/


def test_imagefolder_default_size_and_test_folder(imagefolder: Path) -> None:
    shutil.copytree(imagefolder / "val" / "dark", imagefolder / "test" / "dark")
    splits = load_splits(folder_cfg(imagefolder))
    assert splits.train[0][0].shape == (3, 32, 32)
    assert (len(splits.val), len(splits.test)) == (6, 3)
    assert {r.label for r in splits.test.records} == {0}


def test_imagefolder_corrupt_image_names_the_file(imagefolder: Path) -> None:
    bad = imagefolder / "train" / "light" / "zz_corrupt.png"
    bad.write_bytes(b"these bytes are not an image")
    splits = load_splits(folder_cfg(imagefolder))  # listing is lazy: no error yet
    index = [r.path for r in splits.train.records].index(bad)
    splits.train[0]
    with pytest.raises(DataError, match=r"zz_corrupt\.png"):
        splits.train[index]


def test_imagefolder_train_size_caps_with_every_class(imagefolder: Path) -> None:
    splits = load_splits(folder_cfg(imagefolder, train_size=6))
    assert len(splits.train) == 6
    assert len(splits.val) == 6
    assert {r.label for r in splits.train.records} == {0, 1}


def test_numpy_source_reads_npz_and_holds_out_val(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", images=rng.integers(0, 256, (50, 6, 6), dtype=np.uint8),
             labels=np.arange(50) % 5)  # fmt: skip
    np.savez(tmp_path / "test.npz", images=rng.integers(0, 256, (7, 6, 6), dtype=np.uint8),
             labels=np.arange(7) % 5)  # fmt: skip
    splits = load_splits(DataConfig(name="numpy", path=str(tmp_path), val_fraction=0.2))
    assert (len(splits.train), len(splits.val), len(splits.test)) == (40, 10, 7)
    assert splits.shape == {"num_classes": 5, "in_channels": 1, "image_size": 6}
    image, label = splits.test[3]
    assert image.shape == (1, 6, 6) and int(label) == 3


def test_numpy_source_needs_train_npz(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.path: .* no train.npz"):
        load_splits(DataConfig(name="numpy", path=str(tmp_path)))


def test_parquet_label_outside_the_class_map_names_the_record(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "train").mkdir()
    (tmp_path / "classes.json").write_text(json.dumps({"classes": ["a", "b"]}))
    table = pa.table({"index": [0, 1], "image": [b"x", b"y"], "label": [1, 5], "name": ["p", "q"]})
    pq.write_table(table, tmp_path / "train" / "part-00000.parquet")
    with pytest.raises(
        DataError, match=r"part-00000.parquet#1 has label 5; labels must be in 0..1"
    ):
        load_splits(DataConfig(name="parquet", path=str(tmp_path)))

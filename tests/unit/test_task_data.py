"""Data for the non-image tasks: diabetes (regression), basicmotions (sensor series) and the
user's own data by import path."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Subset

from convoy.config import DataConfig
from convoy.data.base import hold_out
from convoy.data.registry import DATASETS, check_dataset, load_splits
from convoy.errors import ConfigError


def stack(dataset: Any) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(inputs), torch.stack(targets)


# --- diabetes ---------------------------------------------------------------------------------


def test_diabetes_shapes_and_train_standardization() -> None:
    splits = load_splits(DataConfig(name="diabetes", test_fraction=0.2, val_fraction=0.1))
    assert splits.shape == {"num_features": 10, "num_outputs": 1}
    assert (len(splits.test), len(splits.val), len(splits.train)) == (88, 44, 310)
    x, y = splits.train[0]
    assert x.shape == (10,) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.float32
    x_train, y_train = stack(splits.train)
    torch.testing.assert_close(x_train.mean(0), torch.zeros(10), atol=1e-5, rtol=0)
    torch.testing.assert_close(x_train.std(0, correction=0), torch.ones(10), atol=1e-5, rtol=0)
    assert abs(float(y_train.mean())) < 1e-5 and abs(float(y_train.std(correction=0)) - 1) < 1e-5
    # The original targets come back through meta, over every split.
    from sklearn.datasets import load_diabetes

    meta = splits.meta
    original = torch.cat([stack(s)[1] for s in (splits.train, splits.val, splits.test)])
    original = original * meta["target_std"] + meta["target_mean"]
    expected = torch.tensor(load_diabetes().target, dtype=torch.float32)
    torch.testing.assert_close(original.sort().values, expected.sort().values)
    assert meta["feature_names"][:3] == ["age", "sex", "bmi"]


def test_diabetes_splits_are_deterministic() -> None:
    first, second = (
        load_splits(DataConfig(name="diabetes")),
        load_splits(DataConfig(name="diabetes")),
    )
    for split in ("train", "val", "test"):
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                stack(getattr(first, split)), stack(getattr(second, split)), strict=True
            )
        )


# --- basicmotions -----------------------------------------------------------------------------

needs_sktime = pytest.mark.skipif(
    importlib.util.find_spec("sktime") is None,
    reason="basicmotions needs the sensors extra: pip install 'convoy[sensors]'",
)


@needs_sktime
def test_basicmotions_shapes_labels_and_normalization() -> None:
    splits = load_splits(DataConfig(name="basicmotions", val_fraction=0.1))
    assert splits.shape == {"num_classes": 4, "in_channels": 6, "seq_len": 100}
    assert splits.meta["classes"] == ["badminton", "running", "standing", "walking"]
    assert (len(splits.train), len(splits.val), len(splits.test)) == (36, 4, 40)
    x, y = splits.test[0]
    assert x.shape == (6, 100) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.long
    x_train, y_train = stack(splits.train)
    _, y_val = stack(splits.val)
    _, y_test = stack(splits.test)
    assert torch.bincount(y_test).tolist() == [10, 10, 10, 10]  # the official TEST file
    assert torch.bincount(torch.cat([y_train, y_val]), minlength=4).tolist() == [10] * 4
    torch.testing.assert_close(x_train.mean((0, 2)), torch.zeros(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(x_train.std((0, 2), correction=0), torch.ones(6), atol=1e-5, rtol=0)


@needs_sktime
def test_basicmotions_keeps_a_val_sample_at_a_tiny_fraction() -> None:
    splits = load_splits(DataConfig(name="basicmotions", val_fraction=0.001))
    assert (len(splits.train), len(splits.val)) == (39, 1)


def test_registered_names_include_the_task_sources() -> None:
    assert {"text", "diabetes", "basicmotions"} <= set(DATASETS)


def test_kwargs_are_for_user_factories_only() -> None:
    with pytest.raises(ConfigError) as err:
        check_dataset(DataConfig(name="diabetes", kwargs={"n": 1}))
    assert err.value.field == "data.kwargs"


# --- hold_out ---------------------------------------------------------------------------------


def test_hold_out_keeps_one_sample_per_split_and_matches_seeded_split() -> None:
    from convoy.data.base import seeded_split

    test, val, rest = hold_out(10, (0.01, 0.01), seed=3)
    assert (len(test), len(val), len(rest)) == (1, 1, 8)
    assert sorted(torch.cat([test, val, rest]).tolist()) == list(range(10))
    for a, b in zip(hold_out(100, (0.2, 0.1), 3), seeded_split(100, (0.2, 0.1), 3), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="2 sample"):
        hold_out(2, (0.1, 0.1), seed=3)


# --- user data by import path -----------------------------------------------------------------

FACTORIES = """
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset
from convoy.data.base import Splits


def pairs(n, offset=0.0):
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1) + offset
    return TensorDataset(x, x.squeeze(1) * 2)


def only_train(n=50, scale=1):
    return {"train": pairs(n), "shape": {"num_features": 1, "num_outputs": scale}, "meta": {"k": 1}}


def with_val(n=50):
    return {"train": pairs(n), "val": pairs(7, 1000.0)}


def all_three():
    return {"train": pairs(20), "val": pairs(5, 100.0), "test": pairs(4, 200.0)}


def as_splits():
    return Splits(pairs(10), pairs(3), pairs(2), {"num_features": 1}, meta={"x": 2})


def raises(n=1):
    raise RuntimeError(f"no data for n={n}\\nsecond line")


def a_list():
    return [pairs(3)]


class Stream(IterableDataset):
    def __iter__(self):
        yield from ()


def iterable():
    return {"train": Stream()}


class NoLen:
    def __getitem__(self, i):
        return i


def no_len():
    return {"train": NoLen()}


def empty_val():
    return {"train": pairs(10), "val": pairs(0)}


def typo():
    return {"train": pairs(10), "valid": pairs(3)}


def bad_shape():
    return {"train": pairs(10), "shape": {"num_features": 1.5}}


def tiny():
    return {"train": pairs(2)}


NOT_CALLABLE = 42
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"user_data_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORIES))
    (tmp_path / "broken_data_module.py").write_text("import not_a_real_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def user_cfg(name: str, **kwargs: Any) -> DataConfig:
    return DataConfig(name=name, **kwargs)


def targets_of(dataset: Any) -> list[float]:
    return [float(dataset[i][1]) for i in range(len(dataset))]


def test_user_factory_with_only_train_holds_out_test_then_val(user_module: str) -> None:
    cfg = user_cfg(f"{user_module}:only_train", kwargs={"n": 100, "scale": 3})
    check_dataset(cfg)
    splits = load_splits(cfg)
    assert (len(splits.test), len(splits.val), len(splits.train)) == (20, 10, 70)
    assert all(isinstance(s, Subset) for s in (splits.train, splits.val, splits.test))
    seen = targets_of(splits.train) + targets_of(splits.val) + targets_of(splits.test)
    assert sorted(seen) == [2.0 * i for i in range(100)]  # distinct, and all of train
    assert splits.shape == {"num_features": 1, "num_outputs": 3}
    assert splits.meta == {"k": 1}
    again = load_splits(cfg)
    assert targets_of(again.val) == targets_of(splits.val)  # seeded


def test_user_factory_given_val_holds_out_test_only(user_module: str) -> None:
    splits = load_splits(user_cfg(f"{user_module}:with_val", test_fraction=0.1))
    assert (len(splits.train), len(splits.val), len(splits.test)) == (45, 7, 5)
    assert targets_of(splits.val)[0] == 2000.0
    assert splits.shape == {} and splits.meta == {}


def test_user_factory_with_all_splits_and_splits_object(user_module: str) -> None:
    splits = load_splits(user_cfg(f"{user_module}:all_three"))
    assert (len(splits.train), len(splits.val), len(splits.test)) == (20, 5, 4)
    direct = load_splits(user_cfg(f"{user_module}:as_splits", train_size=4))
    assert (len(direct.train), len(direct.val), len(direct.test)) == (4, 3, 2)
    assert direct.shape == {"num_features": 1} and direct.meta == {"x": 2}


@pytest.mark.parametrize(
    ("attr", "kwargs", "field", "match"),
    [
        ("not_a_module_xyz.data:fn", {}, "data.name", "No module named 'not_a_module_xyz'"),
        ("broken_data_module:fn", {}, "data.name", "not_a_real_package_xyz"),
        (":missing", {}, "data.name", "has no attribute 'missing'"),
        (":NOT_CALLABLE", {}, "data.name", "int, not a callable"),
        (":only_train", {"m": 1}, "data.kwargs", "unexpected keyword argument 'm'"),
        (":raises", {"n": 3}, "data.name", "RuntimeError: no data for n=3 second line"),
        (":a_list", {}, "data.name", "returned a list"),
        (":iterable", {}, "data.name", "Stream, not a map-style dataset"),
        (":no_len", {}, "data.name", "NoLen, not a map-style dataset"),
        (":empty_val", {}, "data.name", "the val split is empty"),
        (":typo", {}, "data.name", "unknown key.*'valid'"),
        (":bad_shape", {}, "data.name", "'shape' values must be ints"),
        (":tiny", {}, "data.name", "cannot hold out"),
    ],
)
def test_user_factory_errors_are_one_line(
    user_module: str, attr: str, kwargs: dict[str, Any], field: str, match: str
) -> None:
    name = attr if not attr.startswith(":") else user_module + attr
    with pytest.raises(ConfigError, match=match) as err:
        load_splits(user_cfg(name, kwargs=kwargs))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_check_dataset_imports_but_does_not_call(user_module: str) -> None:
    check_dataset(user_cfg(f"{user_module}:raises"))  # importable: the call fails later
    with pytest.raises(ConfigError, match="No module named"):
        check_dataset(user_cfg("not_a_module_xyz:fn"))
    with pytest.raises(ConfigError, match=r"package\.module:function") as err:
        check_dataset(user_cfg("nocolon"))
    assert "'diabetes'" in str(err.value)

"""The user's own data, by import path: ``data.name: package.module:function``.

``function(**data.kwargs)`` returns either a ``convoy.data.base.Splits`` or a mapping::

    {"train": Dataset, "val": Dataset, "test": Dataset,   # val and test optional
     "shape": {"num_classes": 10, ...},                   # optional: data-shaped model args
     "meta": {...}}                                       # optional: facts for the task

Datasets are map-style (``__len__`` and ``__getitem__``), each item an ``(inputs, targets)``
pair. A missing val split is held out of train (``data.val_fraction``, seeded with
``DATA_SEED``, as a ``torch.utils.data.Subset``); a missing test split likewise
(``data.test_fraction``), distinct from val. The driver's check only imports the function and
binds the kwargs to its signature; the function runs when the splits are loaded. Every
failure is one ``ConfigError`` line naming ``data.name`` (or ``data.kwargs``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torch.utils.data import IterableDataset, Subset

from convoy.config import DataConfig
from convoy.data.base import SizedDataset, Splits, hold_out
from convoy.data.sources import DATA_SEED
from convoy.errors import ConfigError
from convoy.imports import describe, import_attribute

FACTORY_FORM = "a user data factory is 'package.module:function'"
SPLIT_KEYS = ("train", "val", "test")
MAPPING_KEYS = (*SPLIT_KEYS, "shape", "meta")


def is_user_data(name: str) -> bool:
    """Whether ``data.name`` is an import path rather than a registered dataset."""
    return ":" in name


def resolve_data_factory(name: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (no call), or a ``ConfigError`` on data.name."""
    factory = import_attribute("data.name", name, FACTORY_FORM)
    if not callable(factory):
        raise ConfigError(
            "data.name",
            name,
            f"{name.partition(':')[2]} is a {type(factory).__name__}, not a callable; "
            f"{FACTORY_FORM}",
        )
    return factory


def check_data_factory(cfg: DataConfig) -> Callable[..., Any]:
    """Import the factory and check that ``data.kwargs`` fit its signature; does not call it."""
    factory = resolve_data_factory(cfg.name)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have none: let the call decide
        return factory
    try:
        signature.bind(**cfg.kwargs)
    except TypeError as exc:
        raise ConfigError(
            "data.kwargs", cfg.kwargs, f"{cfg.name}{signature} does not take them: {exc}"
        ) from None
    return factory


def load_user_data(cfg: DataConfig) -> Splits:
    """Call the factory and turn what it returns into ``Splits``."""
    factory = check_data_factory(cfg)
    try:
        result = factory(**cfg.kwargs)
    except Exception as exc:
        raise ConfigError("data.name", cfg.name, f"the factory raised {describe(exc)}") from None
    if isinstance(result, Splits):
        for split in SPLIT_KEYS:
            _check_dataset(cfg.name, split, getattr(result, split))
        return _cap_train(result, cfg.train_size)
    if not isinstance(result, Mapping):
        raise ConfigError(
            "data.name",
            cfg.name,
            f"the factory returned a {type(result).__name__}; it must return a "
            "convoy.data.base.Splits or a mapping with 'train' (and optional 'val', 'test', "
            "'shape', 'meta')",
        )
    return _cap_train(_splits_from_mapping(cfg, result), cfg.train_size)


def _splits_from_mapping(cfg: DataConfig, result: Mapping[Any, Any]) -> Splits:
    unknown = [key for key in result if key not in MAPPING_KEYS]
    if unknown:
        raise ConfigError(
            "data.name",
            cfg.name,
            f"the factory's mapping has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(map(repr, MAPPING_KEYS))}",
        )
    if result.get("train") is None:
        raise ConfigError("data.name", cfg.name, "the factory's mapping needs a 'train' dataset")
    given = {
        split: _check_dataset(cfg.name, split, result[split])
        for split in SPLIT_KEYS
        if result.get(split) is not None
    }
    train = given["train"]
    missing = tuple(split for split in ("test", "val") if split not in given)
    fractions = {"test": cfg.test_fraction, "val": cfg.val_fraction}
    if missing:
        try:
            *held, rest = hold_out(len(train), tuple(fractions[s] for s in missing), DATA_SEED)
        except ValueError as exc:
            raise ConfigError("data.name", cfg.name, f"cannot hold out {missing}: {exc}") from None
        for split, indices in zip(missing, held, strict=True):
            given[split] = Subset(train, indices.tolist())  # type: ignore[arg-type]
        given["train"] = Subset(train, rest.tolist())  # type: ignore[arg-type]
    shape = _check_mapping(cfg.name, "shape", result.get("shape"))
    if any(not isinstance(v, int) or isinstance(v, bool) for v in shape.values()):
        raise ConfigError("data.name", cfg.name, "the factory's 'shape' values must be ints")
    meta = _check_mapping(cfg.name, "meta", result.get("meta"))
    return Splits(given["train"], given["val"], given["test"], dict(shape), meta=dict(meta))


def _check_dataset(name: str, split: str, dataset: Any) -> SizedDataset:
    """A map-style, non-empty dataset, or a ``ConfigError`` saying which split is not."""
    kind = type(dataset).__name__
    if (
        isinstance(dataset, IterableDataset)
        or not hasattr(dataset, "__len__")
        or not hasattr(dataset, "__getitem__")
    ):
        raise ConfigError(
            "data.name",
            name,
            f"the {split} split is a {kind}, not a map-style dataset "
            "(it needs __len__ and __getitem__, as torch.utils.data.Dataset subclasses have)",
        )
    try:
        size = len(dataset)
    except Exception as exc:
        raise ConfigError(
            "data.name", name, f"len() of the {split} split raised {describe(exc)}"
        ) from None
    if size == 0:
        raise ConfigError("data.name", name, f"the {split} split is empty")
    return dataset


def _check_mapping(name: str, key: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or any(not isinstance(k, str) for k in value):
        raise ConfigError(
            "data.name", name, f"the factory's {key!r} must be a dict with string keys"
        )
    return value


def _cap_train(splits: Splits, train_size: int | None) -> Splits:
    """``data.train_size``: the first that many training samples."""
    if train_size is None or train_size >= len(splits.train):
        return splits
    train: Subset[Any] = Subset(splits.train, range(train_size))  # type: ignore[arg-type]
    return replace(splits, train=train)

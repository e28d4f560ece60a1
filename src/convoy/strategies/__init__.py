"""Strategies: ``strategy.name`` -> the class that decides how model state is split.

The registry follows the one list of strategies, the config models in
``convoy.config.StrategyConfig``: strategy ``x`` is the ``Strategy`` subclass named ``x`` in
``convoy/strategies/x.py``. Adding a strategy is that file (its class carries every fact the
rest of Convoy asks about it), its config model, and their tests. The strategy modules are
imported on the first call, not with this package: FSDP's imports take most of a second, and
``import convoy`` stays light.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from convoy.config import STRATEGY_NAMES
from convoy.errors import ConfigError, one_of
from convoy.strategies.base import Strategy


def strategy_classes() -> dict[str, type[Strategy]]:
    """Every strategy class by name, in the config's order."""
    return dict(_registry())


def strategy_class(name: str, field: str = "strategy.name") -> type[Strategy]:
    """The class of strategy ``name``; a ``ConfigError`` naming ``field`` and the valid names
    for an unknown one."""
    classes = _registry()
    if name not in classes:
        raise ConfigError(field, name, one_of(classes))
    return classes[name]


def build_strategy(
    cfg: Any, device: torch.device, compute_dtype: torch.dtype, local_world_size: int = 1
) -> Strategy:
    """Instantiate the strategy named by ``cfg.name`` (``local_world_size``: workers on this
    rank's node)."""
    return strategy_class(cfg.name)(cfg, device, compute_dtype, local_world_size)


@functools.cache
def _registry() -> dict[str, type[Strategy]]:
    return {name: _class_in_module(name) for name in STRATEGY_NAMES}


def _class_in_module(name: str) -> type[Strategy]:
    module = importlib.import_module(f"{__name__}.{name}")
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, Strategy) and value.name == name:
            return value
    raise ImportError(f"{module.__name__} defines no Strategy subclass with name = {name!r}")


__all__ = ["Strategy", "build_strategy", "strategy_class", "strategy_classes"]

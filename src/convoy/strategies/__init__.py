"""Strategies: ``strategy.name`` -> the class that decides how model state is split."""

from __future__ import annotations

from typing import Any

import torch

from convoy.errors import ConfigError, one_of
from convoy.strategies.base import Strategy


def strategy_classes() -> dict[str, type[Strategy]]:
    """The registry; imported lazily so ``import convoy`` stays light."""
    from convoy.strategies.ddp import DDPStrategy
    from convoy.strategies.fsdp import FSDPStrategy
    from convoy.strategies.fsdp2 import FSDP2Strategy
    from convoy.strategies.single import SingleStrategy

    return {cls.name: cls for cls in (SingleStrategy, DDPStrategy, FSDPStrategy, FSDP2Strategy)}


def build_strategy(cfg: Any, device: torch.device, compute_dtype: torch.dtype) -> Strategy:
    """Instantiate the strategy named by ``cfg.name``."""
    classes = strategy_classes()
    if cfg.name not in classes:
        raise ConfigError("strategy.name", cfg.name, one_of(classes))
    return classes[cfg.name](cfg, device, compute_dtype)


__all__ = ["Strategy", "build_strategy", "strategy_classes"]

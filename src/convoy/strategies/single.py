"""``single``: the model on one device, no process group. The numerical reference."""

from __future__ import annotations

from convoy.config import SingleStrategyConfig
from convoy.strategies.base import LightningCounterpart, Strategy


class SingleStrategy(Strategy):
    name = "single"
    config_model = SingleStrategyConfig
    lightning = LightningCounterpart("SingleDeviceStrategy")
    plan_preference = 0

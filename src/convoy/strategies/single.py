"""``single``: the model on one device, no process group. The numerical reference."""

from __future__ import annotations

from convoy.strategies.base import Strategy


class SingleStrategy(Strategy):
    name = "single"

"""The language-modeling task's byte count: the metric that turns nats per token into bits per
byte. In a module of its own so the task imports torchmetrics only when it builds metrics."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class TargetBytes(Metric):
    """UTF-8 bytes covered by the real target tokens, summed over every rank."""

    full_state_update = False
    total: torch.Tensor
    token_bytes: torch.Tensor

    def __init__(self, token_bytes: list[int], ignore_index: int) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.register_buffer("token_bytes", torch.tensor(token_bytes, dtype=torch.long))
        self.add_state("total", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor | None, targets: torch.Tensor) -> None:
        # A mask, not ``targets[mask]``: boolean indexing waits for the device (its size).
        real = targets != self.ignore_index
        self.total += (self.token_bytes[torch.where(real, targets, 0)] * real).sum()

    def compute(self) -> torch.Tensor:
        return self.total

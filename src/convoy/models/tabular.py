"""A multilayer perceptron for tabular rows: (B, num_features) -> (B, num_outputs).

Each hidden layer is one ``TabularBlock`` (Linear -> GELU -> Dropout) in ``blocks``; the head is
a plain linear layer, so the outputs are unbounded: regression targets, or logits for a
classification task. Features are expected standardised (as the tabular data sources do).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn


class TabularBlock(nn.Module):
    def __init__(self, width_in: int, width_out: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.linear(x)))


class TabularMLP(nn.Module):
    """Rows (B, num_features) -> outputs (B, num_outputs), e.g. sklearn's diabetes (10 -> 1)."""

    init_unit = "module"
    """``init_module`` sets a module's own parameters only (``convoy.models.init``)."""

    def __init__(
        self,
        num_features: int = 10,
        num_outputs: int = 1,
        hidden: int = 64,
        depth: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        widths = [num_features] + [hidden] * depth
        self.blocks = nn.ModuleList(
            TabularBlock(a, b, dropout) for a, b in itertools.pairwise(widths)
        )
        self.head = nn.Linear(widths[-1], num_outputs)

    def init_module(self, module: nn.Module) -> None:
        """Torch's defaults (each layer's ``reset_parameters``, which Convoy calls first) are
        every weight's init: nothing to add. Defining it lets Convoy build the model on the
        meta device (``convoy.models.init``)."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows
        for block in self.blocks:
            x = block(x)
        return self.head(x)

"""A multilayer perceptron over flattened images; each hidden layer is one ``MLPBlock``."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class MLP(nn.Module):
    init_unit = "module"
    """``init_module`` sets a module's own parameters only (``convoy.models.init``)."""

    def __init__(
        self,
        image_size: int = 8,
        in_channels: int = 1,
        num_classes: int = 10,
        hidden: int = 128,
        depth: int = 2,
    ) -> None:
        super().__init__()
        widths = [in_channels * image_size * image_size] + [hidden] * depth
        self.blocks = nn.ModuleList(MLPBlock(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(widths[-1], num_classes)

    def init_module(self, module: nn.Module) -> None:
        """Torch's defaults (each layer's ``reset_parameters``, which Convoy calls first) are
        every weight's init: nothing to add. Defining it lets Convoy build the model on the
        meta device (``convoy.models.init``)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

"""A convolutional classifier for multichannel time series (sensor data).

The fully convolutional network (FCN) of Wang, Yan and Oates, "Time Series Classification from
Scratch with Deep Neural Networks" (2017): a stack of same-length 1-D convolutions, each
followed by a normalisation and a nonlinearity, then global average pooling over time and a
linear classifier. It has no recurrence and no attention, so it trains in seconds on small sets
such as UEA BasicMotions, and the pooling makes it indifferent to the series' length.

One change from the paper: GroupNorm instead of BatchNorm. BatchNorm's statistics come from the
batch each rank sees, so a model trained with DDP on N ranks is not the model trained on one
(and its running averages differ per rank). GroupNorm normalises each sample on its own, which
makes training identical at any world size. ``blocks`` is an ``nn.ModuleList`` of
``ConvBlock``.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

MAX_GROUPS = 8


class ConvBlock(nn.Module):
    """Conv1d (same length) -> GroupNorm -> GELU."""

    def __init__(self, channels_in: int, channels_out: int, kernel_size: int) -> None:
        super().__init__()
        # No conv bias: the normalisation right after it would subtract it again.
        self.conv = nn.Conv1d(channels_in, channels_out, kernel_size, padding="same", bias=False)
        self.norm = nn.GroupNorm(math.gcd(channels_out, MAX_GROUPS), channels_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class Conv1dNet(nn.Module):
    """Series (B, in_channels, seq_len) -> class logits (B, num_classes)."""

    init_unit = "module"
    """``init_module`` sets a module's own parameters only (``convoy.models.init``)."""

    def __init__(
        self,
        in_channels: int = 6,
        num_classes: int = 4,
        hidden: int = 64,
        depth: int = 3,
        kernel_size: int = 7,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        widths = [in_channels] + [hidden] * depth
        self.blocks = nn.ModuleList(
            ConvBlock(a, b, kernel_size) for a, b in itertools.pairwise(widths)
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, num_classes)

    def init_module(self, module: nn.Module) -> None:
        """Torch's defaults (each layer's ``reset_parameters``, which Convoy calls first) are
        every weight's init: nothing to add. Defining it lets Convoy build the model on the
        meta device (``convoy.models.init``)."""

    def forward(self, series: torch.Tensor) -> torch.Tensor:
        x = series
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x.mean(dim=-1)))  # global average pooling over time

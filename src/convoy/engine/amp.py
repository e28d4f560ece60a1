"""Automatic mixed precision: autocast for strategies that do not cast parameters themselves,
and a grad scaler for fp16 (sharded when the strategy shards)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from convoy.strategies.base import Strategy


class Precision:
    def __init__(self, dtype: torch.dtype, device: torch.device, strategy: Strategy) -> None:
        self.dtype = dtype
        self.device = device
        # FSDP/FSDP2 with a low-precision param_dtype already compute in that dtype.
        self.use_autocast = dtype != torch.float32 and not strategy.handles_precision
        self.scaler = strategy.grad_scaler(enabled=dtype == torch.float16)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if not self.use_autocast:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

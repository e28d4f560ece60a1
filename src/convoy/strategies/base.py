"""The ``Strategy`` interface: how model state is split across ranks.

A strategy wraps a model (model in, model out), says whether gradient sync can be skipped for
accumulation, clips gradients correctly for its parameter layout, and makes the grad scaler
that matches it. It is built from its own config section plus the device and the compute
dtype, and never reads another section.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from convoy.distributed import is_distributed


class Strategy:
    """Base class: the identity strategy on one device. Subclasses override what differs."""

    name: ClassVar[str] = "base"
    requires_process_group: ClassVar[bool] = False

    def __init__(self, cfg: Any, device: torch.device, compute_dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.compute_dtype = compute_dtype

    @property
    def handles_precision(self) -> bool:
        """True when the strategy casts parameters itself, so the engine must not autocast."""
        return False

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronization (for all but the last accumulation micro-step)."""
        yield

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def grad_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper (for names, blocks, export)."""
        return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (``model.blocks``), the unit that sharding wraps.

    A model without them is sharded as one unit, which works but gathers every parameter at
    once and overlaps no communication: say so rather than leave it silent.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    if is_distributed() and dist.get_rank() != 0:
        return []  # said once, by rank 0
    warnings.warn(
        f"{type(model).__name__} has no `blocks` (an nn.ModuleList of its repeated layers): "
        "it is sharded as a single unit; expose its layers as `self.blocks` to shard per block",
        stacklevel=2,
    )
    return []


def dtype_from_name(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]

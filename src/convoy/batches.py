"""Helpers for batches that are a tensor or a dict / tuple / list of tensors."""

from __future__ import annotations

from typing import Any

import torch


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (non-blocking from pinned memory)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def first_rows(batch: Any, rows: int) -> Any:
    """The first ``rows`` samples of every tensor in ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch[:rows]
    if isinstance(batch, dict):
        return {k: first_rows(v, rows) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(first_rows(v, rows) for v in batch)
    return batch


def batch_rows(batch: Any) -> int:
    """The number of samples in ``batch`` (the length of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return batch_rows(next(iter(batch.values())))
    return batch_rows(batch[0])


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or dicts, lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []

"""Evaluation over a padded shard: the forward runs on every batch (sharded models need the
same collectives on every rank) but only the rank's genuine samples reach the metrics."""

from __future__ import annotations

import torch
from torch import nn

from convoy.batches import batch_rows, first_rows, move_to
from convoy.data.loaders import EvalBatches
from convoy.engine.amp import Precision
from convoy.metrics import MetricsManager
from convoy.tasks import Task


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Task,
    loader: EvalBatches,
    split: str,
    metrics: MetricsManager,
    precision: Precision,
    device: torch.device,
) -> dict[str, float]:
    """Metrics of ``split`` over all ranks; every sample counted exactly once."""
    was_training = model.training
    model.eval()
    remaining = loader.num_real
    for inputs, targets in loader:
        inputs, targets = move_to(inputs, device), move_to(targets, device)
        with precision.autocast():
            outputs = task.forward(model, inputs)
        keep = min(batch_rows(targets), remaining)
        if keep > 0:
            metrics.update(split, first_rows(outputs, keep), first_rows(targets, keep))
        remaining -= keep
    model.train(was_training)
    return metrics.compute(split)

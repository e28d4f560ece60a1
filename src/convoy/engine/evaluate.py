"""Evaluation over a padded shard: the forward runs on every batch (sharded models need the
same collectives on every rank) but only the rank's genuine samples reach the metrics."""

from __future__ import annotations

import torch
from torch import nn

from convoy.data.loaders import EvalBatches
from convoy.engine.amp import Precision
from convoy.metrics import MetricsManager


@torch.no_grad()
def evaluate(
    model: nn.Module,
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
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device)
        with precision.autocast():
            logits = model(images)
        keep = min(len(labels), remaining)
        if keep > 0:
            metrics.update(split, logits[:keep], labels[:keep])
        remaining -= keep
    model.train(was_training)
    return metrics.compute(split)

"""Evaluation over a padded shard: the forward runs on every batch (sharded models need the
same collectives on every rank) but only the rank's genuine samples reach the metrics."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from convoy.engine.amp import Precision
from convoy.metrics import MetricsManager


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    split: str,
    metrics: MetricsManager,
    precision: Precision,
    device: torch.device,
) -> dict[str, float]:
    """Metrics of ``split`` over all ranks; every sample counted exactly once."""
    was_training = model.training
    model.eval()
    remaining = loader.sampler.num_real  # type: ignore[attr-defined]
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

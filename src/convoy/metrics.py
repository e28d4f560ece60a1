"""MetricsManager: torchmetrics per split, synchronized over every rank.

Ray Train keeps only rank 0's reported metrics; here each metric's state (sums and counts,
not averages) is reduced over all ranks when computed, so a metric is the one a single
process would compute on the whole split. The loss is summed in float64 so the distributed
value matches the single-process one to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score


class MeanLoss(Metric):
    """Mean per-sample cross-entropy, accumulated as a float64 sum and a count."""

    full_state_update = False
    total: torch.Tensor
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        losses = F.cross_entropy(logits.double(), target, reduction="sum")
        self.total += losses
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp_min(1)


class SampleCount(Metric):
    """How many samples were counted over all ranks (proves each was counted once)."""

    full_state_update = False
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        return self.count


def _split_metrics(num_classes: int) -> MetricCollection:
    metrics: dict[str, Metric] = {
        "loss": MeanLoss(),
        "samples": SampleCount(),
        "acc": MulticlassAccuracy(num_classes, average="micro"),
        "f1": MulticlassF1Score(num_classes, average="macro"),
    }
    if num_classes > 5:
        metrics["top5"] = MulticlassAccuracy(num_classes, top_k=5, average="micro")
    # compute_groups would merge metrics whose states match after the first batch (top-5 and
    # f1 can), and the merge may differ per rank: keep every metric's own state.
    return MetricCollection(metrics, compute_groups=False)  # type: ignore[arg-type]


class MetricsManager:
    """One metric collection per split (train / val / test)."""

    SPLITS = ("train", "val", "test")

    def __init__(self, num_classes: int, device: torch.device) -> None:
        self.collections = {s: _split_metrics(num_classes).to(device) for s in self.SPLITS}

    def update(self, split: str, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Accumulate a batch (only genuine samples: callers drop eval padding first)."""
        self.collections[split].update(logits.detach().float(), target)

    def compute(self, split: str) -> dict[str, float]:
        """Reduce over all ranks and return ``{"<split>/<metric>": value}``; then reset."""
        collection = self.collections[split]
        values = {f"{split}/{k}": float(v) for k, v in collection.compute().items()}
        values[f"{split}/samples"] = int(values[f"{split}/samples"])
        collection.reset()
        return values

"""``classification``: one label per sample, cross-entropy, accuracy / top-5 / macro F1."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from convoy.tasks.base import Mode, Task, targets_of
from convoy.tasks.metrics import MacroF1, SumMetric, TopKAccuracy

# Labels checked before training (all of them where they are held apart from the inputs).
TARGETS_CHECKED = 1_000_000


class Classification(Task):
    """Logits ``(N, num_classes)`` against integer labels ``(N,)``; the loss is summed over
    samples. ``top5`` is reported when there are more than 5 classes."""

    name = "classification"
    progress_metrics = ("acc", "f1")
    required_shape = ("num_classes",)
    rank_modes: ClassVar[dict[str, Mode]] = {
        "loss": "min",
        "acc": "max",
        "top5": "max",
        "f1": "max",
    }

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets.long(), reduction="sum")

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(targets))  # on the host: see ``Task.count``

    def metric_names(self, shape: dict[str, int], meta: dict[str, Any]) -> set[str]:
        return {"acc", "f1", "top5"} if shape["num_classes"] > 5 else {"acc", "f1"}

    def metrics(self, shape: dict[str, int], meta: dict[str, Any]) -> dict[str, SumMetric]:
        num_classes = shape["num_classes"]
        metrics: dict[str, SumMetric] = {
            "acc": TopKAccuracy(k=1),
            "f1": MacroF1(num_classes),
        }
        if num_classes > 5:
            metrics["top5"] = TopKAccuracy(k=5)
        return metrics

    def metric_inputs(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        return outputs.detach().float(), targets.long()

    def check_data(self, splits: Any) -> None:
        classes = splits.shape["num_classes"]
        for split in ("train", "val", "test"):
            labels = targets_of(getattr(splits, split), TARGETS_CHECKED)
            if labels.is_floating_point() or labels.dim() != 1:
                raise ValueError(
                    f"classification needs one integer label per sample; the {split} split's "
                    f"targets are {labels.dtype} of shape {tuple(labels.shape)}"
                )
            outside = ((labels < 0) | (labels >= classes)).nonzero()
            if len(outside):
                index = int(outside[0])
                raise ValueError(
                    f"the {split} split's label at index {index} is {int(labels[index])}, "
                    f"outside 0..{classes - 1} (shape['num_classes'] is {classes})"
                )

    def check_output(self, outputs: Any, targets: Any, shape: dict[str, int]) -> None:
        classes = shape.get("num_classes")
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
            got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs)
            raise ValueError(f"classification needs logits of shape (batch, classes); got {got}")
        if classes is not None and outputs.shape[1] != classes:
            raise ValueError(
                f"the model outputs {outputs.shape[1]} logits per sample but the data has "
                f"{classes} classes; set model.kwargs.num_classes={classes} (or leave it unset: "
                "it defaults to the dataset's)"
            )

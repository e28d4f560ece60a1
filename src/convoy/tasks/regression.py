"""``regression``: float targets, mean squared error as the loss, MAE / RMSE / R² reported."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from convoy.tasks.base import Mode, Task, targets_of
from convoy.tasks.metrics import MeanAbsoluteError, R2Score, SumMetric

# Items checked for non-finite targets before training; larger splits are checked up to this.
TARGETS_CHECKED = 200_000


class Regression(Task):
    """Predictions ``(N, k)`` (or ``(N,)``) against float targets of the same number of
    values; the loss is the squared error summed over every target value, so ``loss`` is the
    MSE and ``rmse`` its square root. R² is over all ranks, averaged over target columns."""

    name = "regression"
    progress_metrics = ("r2", "mae")
    rank_modes: ClassVar[dict[str, Mode]] = {
        "loss": "min",
        "rmse": "min",
        "mae": "min",
        "r2": "max",
    }

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        predictions = _as_targets(outputs.float(), targets)
        return (predictions - targets.float()).pow(2).sum()

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.numel())  # on the host: see ``Task.count``

    def metric_names(self, shape: dict[str, int], meta: dict[str, Any]) -> set[str]:
        return {"mae", "r2"}

    def metrics(self, shape: dict[str, int], meta: dict[str, Any]) -> dict[str, SumMetric]:
        # R² averages over the target columns (uniform_average) when there are several.
        return {"mae": MeanAbsoluteError(), "r2": R2Score(shape.get("num_outputs", 1))}

    def metric_inputs(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        return _as_targets(outputs.detach().float(), targets), targets.float()

    def derived(self, values: dict[str, float]) -> dict[str, float]:
        return {"rmse": math.sqrt(values["loss"])}

    def check_output(self, outputs: Any, targets: Any, shape: dict[str, int]) -> None:
        if not isinstance(outputs, torch.Tensor):
            raise ValueError(f"regression needs a tensor of predictions; got {type(outputs)}")
        if outputs.numel() != targets.numel():
            per_sample = outputs.numel() // max(1, len(outputs))
            wanted = targets.numel() // max(1, len(targets))
            raise ValueError(
                f"the model predicts {per_sample} value(s) per sample but the targets have "
                f"{wanted}; set model.kwargs.num_outputs={wanted}"
            )

    def check_data(self, splits: Any) -> None:
        for split in ("train", "val", "test"):
            targets = targets_of(getattr(splits, split), TARGETS_CHECKED).float()
            bad = (~torch.isfinite(targets)).reshape(len(targets), -1).any(dim=1).nonzero()
            if len(bad):
                index = int(bad[0])
                raise ValueError(
                    f"the {split} split's target at index {index} is {targets[index].tolist()}; "
                    "regression targets must be finite numbers (drop or impute NaN/inf)"
                )


def _as_targets(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(N, 1)`` predictions against ``(N,)`` targets: the same values, the targets' shape."""
    return predictions.reshape(targets.shape)

"""A complete user module: your own model, data and task, trained by Convoy.

Breast-cancer screening from 30 measurements of a cell nucleus (scikit-learn's bundled
Wisconsin diagnostic set, 569 patients), framed as *binary* classification with one logit per
patient and a weighted binary cross-entropy: a task Convoy does not ship, so it shows all
three contracts. Train it with any launcher and strategy::

    convoy train recipes/user_module.yaml
    convoy train recipes/user_module.yaml -o scaling.launcher=torchrun -o strategy.name=fsdp2

The three contracts (see the README, "Your own model, data and task"):

- data (``data.name: examples.tumor_screening:screening_data``): a function returning the
  splits as map-style torch Datasets whose items are ``(inputs, targets)``; val and test are
  optional (held out of train when missing); ``shape`` names the model arguments the data
  decides.
- model (``model.name: examples.tumor_screening:screening_mlp``): a function returning an
  ``nn.Module``; the arguments it shares with ``shape`` are filled in from the data.
- task (``task.name: examples.tumor_screening:WeightedBinary``): a ``convoy.tasks.Task``
  that returns a loss *sum* and the count it sums over, and builds torchmetrics.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics import Metric
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryRecall

from convoy.tasks import Task
from convoy.tasks.base import Mode


def screening_data(test_share: float = 0.25, seed: int = 0) -> dict[str, Any]:
    """Standardized measurements and a 0/1 label (1: malignant); val is left to Convoy."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    features = torch.tensor(bunch.data, dtype=torch.float32)
    malignant = torch.tensor(bunch.target == 0, dtype=torch.float32)  # sklearn: 0 = malignant
    order = torch.randperm(len(features), generator=torch.Generator().manual_seed(seed))
    cut = int(len(order) * test_share)
    test, train = order[:cut], order[cut:]
    mean, std = features[train].mean(0), features[train].std(0)
    features = (features - mean) / std  # training statistics only
    return {
        "train": TensorDataset(features[train], malignant[train]),
        "test": TensorDataset(features[test], malignant[test]),
        "shape": {"num_features": features.shape[1]},
    }


class ScreeningMLP(nn.Module):
    """Hidden layers in ``blocks`` (so fsdp / fsdp2 shard per layer), one logit per patient."""

    def __init__(self, num_features: int, hidden: int, depth: int, dropout: float) -> None:
        super().__init__()
        widths = [num_features] + [hidden] * depth
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Dropout(dropout))
            for a, b in itertools.pairwise(widths)
        )
        self.head = nn.Linear(widths[-1], 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            features = block(features)
        return self.head(features)  # (N, 1): the task flattens it


def screening_mlp(
    num_features: int = 30, hidden: int = 32, depth: int = 1, dropout: float = 0.1
) -> nn.Module:
    """The model factory; ``num_features`` comes from the data's ``shape``."""
    return ScreeningMLP(num_features, hidden, depth, dropout)


class WeightedBinary(Task):
    """Binary classification from one logit; missing a malignant case costs ``positive_weight``
    times more than a false alarm."""

    name = "weighted_binary"
    progress_metrics = ("acc", "recall")
    rank_modes: ClassVar[dict[str, Mode]] = {"loss": "min", "auroc": "max", "recall": "max"}

    def __init__(self, positive_weight: float = 2.0) -> None:
        self.positive_weight = positive_weight

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        weight = torch.tensor(self.positive_weight, device=outputs.device)
        return F.binary_cross_entropy_with_logits(
            outputs.float().flatten(), targets.float(), pos_weight=weight, reduction="sum"
        )

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(targets), device=targets.device)

    def metrics(self, shape: dict[str, int], meta: dict[str, Any]) -> dict[str, Metric]:
        return {"acc": BinaryAccuracy(), "recall": BinaryRecall(), "auroc": BinaryAUROC()}

    def metric_inputs(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        return torch.sigmoid(outputs.detach().float().flatten()), targets.long()

    def check_output(self, outputs: Any, targets: Any, shape: dict[str, int]) -> None:
        if outputs.numel() != targets.numel():
            raise ValueError(
                f"one logit per sample expected: outputs {tuple(outputs.shape)}, "
                f"targets {tuple(targets.shape)}"
            )

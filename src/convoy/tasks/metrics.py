"""Metrics kept as sums: exact over every rank with one all-reduce, and cheap to import.

A metric here is a handful of tensors that add up: over batches (``update`` adds into them in
place) and over ranks (``all_reduce_states`` sums every metric's states at once, one
collective per dtype). ``compute`` turns the summed states into the value, so the value is the
one a single process would compute on the whole split, whatever the world size.

Why not torchmetrics for the built-in tasks: ``import torchmetrics`` imports scipy.signal,
transformers and matplotlib when they are installed (torchmetrics#3457; 1.9.0, the newest
release, still does), about 3-4 CPU-s in every process that builds a metric: every train
worker, every restart, every sweep trial. The built-ins need sums and counts only. A user's
task may still return torchmetrics ``Metric`` objects: ``convoy.metrics`` updates, computes
(torchmetrics reduces its own states) and resets them beside these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


class SumMetric(ABC):
    """A metric whose state is tensors summed over batches and ranks.

    Subclasses register each state with ``add_state`` in ``__init__`` (zeros of a fixed shape
    and dtype: every rank must hold the same shapes, updated or not), add into the states in
    place in ``update``, and compute the value from them in ``compute``.
    """

    def __init__(self) -> None:
        self._state_names: list[str] = []

    def add_state(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A state ``name`` of zeros, summed over ranks; reset to zeros by ``reset``."""
        setattr(self, name, torch.zeros(shape, dtype=dtype))
        self._state_names.append(name)

    def states(self) -> list[torch.Tensor]:
        """The state tensors, in registration order (the same on every rank)."""
        return [getattr(self, name) for name in self._state_names]

    @abstractmethod
    def update(self, *inputs: Any) -> None:
        """Add one batch into the states (in place)."""

    @abstractmethod
    def compute(self) -> Any:
        """The value from the (reduced) states: a 0-d tensor, or a dict of them."""

    def reset(self) -> None:
        for state in self.states():
            state.zero_()

    def to(self, device: torch.device | str) -> SumMetric:
        """Every tensor attribute (states and lookup tables) on ``device``; returns self."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self


def all_reduce_states(metrics: Iterable[SumMetric]) -> None:
    """Sum the states of ``metrics`` over every rank, in place: one all-reduce per dtype and
    device (counts stay integers, sums stay float64). Nothing to do without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for metric in metrics:
        for state in metric.states():
            groups.setdefault((state.dtype, state.device), []).append(state)
    for states in groups.values():
        flat = torch.cat([state.reshape(-1) for state in states])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        for state, reduced in zip(states, flat.split([s.numel() for s in states]), strict=True):
            state.copy_(reduced.view_as(state))


def safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` in float64, 0 where the denominator is 0 (nothing seen)."""
    numerator, denominator = numerator.double(), denominator.double()
    return torch.where(denominator == 0, 0.0, numerator / denominator.clamp_min(1e-300))


class TopKAccuracy(SumMetric):
    """The share of samples whose label is among the ``k`` largest logits (k=1: accuracy)."""

    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, k: int = 1) -> None:
        super().__init__()
        self.k = k
        self.add_state("correct", (), torch.long)
        self.add_state("total", (), torch.long)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if self.k == 1:
            hits = logits.argmax(dim=1) == labels
        else:
            hits = (logits.topk(self.k, dim=1).indices == labels.unsqueeze(1)).any(dim=1)
        self.correct += hits.sum()
        self.total += len(labels)

    def compute(self) -> torch.Tensor:
        return safe_ratio(self.correct, self.total)


class MacroF1(SumMetric):
    """F1 of each class (2tp / (2tp + fp + fn)) from the argmax, averaged over the classes
    that occur among the labels or the predictions (a class never seen nor predicted has no
    F1 to average), as scikit-learn's ``f1_score(average="macro", labels=seen)``."""

    true_positives: torch.Tensor
    predicted: torch.Tensor
    actual: torch.Tensor

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        for name in ("true_positives", "predicted", "actual"):
            self.add_state(name, (num_classes,), torch.long)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        predictions = logits.argmax(dim=1)
        classes = self.num_classes
        self.predicted += torch.bincount(predictions, minlength=classes)
        self.actual += torch.bincount(labels, minlength=classes)
        self.true_positives += torch.bincount(labels[predictions == labels], minlength=classes)

    def compute(self) -> torch.Tensor:
        tp = self.true_positives
        # 2tp + fp + fn = predicted + actual
        per_class = safe_ratio(2 * tp, self.predicted + self.actual)
        seen = (self.predicted + self.actual) > 0
        return safe_ratio(per_class[seen].sum(), seen.sum())


class MeanAbsoluteError(SumMetric):
    """Mean of |prediction - target| over every target value."""

    absolute_error: torch.Tensor
    values: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("absolute_error", (), torch.float64)
        self.add_state("values", (), torch.long)

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        self.absolute_error += (predictions.double() - targets.double()).abs().sum()
        self.values += targets.numel()

    def compute(self) -> torch.Tensor:
        return safe_ratio(self.absolute_error, self.values)


class R2Score(SumMetric):
    """The coefficient of determination, 1 - RSS / TSS per target column, averaged over the
    columns (scikit-learn's ``uniform_average``); sums in float64, so TSS = sum(y²) - n·mean²
    keeps its digits. A column whose targets do not vary scores 1 when predicted exactly and 0
    otherwise (scikit-learn's convention). NaN with fewer than two samples."""

    squared_residuals: torch.Tensor
    target_sums: torch.Tensor
    target_squares: torch.Tensor
    samples: torch.Tensor

    def __init__(self, num_outputs: int = 1) -> None:
        super().__init__()
        for name in ("squared_residuals", "target_sums", "target_squares"):
            self.add_state(name, (num_outputs,), torch.float64)
        self.add_state("samples", (), torch.long)

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        columns = self.target_sums.numel()
        targets = targets.double().reshape(len(targets), -1)
        if targets.shape[1] != columns:
            raise ValueError(
                f"R2Score has {columns} target column(s) (the data's shape['num_outputs'], 1 "
                f"when absent) but the targets have {targets.shape[1]}"
            )
        residuals = targets - predictions.double().reshape(targets.shape)
        self.squared_residuals += residuals.pow(2).sum(dim=0)
        self.target_sums += targets.sum(dim=0)
        self.target_squares += targets.pow(2).sum(dim=0)
        self.samples += len(targets)

    def compute(self) -> torch.Tensor:
        n = self.samples.double()
        if n < 2:
            return torch.tensor(float("nan"), dtype=torch.float64)
        total = self.target_squares - self.target_sums.pow(2) / n
        rss = self.squared_residuals
        constant = total <= 1e-12 * self.target_squares.clamp_min(1.0)
        scores = torch.where(constant, (rss == 0).double(), 1 - rss / total.clamp_min(1e-300))
        return scores.mean()

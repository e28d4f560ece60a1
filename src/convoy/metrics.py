"""MetricsManager: a task's metrics per split, reduced over every rank.

Ray Train keeps only rank 0's reported metrics; here each metric's state (sums and counts,
not averages) is reduced over all ranks when computed, so a metric is the one a single
process would compute on the whole split. The loss is the task's loss *sum* accumulated in
float64 with its count (samples or tokens), so the distributed mean matches the
single-process one to rounding.

The built-in tasks' metrics are ``convoy.tasks.metrics.SumMetric`` s: every one of a split's
states is summed over the ranks at once (one all-reduce per dtype). A user's task may return
torchmetrics ``Metric`` s instead, or beside them: those reduce their own states in
``compute``. Either way ``torchmetrics`` is imported only by a task that uses it.

A step's bookkeeping must cost microseconds, not milliseconds: the loss sum and the row count
are added to their states in place, and the task's metrics receive their inputs in batches
(``PendingInputs``): one ``update`` over several steps' predictions, concatenated, gives the
same counts and sums as one update a step.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from convoy.batches import batch_rows
from convoy.tasks.base import Task
from convoy.tasks.metrics import SumMetric, all_reduce_states


class LossSum(SumMetric):
    """A float64 loss sum and the count it is summed over; ``compute`` is their ratio."""

    total: torch.Tensor
    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", (), torch.float64)
        self.add_state("count", (), torch.long)

    def update(self, loss_sum: torch.Tensor, count: torch.Tensor) -> None:
        self.total += loss_sum.detach().double()
        self.count += count.detach().long()

    def compute(self) -> dict[str, torch.Tensor]:
        return {"loss": self.total / self.count.clamp_min(1), "count": self.count}


class RowCount(SumMetric):
    """How many samples were counted over all ranks (proves each was counted once)."""

    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", (), torch.long)

    def update(self, rows: int) -> None:
        self.count += rows

    def compute(self) -> torch.Tensor:
        return self.count


class TaskMetrics:
    """A task's named metrics, updated with the same inputs: Convoy's ``SumMetric`` s (reduced
    together in ``compute``) and any others, such as torchmetrics (each reduces itself)."""

    def __init__(self, metrics: dict[str, Any], device: torch.device) -> None:
        self.metrics = {name: metric.to(device) for name, metric in metrics.items()}
        self.sums = [m for m in self.metrics.values() if isinstance(m, SumMetric)]

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def update(self, *inputs: Any) -> None:
        for metric in self.metrics.values():
            metric.update(*inputs)

    def compute(self, reduced: Sequence[SumMetric] = ()) -> dict[str, float]:
        """Every metric's value over every rank; ``reduced``: other sums (the split's loss and
        rows) to reduce in the same all-reduce."""
        all_reduce_states([*reduced, *self.sums])
        values: dict[str, float] = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            if isinstance(value, dict):  # a torchmetrics collection or a multi-valued metric
                values |= {key: float(v) for key, v in value.items()}
            else:
                values[name] = float(value)
        return values

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()


PENDING_BYTES = 16 * 2**20
"""Metric inputs held back for one batched update at most (a step's larger inputs, such as a
language model's logits, go to the metrics at once: holding them would cost device memory)."""
PENDING_STEPS = 64


class PendingInputs:
    """Metric inputs of several steps, handed to a task's metrics as one update.

    Tensors are concatenated along the batch dimension; steps whose inputs cannot be (other
    trailing shapes, non-tensors) are updated one by one, in order."""

    def __init__(self, collection: TaskMetrics) -> None:
        self.collection = collection
        self.items: list[tuple[Any, ...]] = []
        self.bytes = 0

    def add(self, inputs: tuple[Any, ...]) -> None:
        size = sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
        if size >= PENDING_BYTES:
            self.flush()
            self.collection.update(*inputs)
            return
        self.items.append(inputs)
        self.bytes += size
        if self.bytes >= PENDING_BYTES or len(self.items) >= PENDING_STEPS:
            self.flush()

    def flush(self) -> None:
        items, self.items, self.bytes = self.items, [], 0
        if not items:
            return
        if len(items) > 1 and _concatenable(items):
            items = [tuple(_cat(column) for column in zip(*items, strict=True))]
        for inputs in items:
            self.collection.update(*inputs)


def _cat(column: tuple[Any, ...]) -> Any:
    return None if column[0] is None else torch.cat(column)


def _concatenable(items: list[tuple[Any, ...]]) -> bool:
    """Every step gives tensors of the same dtype, device and trailing shape per position
    (or None at a position, in every step)."""
    for column in zip(*items, strict=True):
        first = column[0]
        if all(value is None for value in column):
            continue
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            return False
        for t in column[1:]:
            if not isinstance(t, torch.Tensor) or (t.shape[1:], t.dtype, t.device) != (
                first.shape[1:],
                first.dtype,
                first.device,
            ):
                return False
    return True


class SplitMetrics:
    """One split's loss, sample count and task metrics."""

    def __init__(
        self, task: Task, shape: dict[str, int], meta: dict[str, Any], device: torch.device
    ) -> None:
        self.task = task
        self.loss = LossSum().to(device)
        self.rows = RowCount().to(device)
        self.collection = TaskMetrics(task.metrics(shape, meta), device)
        self.pending = PendingInputs(self.collection)
        self.rows_pending: int | None = None
        """Rows counted since the last ``compute`` (None: no update yet)."""

    def update(
        self, outputs: Any, targets: Any, loss_sum: torch.Tensor, count: torch.Tensor
    ) -> None:
        self.loss.update(loss_sum, count)
        self.rows_pending = (self.rows_pending or 0) + batch_rows(targets)
        if self.collection:
            self.pending.add(tuple(self.task.metric_inputs(outputs, targets)))

    def compute(self) -> dict[str, float]:
        """The split's values over every rank (a collective: every rank calls it), then reset."""
        self.pending.flush()
        if self.rows_pending is not None:
            self.rows.update(self.rows_pending)
            self.rows_pending = None
        task_values = self.collection.compute(reduced=[self.loss, self.rows])
        loss = self.loss.compute()
        values: dict[str, float] = {
            "loss": float(loss["loss"]),
            "samples": int(self.rows.compute()),
        }
        if self.task.count_name != "samples":
            values[self.task.count_name] = int(loss["count"])
        values |= task_values
        values |= self.task.derived(values)
        for metric in (self.loss, self.rows, self.collection):
            metric.reset()
        return values


class MetricsManager:
    """One ``SplitMetrics`` per split (train / val / test)."""

    SPLITS = ("train", "val", "test")

    def __init__(
        self,
        task: Task,
        shape: dict[str, int],
        device: torch.device,
        meta: dict[str, Any] | None = None,
        counts: bool = True,
    ) -> None:
        self.task = task
        self.counts = counts
        """False on a rank whose samples another rank counts (the ranks of a tensor-parallel
        group read the same ones): it keeps empty states, and still takes part in the sync."""
        self.splits = {s: SplitMetrics(task, shape, meta or {}, device) for s in self.SPLITS}

    def update(
        self,
        split: str,
        outputs: Any,
        targets: Any,
        loss_sum: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
    ) -> None:
        """Accumulate a batch (only genuine samples: callers drop eval padding first).

        ``loss_sum`` and ``count`` are the task's, computed here when the caller has not.
        """
        if not self.counts:
            return
        if loss_sum is None:
            loss_sum = self.task.loss_sum(outputs, targets)
        if count is None:
            count = self.task.count(targets)
        self.splits[split].update(outputs, targets, loss_sum, count)

    def compute(self, split: str) -> dict[str, float]:
        """Reduce over all ranks and return ``{"<split>/<metric>": value}``; then reset."""
        with warnings.catch_warnings():
            if not self.counts:  # torchmetrics warns of a compute without an update
                warnings.filterwarnings("ignore", "The ``compute`` method of metric")
            values = self.splits[split].compute()
        return {f"{split}/{k}": v for k, v in values.items()}

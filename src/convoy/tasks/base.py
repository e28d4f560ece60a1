"""The ``Task`` interface: what a batch is, its loss, and its metrics.

A task turns the model's outputs on one batch into a loss *sum* and the count it is summed
over (samples for classification and regression, real tokens for language modeling). The
engine divides by the count of the whole global batch, summed over ranks and accumulation
micro-steps, so a mean is the same whatever the world size, the micro-batch split or the
padding. A task also builds its metrics (reduced over every rank as sums and counts:
``convoy.tasks.metrics``, or torchmetrics for a user's task),
names the metrics the progress line shows, says which metrics may rank checkpoints, and checks
that a model's output fits the data before any worker starts.

Batches are ``(inputs, targets)``; either may be a tensor or a dict / tuple of tensors.
``inputs`` go to the model as they are (``model(inputs)``); override ``forward`` for another
calling convention.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

Mode = Literal["min", "max"]


class Task(ABC):
    """Base class of every task, built-in or the user's own (``task.name: pkg.mod:Class``).

    Subclasses take their options as keyword arguments (``task.kwargs``) and implement
    ``loss_sum`` and ``count``; the rest has defaults.
    """

    name: ClassVar[str] = "task"
    count_name: ClassVar[str] = "samples"
    """What ``count`` counts: reported as ``<split>/<count_name>`` when it is not samples."""
    progress_metrics: ClassVar[tuple[str, ...]] = ()
    """Metrics shown after the loss on the progress line (e.g. ``("acc",)``)."""
    rank_modes: ClassVar[dict[str, Mode]] = {"loss": "min"}
    """Metrics that may rank checkpoints (``checkpoint.best_metric``) and which way is better."""
    required_shape: ClassVar[tuple[str, ...]] = ()
    """``Splits.shape`` keys the task cannot work without (``num_classes`` for
    classification): data without them is refused before any worker starts."""
    fixed_count: ClassVar[bool] = True
    """True when ``count`` depends only on the batch's shape (rows, or rows x outputs), so a
    global batch's count is the rank's count x world size without communication; False
    (real tokens) makes the engine sum the counts over ranks every step."""

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """The model's outputs for one batch's inputs."""
        return model(inputs)

    def forward_loss(self, model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor]:
        """A training micro-batch's outputs (what ``metric_inputs`` receives) and loss sum:
        ``forward`` then ``loss_sum``, unless the task lets the model compute its loss in its
        forward (a language model's head fused with the cross-entropy)."""
        outputs = self.forward(model, inputs)
        return outputs, self.loss_sum(outputs, targets)

    def model_computes_loss(self, model: nn.Module) -> bool:
        """Whether ``forward_loss`` has ``model`` compute the loss in its forward."""
        return False

    @abstractmethod
    def loss_sum(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss summed (not averaged) over the batch's counted units, as a 0-d tensor."""

    @abstractmethod
    def count(self, targets: Any) -> torch.Tensor:
        """How many units ``loss_sum`` sums over (a 0-d integer tensor). Where the batch's
        shape alone says (``fixed_count``), make it on the host: a device tensor made from a
        Python number is a copy the host waits for, every micro-step."""

    def metrics(self, shape: dict[str, int], meta: dict[str, Any]) -> dict[str, Any]:
        """Metrics updated with ``metric_inputs(outputs, targets)`` (loss is built in):
        ``convoy.tasks.metrics.SumMetric`` s, reduced over every rank in one all-reduce, or
        torchmetrics ``Metric`` s, which reduce themselves (torchmetrics costs seconds of CPU
        to import: import it inside this method)."""
        return {}

    def metric_names(self, shape: dict[str, int], meta: dict[str, Any]) -> set[str]:
        """The keys ``metrics`` returns on this data, asked where no metric is updated (the
        driver's checks). The default builds them; a task whose metrics are torchmetrics says
        their names here, so the driver need not import torchmetrics."""
        return set(self.metrics(shape, meta))

    def metric_inputs(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        """What the task's metrics are updated with: ``(predictions, targets)``."""
        return outputs.detach().float(), targets

    def derived(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the all-rank values of one split (keys without the split)."""
        return {}

    def check_output(self, outputs: Any, targets: Any, shape: dict[str, int]) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` saying what does not fit when the outputs cannot be scored."""

    def check_data(self, splits: Any) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` when the data cannot be trained on by this task."""

    def best_mode(self, metric: str) -> Mode:
        """Whether lower or higher is better for a rankable ``<split>/<metric>``."""
        return self.rank_modes[metric.partition("/")[2]]

    def reported(self, shape: dict[str, int], meta: dict[str, Any]) -> set[str]:
        """The metric names a split reports on this data (``top5`` needs > 5 classes, ``bpb``
        needs the tokenizer's bytes per token)."""
        names = {"loss", "samples", self.count_name, *self.metric_names(shape, meta)}
        placeholder = dict.fromkeys(names, 1.0)
        return names | set(self.derived(placeholder))

    def rankable(self, shape: dict[str, int], meta: dict[str, Any]) -> list[str]:
        """Every ``<split>/<metric>`` that ``checkpoint.best_metric`` may name on this data."""
        reported = self.reported(shape, meta)
        names = [name for name in self.rank_modes if name in reported]
        return [f"{split}/{name}" for split in ("val", "train") for name in names]


def targets_of(dataset: Any, limit: int) -> torch.Tensor:
    """The targets of (up to ``limit`` items of) a dataset, stacked, read without decoding
    inputs where the dataset holds them apart (``TensorDataset``, in-memory images,
    encoded-image records, ``Subset`` of those)."""
    if isinstance(dataset, Subset):
        parent = dataset.dataset
        return targets_of(parent, len(parent))[list(dataset.indices)][:limit]  # type: ignore[arg-type]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[1][:limit]
    if callable(getattr(dataset, "targets_head", None)):  # a streamed split: one column read
        return dataset.targets_head(limit)
    if isinstance(getattr(dataset, "labels", None), torch.Tensor):
        return dataset.labels[:limit]
    records = getattr(dataset, "records", None)
    if isinstance(records, list) and all(hasattr(r, "label") for r in records[:1]):
        return torch.tensor([r.label for r in records[:limit]], dtype=torch.long)
    items = [torch.as_tensor(dataset[i][1]) for i in range(min(len(dataset), limit))]
    return torch.stack(items) if items else torch.zeros(0)


def perplexity(mean_nats: float) -> float:
    """exp(loss), saturating instead of overflowing for an untrained model."""
    return math.exp(min(mean_nats, 700.0))


def inner_model(model: nn.Module) -> nn.Module:
    """The user's module inside the wrappers that hold it as an attribute (DDP's ``module``,
    ``torch.compile``'s ``_orig_mod``); FSDP wraps in place."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner

"""The names and values the tracking sinks (TensorBoard, MLflow) record, one mapping for both.

Each tag means one thing: the loss and learning rate of a logged step are ``step/loss`` and
``step/lr``; an epoch's metrics keep their ``metrics.jsonl`` names (``train/loss``,
``val/acc``...) plus ``epoch``; the test metrics are those of the final evaluation under
the names it gives them (the engine's ``test/loss``, a LightningModule's ``test_acc``...).
Per-rank figures are ``ranks/<figure>/rank<N>``. Every value is plotted against the optimizer
step.
"""

from __future__ import annotations

from typing import Any

from convoy.engine.events import EpochEvent, EvalEvent, StepEvent, StragglerEvent

RANK_FIGURES = ("step_seconds", "data_wait_seconds", "local_seconds", "memory_bytes")


def step_scalars(event: StepEvent) -> dict[str, float]:
    """A logged step: loss, lr, throughput and every rank's figures (None values dropped)."""
    scalars: dict[str, float | None] = {
        "step/loss": event.loss,
        "step/lr": event.lr,
        "throughput/samples_per_second": event.samples_per_second,
        "throughput/tflops": event.tflops,
        "throughput/mfu": event.mfu,
    }
    for figure in RANK_FIGURES:
        for rank, value in enumerate(getattr(event.ranks, figure)):
            scalars[f"ranks/{figure}/rank{rank}"] = value
    return _numbers(scalars)


def epoch_scalars(event: EpochEvent) -> dict[str, float]:
    """A finished epoch: its train and val metrics, the epoch number and its duration."""
    return _numbers({**event.metrics, "epoch": event.epoch, "time/epoch_seconds": event.seconds})


REPEATED_SPLITS = ("train/", "val/")
"""Prefixes of the engine's final-evaluation figures that repeat the last epoch's record."""


def eval_scalars(event: EvalEvent) -> dict[str, float]:
    """The final evaluation's test metrics, whatever they are named; the engine's ``train/``
    and ``val/`` figures in it are the last epoch's, already recorded at that step."""
    if event.split != "test":
        return {}
    return _numbers({k: v for k, v in event.metrics.items() if not k.startswith(REPEATED_SPLITS)})


def straggler_scalars(event: StragglerEvent) -> dict[str, float]:
    """A named straggler: how much slower than the median rank, and its local work per step."""
    prefix = f"stragglers/rank{event.rank}"
    return {f"{prefix}/slower_by": event.slower_by, f"{prefix}/local_seconds": event.seconds}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys (``model.kwargs.hidden``); lists and scalars are leaves,
    and an empty mapping is a leaf too (so every section of a recipe is recorded)."""
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float)}

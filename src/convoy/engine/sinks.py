"""The sinks every run has (``metrics.jsonl``, progress) and the assembly of a run's sinks.

``metrics.jsonl`` is the source of truth: every other sink (TensorBoard, MLflow, Ray Train
reports, Prometheus) sees the same events, and one that fails is switched off without losing
a record there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from convoy.config import Job
from convoy.distributed import WorkerContext
from convoy.engine.events import (
    EndEvent,
    EpochEvent,
    EvalEvent,
    EventBus,
    MessageEvent,
    Sink,
    StartEvent,
    StepEvent,
    StragglerEvent,
)
from convoy.engine.progress import Progress, format_epoch
from convoy.outputs import RunOutputs


class SinkUnavailable(Exception):
    """A sink cannot run here (its library is missing, its server unreachable); the message
    says why and what to do. The run goes on without it."""


class MetricsFileSink(Sink):
    """``metrics.jsonl``: one record per logged step, epoch, evaluation and straggler."""

    name = "metrics.jsonl"
    required = True

    def __init__(self, outputs: RunOutputs) -> None:
        self.outputs = outputs

    def on_step(self, event: StepEvent) -> None:
        self.outputs.log(event.record())

    def on_epoch(self, event: EpochEvent) -> None:
        self.outputs.log(event.record())

    def on_eval(self, event: EvalEvent) -> None:
        if event.split == "test":  # val metrics are part of their epoch's record
            self.outputs.log(event.record())

    def on_straggler(self, event: StragglerEvent) -> None:
        self.outputs.log(event.record())

    def on_end(self, event: EndEvent) -> None:
        self.outputs.write_summary(event.summary)


class ProgressSink(Sink):
    """The rank-0 log: the header, a line (or live bar) per logged step, one per epoch."""

    name = "progress"
    required = True

    def __init__(self, progress: Progress, shown: Sequence[str] = ()) -> None:
        self.progress = progress
        self.shown = tuple(shown)
        """The metrics an epoch line shows after the loss (the task's ``progress_metrics``)."""
        self._stragglers: set[int] = set()
        """Ranks named a straggler at the last logged step (named once, until they recover)."""
        self._seen: set[int] = set()
        self._last = 0

    def on_start(self, event: StartEvent) -> None:
        self.progress.line(event.header)

    def on_step(self, event: StepEvent) -> None:
        # Straggler events follow their step's event: the previous interval is complete now.
        for rank in sorted(self._stragglers - self._seen):
            self.progress.line(f"convoy: rank {rank} is no longer a straggler at step {self._last}")
        self._stragglers, self._seen, self._last = self._seen, set(), event.step
        self.progress.step(
            event.step, event.epoch - 1, event.loss, event.lr, event.rate, event.throughput_text
        )

    def on_epoch(self, event: EpochEvent) -> None:
        self.progress.line(
            format_epoch(event.epoch - 1, event.epochs, event.metrics, event.seconds, self.shown)
        )

    def on_straggler(self, event: StragglerEvent) -> None:
        # metrics.jsonl records every detection; the log names a straggler when it appears.
        if event.rank not in self._stragglers:
            self.progress.line(event.message())
        self._seen.add(event.rank)

    def on_message(self, event: MessageEvent) -> None:
        self.progress.line(event.text)


# Optional sinks: (config switch, module with ``build(job, ctx) -> Sink``).
TRACKING_SINKS = (
    ("tracking.tensorboard", "convoy.integrations.tensorboard"),
    ("tracking.mlflow.enabled", "convoy.integrations.mlflow"),
)


def build_sinks(
    job: Job, ctx: WorkerContext, outputs: RunOutputs, shown: Sequence[str], total_steps: int
) -> EventBus:
    """This rank's sinks: the run's files and log on rank 0, the tracking sinks the job turns
    on (rank 0), and the launcher's own (``ctx.sinks``, every rank, closed by the launcher).
    ``shown``: the metrics an epoch line shows after the loss."""
    sinks: list[Sink] = []
    if ctx.is_main:
        sinks.append(MetricsFileSink(outputs))
        sinks.append(ProgressSink(Progress(total_steps, job.run.progress, True), shown))
        sinks.extend(_tracking_sinks(job, ctx))
    return EventBus(sinks, borrowed=tuple(ctx.sinks))


def _tracking_sinks(job: Job, ctx: WorkerContext) -> list[Sink]:
    built: list[Sink] = []
    for switch, module in TRACKING_SINKS:
        if not _switched_on(job, switch):
            continue
        try:
            built.append(importlib.import_module(module).build(job, ctx))
        except SinkUnavailable as exc:
            print(f"convoy: {switch} is on but the sink is off: {exc}", file=sys.stderr, flush=True)
    return built


def _switched_on(job: Job, dotted: str) -> bool:
    value: Any = job
    for part in dotted.split("."):
        value = getattr(value, part)
    return bool(value)

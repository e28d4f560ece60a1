"""A Lightning ``Callback`` that turns a ``Trainer``'s progress into Convoy's events.

It runs on every rank and emits the same events in the same order there (the Ray report sink
needs that): ``StartEvent`` when training starts, a ``StepEvent`` every
``run.log_every_steps`` optimizer steps with every rank's step time, data wait and peak
memory (one small all-gather) and any straggler among the ranks, and an ``EpochEvent`` at
each epoch's end carrying ``trainer.callback_metrics`` under the names the module logged them
with. Data wait is the time between one batch's end and the next batch's start, where
Lightning fetches the batch; local work (what straggler detection compares, as in the
engine) is data wait plus the time from the batch's start to its backward (the forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size

from convoy.config import Job
from convoy.distributed import WorkerContext, all_reduce_sum
from convoy.engine.events import (
    EpochEvent,
    EventBus,
    RankStats,
    StartEvent,
    StepEvent,
)
from convoy.engine.monitor import StragglerWatch, gather_rank_stats


@dataclass
class StepClock:
    """Wall-clock figures of the optimizer steps, for step events and the summary."""

    step_seconds: list[float] = field(default_factory=list)
    data_wait_seconds: float = 0.0
    train_seconds: float = 0.0
    samples: int = 0
    first_step_end: float | None = None
    interval: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Since the last logged step: batches, seconds, data-wait seconds, samples and forward
    seconds (this rank)."""

    def record(self, seconds: float, wait: float, samples: int, forward: float) -> None:
        if self.first_step_end is None:
            self.first_step_end = time.time()
        self.step_seconds.append(seconds)
        self.data_wait_seconds += wait
        self.train_seconds += seconds
        self.samples += samples
        for i, value in enumerate((1.0, seconds, wait, float(samples), forward)):
            self.interval[i] += value


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics as floats (Lightning holds them as 0-d tensors)."""
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            values[name] = float(value.item())
        elif isinstance(value, (int, float)):
            values[name] = float(value)
    return values


class ConvoyEvents(Callback):
    """Emits Convoy's events from Lightning's hooks (see the module docstring)."""

    def __init__(
        self,
        ctx: WorkerContext,
        job: Job,
        header: str,
        make_bus: Callable[[int], EventBus],
    ) -> None:
        self.make_bus = make_bus
        self.stragglers = StragglerWatch(job.monitor)
        self.bus: EventBus | None = None
        """Built when training starts, once Lightning knows the number of steps."""
        self.pending_messages: list[str] = []
        """Lines for the run log once the bus is open (resumed from...)."""
        self.ctx = ctx
        self.job = job
        self.header = header
        self.log_every = job.run.log_every_steps
        self.clock = StepClock()
        self.batch_start = self.previous_end = self.epoch_start = time.perf_counter()
        self.wait = 0.0
        self.forward = 0.0
        self.logged_step = -1
        self.total_steps = 0
        """The optimizer steps Lightning plans (known once training starts)."""
        self.started = time.time()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        params = sum(p.numel() for p in pl_module.parameters())
        header = f"{self.header} | {params:,} params | {trainer.estimated_stepping_batches} steps"
        record = self.job.model_dump(mode="json")
        steps = self.total_steps = int(trainer.estimated_stepping_batches)
        bus = self.open_bus(steps)
        bus.emit(StartEvent(record, self.job.run_uri, self.ctx.world_size, steps, header))
        for text in self.pending_messages:
            bus.message(text)

    def open_bus(self, total_steps: int) -> EventBus:
        """This rank's sinks (``build_sinks``), once; the entry closes them."""
        if self.bus is None:
            self.bus = self.make_bus(total_steps)
        return self.bus

    def _emit(self, event: Any) -> None:
        assert self.bus is not None, "events before on_train_start"
        self.bus.emit(event)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epoch_start = self.previous_end = time.perf_counter()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batch_start = time.perf_counter()
        self.wait = self.batch_start - self.previous_end
        self.forward = 0.0

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        self.forward = time.perf_counter() - self.batch_start

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        try:
            samples = extract_batch_size(batch)
        except Exception:  # a batch Lightning cannot measure: no samples/s
            samples = 0
        self.clock.record(now - self.previous_end, self.wait, samples, self.forward)
        self.previous_end = now
        step = trainer.global_step
        if step != self.logged_step and step > 0 and step % self.log_every == 0:
            self.logged_step = step
            self._emit_step(trainer, pl_module, outputs, step)

    def _emit_step(
        self, trainer: Trainer, module: LightningModule, outputs: Any, step: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        local = loss.detach().double() if isinstance(loss, torch.Tensor) else torch.zeros(())
        mean_loss = float(all_reduce_sum(local.to(module.device).double())) / self.ctx.world_size
        ranks, rate = self._rank_interval(module.device)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else 0.0
        average = self.clock.samples * self.ctx.world_size / max(self.clock.train_seconds, 1e-9)
        self._emit(
            StepEvent(
                step=step,
                epoch=trainer.current_epoch + 1,
                loss=mean_loss,
                lr=lr,
                ranks=ranks,
                samples_per_second=rate,
                rate=(average, "samples"),
            )
        )
        for straggler in self.stragglers.check(step, ranks):
            self._emit(straggler)

    def _rank_interval(self, device: torch.device) -> tuple[RankStats, float]:
        batches, seconds, wait, samples, forward = self.clock.interval
        self.clock.interval = [0.0] * 5
        per = max(1.0, batches)
        stats, extra = gather_rank_stats(
            seconds / per, wait / per, (wait + forward) / per, device, samples
        )
        # The step is synchronous: the slowest rank sets everyone's pace.
        slowest = max(stats.step_seconds) * per
        return stats, sum(rank[0] for rank in extra) / max(slowest, 1e-9)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = metric_values(trainer.callback_metrics)
        seconds = time.perf_counter() - self.epoch_start
        epoch, epochs = trainer.current_epoch + 1, int(trainer.max_epochs or 0)
        self._emit(EpochEvent(epoch, epochs, trainer.global_step, metrics, seconds))

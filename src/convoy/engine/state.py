"""What the loop mutates, how it is built and where it resumes.

``TrainState`` holds what a step runs on (``StepParts``: model, optimizer, schedule, strategy,
precision, task) and everything else the loop keeps across steps: position, metrics, the
checkpoint manager, the stop watch, the event bus, timers. ``build_state`` builds it from the
job for one worker; ``restore`` resumes it from the latest committed checkpoint.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from convoy.checkpoint import (
    META_FILE,
    BestPolicy,
    CheckpointManager,
    Position,
    checkpoint_path,
    partial_checkpoints,
)
from convoy.config import DataParallelRank, Job, MonitorConfig
from convoy.data.loaders import WorkerData
from convoy.distributed import WorkerContext
from convoy.engine.amp import Precision
from convoy.engine.events import CheckpointEvent, EventBus
from convoy.engine.heartbeat import Heartbeat
from convoy.engine.monitor import StragglerWatch
from convoy.engine.schedule import build_optimizer, build_scheduler, no_decay_names, peak_lr
from convoy.engine.step import StepParts
from convoy.engine.stop import StopWatch
from convoy.engine.summary import Throughput, Timers
from convoy.metrics import MetricsManager
from convoy.models.registry import build_skeleton
from convoy.storage import RunStorage
from convoy.strategies import Strategy
from convoy.strategies.base import dtype_from_name
from convoy.strategies.blocks import prepare_blocks
from convoy.tasks import build_task


@dataclass
class TrainState(StepParts):
    """Everything the loop mutates: what a step runs on (``StepParts``) and the rest."""

    metrics: MetricsManager
    rank: int = 0
    world_size: int = 1
    share: DataParallelRank = field(default_factory=lambda: DataParallelRank(0, 1, counts=True))
    """This rank's share of each global batch (the ranks of a tensor-parallel group read one)."""
    stop: StopWatch = field(default_factory=StopWatch)
    attempt: int = 1
    data_shape: dict[str, int] = field(default_factory=dict)
    data_fingerprint: str | None = None
    """The source's digest of the data a model depends on (a text corpus: its tokenizer)."""
    job_record: dict[str, Any] = field(default_factory=dict)
    latest_metrics: dict[str, float] = field(default_factory=dict)
    """The last epoch's metrics: what a checkpoint is ranked by for keep_best."""
    heartbeat: Heartbeat | None = None
    events: EventBus = field(default_factory=EventBus)
    stragglers: StragglerWatch = field(default_factory=lambda: StragglerWatch(MonitorConfig()))
    epoch: int = 0
    """0-based: the epoch being trained."""
    step: int = 0
    steps_into_epoch: int = 0
    last_saved_step: int = -1
    resumed_from: str | None = None
    checkpoints: CheckpointManager | None = None
    timers: Timers = field(default_factory=Timers)
    throughput: Throughput = field(default_factory=Throughput)

    def position(self, epoch: int, steps_per_epoch: int) -> Position:
        """Where to continue from; a finished epoch continues at the next one."""
        if self.steps_into_epoch >= steps_per_epoch:
            return Position(self.step, epoch + 1, 0)
        return Position(self.step, epoch, self.steps_into_epoch)

    def save_checkpoint(
        self,
        epoch: int,
        steps_per_epoch: int,
        metrics: dict[str, float] | None = None,
        asynchronous: bool = False,
        alone: bool = False,
    ) -> None:
        """Save unless checkpointing is off or this step is saved already. ``alone``: this
        rank writes the whole state by itself, without a collective (relaxed collectives)."""
        if self.checkpoints is None or self.last_saved_step == self.step:
            return
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict(),
            "data_shape": self.data_shape,
            "data_fingerprint": self.data_fingerprint,
            "job": self.job_record,
            "metrics": metrics or self.latest_metrics,
        }
        position = self.position(epoch, steps_per_epoch)
        self.checkpoints.save(position, self.model, self.optimizer, extra, asynchronous, alone)
        self.last_saved_step = self.step


def build_state(
    job: Job,
    ctx: WorkerContext,
    data: WorkerData,
    strategy: Strategy,
    total_steps: int,
    share: DataParallelRank,
) -> TrainState:
    """The state ``train`` starts from on this worker: the model built and wrapped by
    ``strategy``, its optimizer and LR schedule over ``total_steps``, the task, the metrics
    for this rank's ``share`` of each batch."""
    shape = data.shape
    task = build_task(job.task.name, job.task.kwargs)
    model, weights = build_skeleton(
        job.model.name, job.model.kwargs, shape, job.run.seed, job.model.lora
    )
    if weights is None and strategy.sharding.parameters and ctx.world_size > 1 and ctx.rank == 0:
        warn_whole_on_every_rank(job.model.name, model)
    no_decay = no_decay_names(model)
    model = strategy.wrap(prepare_blocks(model, job.strategy, job.run.compile), weights)
    lr = peak_lr(job.optim, job.data.batch_size)
    optimizer = build_optimizer(job.optim, model, no_decay, lr, compiled=bool(job.run.compile))
    return TrainState(
        rank=ctx.rank,
        world_size=ctx.world_size,
        share=share,
        data_shape=shape,
        data_fingerprint=data.meta.get("fingerprint"),
        job_record=job.model_dump(mode="json"),
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, job.optim, total_steps),
        strategy=strategy,
        precision=Precision(dtype_from_name(job.precision), ctx.device, strategy),
        task=task,
        metrics=MetricsManager(task, shape, ctx.device, data.meta, counts=share.counts),
    )


def warn_whole_on_every_rank(name: str, model: nn.Module) -> None:
    """A sharded run of a model that cannot be built on meta: each rank holds it whole until
    it is sharded. Said once, with what would change it."""
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    warnings.warn(
        f"model {name!r} ({type(model).__name__}) has no init_module(module), so every rank "
        f"builds it whole ({size:.2f} GiB) before sharding; define init_module (each module's "
        "init) and Convoy builds it on the meta device and fills only each rank's shard",
        stacklevel=2,
    )


def restore(job: Job, ctx: WorkerContext, state: TrainState, storage: RunStorage) -> Position:
    """Resume from the latest committed checkpoint, if checkpointing and resume are on;
    returns where training continues. With checkpointing on, ``state.checkpoints`` is set up
    here, resumed or not: every later save goes through it.

    A launcher may name the checkpoint (Ray Train's ``get_checkpoint()``); otherwise the
    latest committed one in the run directory is used, so every launcher resumes from the
    same layout.
    """
    if not job.checkpoint.enabled:
        return Position(0, 0, 0)
    cfg = job.checkpoint
    mode = state.task.best_mode(cfg.best_metric) if cfg.best_mode == "auto" else cfg.best_mode
    best = BestPolicy(cfg.keep_best, cfg.best_metric, mode) if cfg.keep_best else None
    state.checkpoints = CheckpointManager(
        storage,
        ctx,
        cfg.keep_latest,
        best,
        reporter=ctx.checkpoint_reporter,
        on_commit=lambda path, meta: state.events.emit(
            CheckpointEvent(meta["step"], state.epoch + 1, path, meta.get("metrics", {}))
        ),
        trainable_only=job.model.lora is not None,
    )
    for partial in partial_checkpoints(storage):
        state.events.message(
            f"convoy: skipped {partial}: its save never committed (no {META_FILE})"
        )
    preferred = ctx.resume_from.rsplit("/", 1)[-1] if ctx.resume_from else None
    restored = (
        state.checkpoints.load_latest(state.model, state.optimizer, preferred)
        if job.checkpoint.resume
        else None
    )
    if restored is None:
        return Position(0, 0, 0)
    name, meta = restored
    state.scheduler.load_state_dict(meta["scheduler"])
    if meta["scaler"]:
        state.precision.scaler.load_state_dict(meta["scaler"])
    state.step = state.last_saved_step = meta["step"]
    state.resumed_from = f"{storage.uri}/{checkpoint_path(name)}"
    state.events.message(
        f"convoy: resumed from {name} (step {meta['step']}, epoch {meta['epoch'] + 1}, "
        f"{meta['steps_into_epoch']} steps into it; saved by {meta['world_size']} rank(s))"
    )
    return Position(meta["step"], meta["epoch"], meta["steps_into_epoch"])

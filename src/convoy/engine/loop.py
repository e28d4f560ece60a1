"""The one training loop, for every strategy and every launcher.

``train(job, ctx)`` runs on each worker: it joins the process group if the launcher has not,
builds data, model and strategy from the job, trains with accumulation (``no_sync`` on all
but the last micro-step), mixed precision, clipping and an LR schedule, evaluates on val each
``eval_every_epochs`` and on test at the end, and returns the summary (rank 0 also writes it).
The loop never asks which launcher started it; the ``WorkerContext`` is all it knows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

from convoy.batches import move_to
from convoy.checkpoint import (
    META_FILE,
    BestPolicy,
    CheckpointManager,
    Position,
    checkpoint_name,
    checkpoint_path,
    partial_checkpoints,
)
from convoy.config import (
    DataParallelRank,
    Job,
    MonitorConfig,
    layout_name,
    micro_batch,
    tp_size_of,
)
from convoy.data.loaders import EvalBatches, TrainBatches, WorkerData, torch_worker_data
from convoy.data.registry import load_splits
from convoy.distributed import (
    WorkerContext,
    all_gather_objects,
    all_reduce_sum,
    peak_memory_bytes,
    peak_reserved_bytes,
    process_group,
    worker_threads,
)
from convoy.engine.amp import Precision
from convoy.engine.evaluate import evaluate
from convoy.engine.events import (
    CheckpointEvent,
    EndEvent,
    EpochEvent,
    EvalEvent,
    EventBus,
    RankStats,
    StartEvent,
    StepEvent,
)
from convoy.engine.faults import maybe_inject, maybe_slow_down, next_attempt
from convoy.engine.flops import (
    count_train_flops_per_sample,
    device_name,
    format_throughput,
    mfu,
    peak_flops,
)
from convoy.engine.heartbeat import Heartbeat, hang_watch
from convoy.engine.monitor import ForwardTimer, StepClock, StragglerWatch, gather_rank_stats
from convoy.engine.schedule import build_optimizer, build_scheduler, no_decay_names, peak_lr
from convoy.engine.sinks import build_sinks
from convoy.engine.step import StepHooks, StepParts, train_step
from convoy.engine.stop import (
    STOPPED_FILE,
    StopNotice,
    StopRequested,
    StopWatch,
    describe,
    grace_period_s,
)
from convoy.errors import ConfigError
from convoy.metrics import MetricsManager
from convoy.models.registry import build_model, count_parameters
from convoy.outputs import TOKENIZER_FILE, RunOutputs
from convoy.storage import RunStorage
from convoy.strategies import Strategy, build_strategy
from convoy.strategies.base import dtype_from_name
from convoy.strategies.blocks import compile_seconds, prepare_blocks
from convoy.tasks import build_task

# Steps excluded from the steady-state step time (allocator and thread-pool warm-up).
WARMUP_STEPS_EXCLUDED = 3


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights without a broadcast."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Timers:
    """Wall-clock bookkeeping for the summary."""

    clock: StepClock = field(default_factory=lambda: StepClock(torch.device("cpu")))
    """Each step's duration, read at logged steps (on CUDA without a wait inside a step)."""
    start: float = field(default_factory=time.time)
    first_step_end: float | None = None
    step_seconds: list[float] = field(default_factory=list)
    data_wait_seconds: float = 0.0
    first_batch: tuple[float, float] | None = None
    """The first step's (data wait, step seconds): a pipeline starting (Ray Data's task
    processes, a first read from S3) is paid there once, and reported apart from the rest."""
    train_seconds: float = 0.0
    samples: int = 0
    units: torch.Tensor | float = 0.0
    """What the task counts (samples, real tokens) over all ranks, kept on the device."""
    interval: list[float] = field(default_factory=lambda: [0.0] * 4)
    """Since the last logged step: steps, step seconds, data-wait seconds, global samples."""
    local_work: list[tuple[float, ForwardTimer]] = field(default_factory=list)
    """Since the last logged step: each step's local work (data wait, forward's timer)."""
    compiled_before: float = field(default_factory=compile_seconds)
    """``torch.compile``'s seconds in this process before the run: the summary reports the
    run's own (``run.compile``), and the step times and throughput leave them out (paid
    once per shape and mode, not per step)."""

    def resolve(self) -> None:
        """Take in the durations of the steps ended since the last call (on CUDA, this waits
        for the last one: call it where the loop waits for the device anyway)."""
        durations = self.clock.resolve()
        self.step_seconds.extend(durations)
        self.train_seconds += sum(durations)
        self.interval[1] += sum(durations)


@dataclass
class Throughput:
    """FLOPs per sample (counted once, on the meta device) and the device's peak."""

    device_name: str = "cpu"
    peak_flops: float | None = None
    flops_per_sample: float | None = None
    counted: bool = False

    def tflops(self, samples_per_second: float) -> float | None:
        """Achieved TFLOP/s over all ranks at ``samples_per_second`` (global)."""
        if self.flops_per_sample is None:
            return None
        return self.flops_per_sample * samples_per_second / 1e12

    def mfu(self, samples_per_second: float, world_size: int) -> float | None:
        tflops = self.tflops(samples_per_second)
        return None if tflops is None else mfu(tflops * 1e12 / world_size, self.peak_flops)


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


def train(job: Job, ctx: WorkerContext) -> dict[str, Any]:
    """Train ``job`` on this worker and return the run summary (same on every rank)."""
    torch.set_num_threads(job.scaling.threads_per_worker or worker_threads(ctx))
    strategy = build_strategy(
        job.strategy, ctx.device, dtype_from_name(job.precision), ctx.local_world_size
    )
    needed = strategy.requires_process_group or ctx.world_size > 1
    with process_group(ctx, job.run.collective_timeout_s, needed):
        return _train(job, ctx, strategy)


def _train(job: Job, ctx: WorkerContext, strategy: Strategy) -> dict[str, Any]:
    timers = Timers(clock=StepClock(ctx.device))
    seed_everything(job.run.seed)
    share = job.strategy.data_parallel_rank(ctx.rank, ctx.world_size)
    data = _worker_data(job, ctx, share)
    steps_per_epoch = len(data.train) // job.optim.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            "data.batch_size",
            job.data.batch_size,
            f"larger than the training split ({data.sizes['train']} samples): "
            "no step fits in an epoch",
        )
    total_steps = job.run.epochs * steps_per_epoch
    if job.run.max_steps is not None:
        total_steps = min(total_steps, job.run.max_steps)
    state = _build_state(job, ctx, data, strategy, total_steps, share)
    state.timers = timers
    name = device_name(ctx.device)
    state.throughput = Throughput(name, peak_flops(name, job.precision))
    storage = RunStorage.at(job.run_uri)
    outputs = RunOutputs(storage, enabled=ctx.is_main)
    state.stragglers = StragglerWatch(job.monitor)
    state.stop = StopWatch(
        job.run.stop_on_signal, ctx.stop_notices, grace_period_s(), job.run.stop_poll_s
    )
    state.events = build_sinks(job, ctx, outputs, state.task.progress_metrics, total_steps)
    if ctx.is_main:
        storage.delete(STOPPED_FILE)  # a restarted attempt (torchrun's agent) runs on
    try:
        steps = (steps_per_epoch, total_steps)
        with state.stop.installed():
            summary = _train_and_summarize(job, ctx, state, data, storage, outputs, steps)
    except StopRequested as stopped:
        if ctx.is_main:
            storage.write_text(STOPPED_FILE, str(stopped))
        raise
    finally:
        state.events.close()
    return summary


def _train_and_summarize(
    job: Job,
    ctx: WorkerContext,
    state: TrainState,
    data: WorkerData,
    storage: RunStorage,
    outputs: RunOutputs,
    steps: tuple[int, int],
) -> dict[str, Any]:
    """Restore, train every epoch, evaluate on test; emits the run's events on the way."""
    total_steps = steps[1]
    if data.meta.get("tokenizer_json"):
        outputs.write_file(TOKENIZER_FILE, data.meta["tokenizer_json"])
    if job.fault.kind != "none":
        state.attempt = next_attempt(storage, ctx.is_main)
    start = _restore(job, ctx, state, storage)
    data.train.start_epoch(start.epoch, start.steps_into_epoch)  # reading starts meanwhile
    sizes = data.sizes
    layout = layout_name(job.strategy.name, tp_size_of(job.strategy))
    header = (
        f"convoy: {job.model.name} ({count_parameters(state.strategy.unwrap(state.model)):,} "
        f"params on rank 0) | {job.data.name} via {job.data.loader}: {sizes['train']} train / "
        f"{sizes['val']} val / {sizes['test']} test | {layout} x {ctx.world_size} | "
        f"{job.precision} | global batch {job.data.batch_size} | {total_steps} steps"
    )
    state.events.emit(
        StartEvent(state.job_record, job.run_uri, ctx.world_size, total_steps, header)
    )
    if data.skipped:
        shown = "; ".join(data.skipped[:5]) + ("; ..." if len(data.skipped) > 5 else "")
        state.events.message(f"convoy: skipped {len(data.skipped)} unreadable record(s): {shown}")
    watch = hang_watch(ctx.rank, ctx.world_size, state.step, job.run.hang_timeout_s)
    with watch as state.heartbeat:
        final = _run_epochs(job, ctx, state, data, start, steps)
    summary = _summary(job, ctx, state, final, total_steps)
    summary["skipped_records"] = list(data.skipped)
    summary["reference_metrics"] = dict(data.meta.get("reference_metrics", {}))
    state.events.emit(EndEvent(summary))
    return summary


def _run_epochs(
    job: Job,
    ctx: WorkerContext,
    state: TrainState,
    data: WorkerData,
    start: Position,
    steps: tuple[int, int],
) -> dict[str, float]:
    """Train from ``start`` to the end, evaluating as configured; returns the final metrics."""
    steps_per_epoch, total_steps = steps
    final: dict[str, float] = {}
    last_epoch = start.epoch
    for epoch in range(start.epoch, job.run.epochs):
        if state.step >= total_steps:
            break
        last_epoch = state.epoch = epoch
        state.steps_into_epoch = start.steps_into_epoch if epoch == start.epoch else 0
        data.train.start_epoch(epoch, state.steps_into_epoch)
        epoch_start = time.perf_counter()
        _train_epoch(job, state, data.train, epoch, (steps_per_epoch, total_steps))
        values = state.metrics.compute("train")
        last = epoch == job.run.epochs - 1 or state.step >= total_steps
        if not last:  # the next epoch's first batches are read while this one is evaluated
            data.train.start_epoch(epoch + 1)
        if (epoch + 1) % job.run.eval_every_epochs == 0 or last:
            val = _evaluate(state, data.val, "val", ctx)
            state.events.emit(EvalEvent("val", state.step, epoch + 1, val))
            values |= val
        seconds = time.perf_counter() - epoch_start
        state.events.emit(EpochEvent(epoch + 1, job.run.epochs, state.step, values, seconds))
        final |= values
        state.latest_metrics = dict(values)
        if _epoch_checkpoint_due(job, epoch) and state.step < total_steps:
            state.save_checkpoint(epoch, steps_per_epoch, asynchronous=job.checkpoint.asynchronous)
        if state.step < total_steps and (notice := state.stop.agreed(state.strategy.device)):
            _stop_after_step(state, epoch, steps_per_epoch, notice)  # asked during evaluation
    final |= _evaluate(state, data.test, "test", ctx)
    # The final checkpoint records the test metrics, so an export can be checked against them.
    # It is synchronous, and first commits any background save still in flight.
    state.save_checkpoint(last_epoch, steps_per_epoch, metrics=final)
    if state.checkpoints is not None:
        state.checkpoints.wait()
    state.events.emit(EvalEvent("test", state.step, last_epoch + 1, final))
    return final


def _restore(job: Job, ctx: WorkerContext, state: TrainState, storage: RunStorage) -> Position:
    """Resume from the latest committed checkpoint, if checkpointing and resume are on.

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


def _epoch_checkpoint_due(job: Job, epoch: int) -> bool:
    """End-of-epoch save every ``every_epochs`` (the end of training always saves)."""
    every = job.checkpoint.every_epochs
    return every is not None and (epoch + 1) % every == 0


def _worker_data(job: Job, ctx: WorkerContext, share: DataParallelRank) -> WorkerData:
    """The launcher's prepared data (Ray Data shards), or DataLoaders built here for this
    rank's ``share`` of each batch."""
    if ctx.data is not None:
        return ctx.data
    return torch_worker_data(
        load_splits(job.data),
        job.data.batch_size,
        micro_batch(job, ctx.world_size),  # elastic launchers may start fewer workers
        job.data.eval_batch_size,
        share.size,
        share.index,
        seed=job.run.seed,
        num_workers=job.data.num_workers,
        device=ctx.device,
        stream_window=job.data.shuffle_row_groups,
        stream_readers=job.data.stream_readers,
    )


def _build_state(
    job: Job,
    ctx: WorkerContext,
    data: WorkerData,
    strategy: Strategy,
    total_steps: int,
    share: DataParallelRank,
) -> TrainState:
    shape = data.shape
    task = build_task(job.task.name, job.task.kwargs)
    model = build_model(job.model.name, job.model.kwargs, shape)
    no_decay = no_decay_names(model)
    model = strategy.wrap(prepare_blocks(model, job.strategy, job.run.compile))
    optimizer = build_optimizer(job.optim, model, no_decay, peak_lr(job.optim, job.data.batch_size))
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


def _train_epoch(
    job: Job, state: TrainState, loader: TrainBatches, epoch: int, steps: tuple[int, int]
) -> None:
    steps_per_epoch, total_steps = steps
    state.model.train()
    batches = iter(loader)
    accum = job.optim.grad_accum_steps
    for _ in range(steps_per_epoch - state.steps_into_epoch):
        if state.step >= total_steps:
            return
        if state.heartbeat:
            state.heartbeat.beat(state.step + 1, state.step)
        state.timers.clock.start()
        step_start = time.perf_counter()
        micro_batches = [next(batches) for _ in range(accum)]
        data_ready = time.perf_counter()
        if not state.throughput.counted:
            _count_flops(job, state, micro_batches[0])
            state.timers.clock.start()  # counting is not the step's time
            step_start += time.perf_counter() - data_ready
            data_ready = time.perf_counter()
        compiled = compile_seconds() if job.run.compile else 0.0
        loss_sum, global_count, forward = _optimizer_step(job, state, micro_batches)
        step_end = time.perf_counter()
        # The step's time without its compilation (paid once per shape, not per step).
        forward.discount = compile_seconds() - compiled if job.run.compile else 0.0
        state.step += 1
        state.steps_into_epoch += 1
        if state.heartbeat:
            state.heartbeat.beat(state.step, state.step)
        _record_step(state.timers, (step_start, data_ready, step_end), forward, job.data.batch_size)
        state.timers.units += global_count
        if state.step % job.run.log_every_steps == 0 or state.step == total_steps:
            _log_step(job, state, epoch, loss_sum, global_count)
        every = job.checkpoint.every_steps
        if every and state.step % every == 0 and state.step < total_steps:
            state.save_checkpoint(epoch, steps_per_epoch, asynchronous=job.checkpoint.asynchronous)
        maybe_inject(job.fault, state.step, state.rank, state.attempt, state.stop)
        if state.step < total_steps and (notice := state.stop.agreed(state.strategy.device)):
            _stop_after_step(state, epoch, steps_per_epoch, notice)


def _stop_after_step(
    state: TrainState, epoch: int, steps_per_epoch: int, notice: StopNotice
) -> NoReturn:
    """Save the step just finished (unless it is saved, or the notice leaves too little time
    to save it whole) and stop with ``StopRequested``."""
    latest = state.last_saved_step if state.last_saved_step >= 0 else None
    notice = state.stop.confirm(notice)
    if notice.relaxed:
        _save_without_the_preempted(state, epoch, steps_per_epoch, notice, latest)
    notice, too_late = _judge_notice(state, notice)
    started = time.perf_counter()
    if state.checkpoints is None:
        saved = (
            "checkpointing is off (neither checkpoint.every_steps nor every_epochs is set), "
            "so nothing was saved"
        )
    elif too_late:
        since = (
            f"the same command resumes from {checkpoint_name(latest)}, the last checkpoint"
            if latest is not None
            else "no checkpoint was saved before it, so the same command starts again"
        )
        saved = f"not saved: {too_late}; {since} (a partial save is never loaded)"
    else:
        state.save_checkpoint(epoch, steps_per_epoch)
        state.checkpoints.wait()
        left = notice.seconds_left()
        margin = f", {_seconds(left)} before the deadline" if left is not None else ""
        saved = (
            f"checkpoint {checkpoint_name(state.step)} committed in "
            f"{_seconds(time.perf_counter() - started)}{margin}; the same command resumes from it"
        )
    message = f"stopped on {describe(notice)} after step {state.step}: {saved}"
    state.events.message(f"convoy: {message}")
    resumable = state.checkpoints is not None and (not too_late or latest is not None)
    raise StopRequested(message, saved=resumable, shown=True, notice=notice)


def _save_without_the_preempted(
    state: TrainState, epoch: int, steps_per_epoch: int, notice: StopNotice, latest: int | None
) -> NoReturn:
    """Relaxed collectives (ddp under Ray): rank 0 saves the whole state alone, without a
    collective; the other ranks that stay report the checkpoint once it is committed (Ray's
    report barrier then waits for them only); the preempted ranks do nothing. None of it
    waits for a rank that may already be gone."""
    checkpoints = state.checkpoints
    name = checkpoint_name(state.step)
    already = state.last_saved_step == state.step  # saved (and reported) by its own cadence
    if state.rank == 0:
        saved = "checkpointing is off, so nothing was saved"
        if checkpoints is not None:
            started = time.perf_counter()
            state.events.message(
                f"convoy: {notice.source} (ranks {list(notice.preempted_ranks)}): rank 0 saves "
                f"step {state.step} without waiting for them (relaxed collectives)"
            )
            too_late = _too_late(state, notice)
            if too_late:
                since = checkpoint_name(latest) if latest is not None else "the start"
                saved = f"not saved: {too_late}; the restart resumes from {since}"
            else:
                state.save_checkpoint(epoch, steps_per_epoch, alone=True)
                saved = (
                    f"checkpoint {name} committed by rank 0 alone in "
                    f"{_seconds(time.perf_counter() - started)} (relaxed collectives)"
                )
        state.events.message(
            f"convoy: stopped on {describe(notice)} after step {state.step}: {saved}"
        )
    elif checkpoints is not None and not already and state.rank not in notice.preempted_ranks:
        checkpoints.report_once_committed(name, notice.deadline)
    raise StopRequested(f"stopped on {describe(notice)}", shown=True, notice=notice)


def _too_late(state: TrainState, notice: StopNotice) -> str | None:
    """Why this rank's save would not finish before the deadline, or None."""
    left = notice.seconds_left()
    needed = state.checkpoints.save_seconds if state.checkpoints is not None else None
    if state.last_saved_step == state.step or left is None or needed is None or left >= needed:
        return None
    return f"{_seconds(max(left, 0.0))} were left and the last save took {_seconds(needed)}"


def _judge_notice(state: TrainState, notice: StopNotice) -> tuple[StopNotice, str | None]:
    """The notice as the rank that got it sent it (the others know only its deadline), and
    why a save would not finish before that deadline, or None when it would or nobody knows.
    Rank 0 judges for all (every rank saves or none does); one gather, once per run."""
    verdict = _too_late(state, notice)
    own = None if notice.source.startswith("a stop requested") else notice
    gathered = all_gather_objects((own, verdict))
    sent = next((n for n, _ in gathered if n is not None), notice)
    return dataclasses.replace(sent, deadline=notice.deadline), gathered[0][1]


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 1 else f"{value:.1f} s"


def _optimizer_step(
    job: Job, state: TrainState, micro_batches: list[tuple[Any, Any]]
) -> tuple[torch.Tensor, torch.Tensor, ForwardTimer]:
    """Move the micro-batches to the device and run the one train step on them
    (``convoy.engine.step``), updating the train metrics and timing forward.

    Returns this rank's loss sum, the global count and the timer of forward (work that waits
    on no other rank under single and ddp: what straggler detection compares; read at the
    next logged step).
    """
    device = state.strategy.device
    micro_batches = [(move_to(x, device), move_to(y, device)) for x, y in micro_batches]
    hooks = _LoopHooks(job, state)
    result = train_step(state, micro_batches, state.share, job.optim.grad_clip_norm, hooks)
    return result.loss_sum, result.global_count, hooks.timer


class _LoopHooks(StepHooks):
    """The loop's view of a step: forward timed (with any injected slow-down, which is meant
    to look like slow local work), each micro-batch's outputs into the train metrics."""

    def __init__(self, job: Job, state: TrainState) -> None:
        self.job, self.state = job, state
        self.timer = ForwardTimer(state.strategy.device)

    @contextlib.contextmanager
    def forward(self, index: int) -> Iterator[None]:
        with self.timer:
            if index == 0:
                maybe_slow_down(self.job.fault, self.state.step + 1, self.state.rank)
            yield

    def micro_step_done(
        self, outputs: Any, targets: Any, loss_sum: torch.Tensor, count: torch.Tensor
    ) -> None:
        self.state.metrics.update("train", outputs, targets, loss_sum, count)


def _count_flops(job: Job, state: TrainState, batch: tuple[Any, Any]) -> None:
    """Count the training FLOPs per sample once, on a meta-device copy of the model."""
    state.throughput.counted = True
    try:
        state.throughput.flops_per_sample = count_train_flops_per_sample(
            lambda: build_model(job.model.name, job.model.kwargs, state.data_shape),
            state.task.forward,
            state.task.loss_sum,
            batch,
        )
    except Exception as exc:  # a model that cannot run on meta tensors: no FLOP/s, say why
        state.events.message(
            f"convoy: FLOPs not counted ({type(exc).__name__}: {exc}); "
            "no TFLOP/s or MFU for this run"
        )


def _record_step(
    timers: Timers, times: tuple[float, float, float], forward: ForwardTimer, batch: int
) -> None:
    """Book a step that ran from ``start`` over ``data_ready`` to ``end`` (wall clock); its
    duration is the clock's (``Timers.resolve``), less ``forward.discount`` (compilation)."""
    start, data_ready, end = times
    wait = data_ready - start
    if timers.first_step_end is None:
        timers.first_step_end = time.time()
        timers.first_batch = (wait, end - start - forward.discount)
    timers.clock.end(end - start, forward.discount)
    timers.local_work.append((wait, forward))
    timers.data_wait_seconds += wait
    timers.samples += batch
    for i, value in ((0, 1), (2, wait), (3, batch)):
        timers.interval[i] += value


def _log_step(
    job: Job, state: TrainState, epoch: int, loss_sum: torch.Tensor, global_count: torch.Tensor
) -> None:
    """Emit the step's exact mean loss over the whole global batch (all ranks), every rank's
    figures since the last logged step, and any straggler among the ranks."""
    mean_loss = float(all_reduce_sum(loss_sum.double()) / global_count)
    state.timers.resolve()  # after the loss: the device has finished the step
    lr = float(state.scheduler.get_last_lr()[0])
    ranks, rate = _rank_interval(state)
    tflops, utilization = (
        state.throughput.tflops(rate),
        state.throughput.mfu(rate, state.world_size),
    )
    on_cpu = state.strategy.device.type == "cpu"
    state.events.emit(
        StepEvent(
            step=state.step,
            epoch=epoch + 1,
            loss=mean_loss,
            lr=lr,
            ranks=ranks,
            samples_per_second=rate,
            tflops=tflops,
            mfu=utilization,
            rate=_rate(state),
            throughput_text=format_throughput(tflops, utilization, on_cpu=on_cpu),
        )
    )
    for straggler in state.stragglers.check(state.step, ranks):
        state.events.emit(straggler)


def _rank_interval(state: TrainState) -> tuple[RankStats, float]:
    """Every rank's mean step time and data wait, median local work and peak memory since
    the last logged step (one small all-gather), and the global samples/s over it."""
    steps, step_seconds, wait_seconds, samples = state.timers.interval
    # The median step's local work: one hiccup (a page fault, a busy core) is not a straggler.
    work = [wait + forward.seconds() for wait, forward in state.timers.local_work]
    local = statistics.median(work or [0.0])
    state.timers.interval, state.timers.local_work = [0.0] * 4, []
    per = max(1.0, steps)
    stats, _ = gather_rank_stats(
        step_seconds / per, wait_seconds / per, local, state.strategy.device
    )
    # The step is synchronous: the slowest rank sets the pace of all.
    return stats, samples / max(max(stats.step_seconds) * steps, 1e-9)


def _rate(state: TrainState) -> tuple[float, str]:
    """Throughput in the task's unit: samples/s, or tokens/s for language modeling."""
    seconds = max(state.timers.train_seconds, 1e-9)
    if state.task.count_name == "samples":
        return state.timers.samples / seconds, "samples"
    return float(state.timers.units) / seconds, state.task.count_name


def _evaluate(
    state: TrainState, loader: EvalBatches, split: str, ctx: WorkerContext
) -> dict[str, float]:
    return evaluate(
        state.model, state.task, loader, split, state.metrics, state.precision, ctx.device
    )


def _summary(
    job: Job, ctx: WorkerContext, state: TrainState, final: dict[str, float], total_steps: int
) -> dict[str, Any]:
    timers = state.timers
    timers.resolve()
    steady = timers.step_seconds[WARMUP_STEPS_EXCLUDED:] or timers.step_seconds
    samples_per_second = timers.samples / max(timers.train_seconds, 1e-9)
    median_step = statistics.median(steady) if steady else None
    throughput = state.throughput
    peak_memory = all_gather_objects(peak_memory_bytes(ctx.device))
    peak_reserved = all_gather_objects(peak_reserved_bytes(ctx.device))
    end = time.time()
    return {
        "run_name": job.run.name,
        "strategy": job.strategy.name,
        "tp_size": tp_size_of(job.strategy),
        "launcher": job.scaling.launcher,
        "world_size": ctx.world_size,
        "precision": job.precision,
        "steps": state.step,
        "resumed_from": state.resumed_from,
        "planned_steps": total_steps,
        "metrics": final,
        "engine_start_time": timers.start,
        "first_step_end_time": timers.first_step_end,
        "end_time": end,
        "wall_seconds": end - timers.start,
        "train_seconds": timers.train_seconds,
        "compile_seconds": compile_seconds() - timers.compiled_before if job.run.compile else None,
        "task": job.task.name,
        "samples_per_second": samples_per_second,
        f"{state.task.count_name}_per_second": _rate(state)[0],
        **_steady_rates(state, job.data.batch_size, median_step),
        "step_seconds_median": median_step,
        "step_seconds_p10": _quantile(steady, 0.1),
        "step_seconds_p90": _quantile(steady, 0.9),
        "device_name": throughput.device_name,
        "flops_per_sample": throughput.flops_per_sample,
        "tflops_per_second": throughput.tflops(samples_per_second),
        "peak_flops_per_device": throughput.peak_flops,
        "mfu": throughput.mfu(samples_per_second, ctx.world_size),
        "data_wait_fraction": timers.data_wait_seconds / max(timers.train_seconds, 1e-9),
        **_first_batch_apart(timers),
        "peak_memory_bytes_per_rank": peak_memory,
        "peak_memory_reserved_bytes_per_rank": None if None in peak_reserved else peak_reserved,
    }


def _steady_rates(state: TrainState, batch: int, median_step: float | None) -> dict[str, Any]:
    """Throughput at the median step after the warm-up (``steady_*``), beside the whole run's
    (every step, the first ones and each epoch's start included): the figure to compare with
    other trainers' step time, which a short run's whole-run rate understates."""
    if not median_step:
        return {"steady_samples_per_second": None, "steady_mfu": None}
    rate = batch / median_step
    figures: dict[str, Any] = {"steady_samples_per_second": rate}
    name = state.task.count_name
    if name != "samples" and state.timers.samples:
        units_per_sample = float(state.timers.units) / state.timers.samples
        figures[f"steady_{name}_per_second"] = rate * units_per_sample
    figures["steady_tflops_per_second"] = state.throughput.tflops(rate)
    figures["steady_mfu"] = state.throughput.mfu(rate, state.world_size)
    return figures


def _first_batch_apart(timers: Timers) -> dict[str, float | None]:
    """The first batch's wait, and the data-wait fraction of every later step."""
    if timers.first_batch is None:
        return {"first_batch_seconds": None, "data_wait_fraction_after_first": None}
    wait, step = timers.first_batch
    later = timers.train_seconds - step
    return {
        "first_batch_seconds": wait,
        "data_wait_fraction_after_first": (
            (timers.data_wait_seconds - wait) / later if later > 0 else None
        ),
    }


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (linear interpolation), None without values."""
    if not values:
        return None
    return float(np.quantile(values, q))

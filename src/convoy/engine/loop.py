"""The one training loop, for every strategy and every launcher.

``train(job, ctx)`` runs on each worker: it joins the process group if the launcher has not,
builds data, model and strategy from the job (``convoy.engine.state``), trains with
accumulation (``no_sync`` on all but the last micro-step), mixed precision, clipping and an LR
schedule (``convoy.engine.step``), evaluates on val each ``eval_every_epochs`` and on test at
the end, and returns the summary (``convoy.engine.summary``; rank 0 also writes it). After any
step the ranks may agree to stop (``convoy.engine.stop``). The loop never asks which launcher
started it; the ``WorkerContext`` is all it knows.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from convoy.batches import move_to
from convoy.checkpoint import Position, checkpoint_name
from convoy.config import DataParallelRank, Job, layout_name, micro_batch, tp_size_of
from convoy.data.loaders import EvalBatches, TrainBatches, WorkerData, torch_worker_data
from convoy.data.registry import load_splits
from convoy.distributed import (
    WorkerContext,
    all_reduce_sum,
    peak_memory_bytes,
    process_group,
    worker_threads,
)
from convoy.engine.evaluate import evaluate
from convoy.engine.events import EndEvent, EpochEvent, EvalEvent, StartEvent, StepEvent
from convoy.engine.faults import maybe_inject, maybe_slow_down, next_attempt
from convoy.engine.flops import (
    count_train_flops_per_sample,
    device_name,
    format_throughput,
    peak_flops,
)
from convoy.engine.heartbeat import hang_watch
from convoy.engine.monitor import ForwardTimer, StepClock, StragglerWatch
from convoy.engine.sinks import build_sinks
from convoy.engine.state import TrainState, build_state, restore
from convoy.engine.step import StepHooks, train_step
from convoy.engine.stop import (
    STOPPED_FILE,
    StopRequested,
    StopWatch,
    grace_period_s,
    stop_after_step,
)
from convoy.engine.summary import (
    Throughput,
    Timers,
    data_counts,
    rank_interval,
    run_summary,
    unit_rate,
)
from convoy.errors import ConfigError
from convoy.models.lora import trainable_counts
from convoy.models.registry import build_model, count_parameters
from convoy.outputs import TOKENIZER_FILE, RunOutputs
from convoy.storage import RunStorage
from convoy.strategies import Strategy, build_strategy
from convoy.strategies.base import dtype_from_name
from convoy.strategies.blocks import compile_seconds


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights without a broadcast."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    state = build_state(job, ctx, data, strategy, total_steps, share)
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
    start = restore(job, ctx, state, storage)
    state.timers.setup_peak_memory = peak_memory_bytes(ctx.device)
    data.train.start_epoch(start.epoch, start.steps_into_epoch)  # reading starts meanwhile
    sizes = data.sizes
    layout = layout_name(job.strategy.name, tp_size_of(job.strategy))
    header = (
        f"convoy: {job.model.name} ({parameter_summary(job, state.strategy.unwrap(state.model))}"
        f") | {job.data.name} via {job.data.loader}: {sizes['train']} train / "
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
    summary = run_summary(
        job,
        ctx,
        state.timers,
        state.throughput,
        state.task.count_name,
        steps=(state.step, total_steps),
        resumed_from=state.resumed_from,
        metrics=final,
    )
    summary["skipped_records"] = list(data.skipped)
    summary["reference_metrics"] = dict(data.meta.get("reference_metrics", {}))
    summary |= data_counts(data.meta)
    state.events.emit(EndEvent(summary))
    return summary


def parameter_summary(job: Job, model: torch.nn.Module) -> str:
    """The model's parameter count for the run's first line; with LoRA, what trains of it
    (the figures PEFT's ``print_trainable_parameters`` gives)."""
    if job.model.lora is None:
        return f"{count_parameters(model):,} params on rank 0"
    trainable, total = trainable_counts(model)
    return (
        f"{total:,} params, {trainable:,} trainable ({100 * trainable / total:.2f}%: LoRA r="
        f"{job.model.lora.r} on {', '.join(job.model.lora.target_modules)})"
    )


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
        _stop_if_agreed(state, epoch, steps)  # asked during evaluation
    final |= _evaluate(state, data.test, "test", ctx)
    # The final checkpoint records the test metrics, so an export can be checked against them.
    # It is synchronous, and first commits any background save still in flight.
    state.save_checkpoint(last_epoch, steps_per_epoch, metrics=final)
    if state.checkpoints is not None:
        state.checkpoints.wait()
    state.events.emit(EvalEvent("test", state.step, last_epoch + 1, final))
    return final


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


def _train_epoch(
    job: Job, state: TrainState, loader: TrainBatches, epoch: int, steps: tuple[int, int]
) -> None:
    """Train the rest of ``epoch``: each step logged, checkpointed and followed by the stop
    check as configured."""
    steps_per_epoch, total_steps = steps
    state.model.train()
    batches = iter(loader)
    for _ in range(steps_per_epoch - state.steps_into_epoch):
        if state.step >= total_steps:
            return
        loss_sum, global_count = _take_step(job, state, batches)
        if state.step % job.run.log_every_steps == 0 or state.step == total_steps:
            _log_step(job, state, epoch, loss_sum, global_count)
        every = job.checkpoint.every_steps
        if every and state.step % every == 0 and state.step < total_steps:
            state.save_checkpoint(epoch, steps_per_epoch, asynchronous=job.checkpoint.asynchronous)
        maybe_inject(job.fault, state.step, state.rank, state.attempt, state.stop)
        _stop_if_agreed(state, epoch, steps)


def _take_step(
    job: Job, state: TrainState, batches: Iterator[tuple[Any, Any]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the next global batch's micro-batches, run the train step on them and book it
    (the first step counts the FLOPs per sample first, outside its time). Returns this rank's
    loss sum and the global count."""
    if state.heartbeat:
        state.heartbeat.beat(state.step + 1, state.step)
    state.timers.clock.start()
    step_start = time.perf_counter()
    micro_batches = [next(batches) for _ in range(job.optim.grad_accum_steps)]
    data_ready = time.perf_counter()
    if not state.throughput.counted:
        _count_flops(job, state, micro_batches[0])
        state.timers.clock.start()  # counting is not the step's time
        step_start += time.perf_counter() - data_ready
        data_ready = time.perf_counter()
    compiled = compile_seconds() if job.run.compile else 0.0
    loss_sum, global_count, forward = _run_train_step(job, state, micro_batches)
    step_end = time.perf_counter()
    # The step's time without its compilation (paid once per shape, not per step).
    forward.discount = compile_seconds() - compiled if job.run.compile else 0.0
    state.step += 1
    state.steps_into_epoch += 1
    if state.heartbeat:
        state.heartbeat.beat(state.step, state.step)
    state.timers.record_step((step_start, data_ready, step_end), forward, job.data.batch_size)
    state.timers.units += global_count
    return loss_sum, global_count


def _stop_if_agreed(state: TrainState, epoch: int, steps: tuple[int, int]) -> None:
    """Before the last step, ask the ranks whether any was asked to stop (a collective, at
    the same boundaries on every rank); if so, save this step and raise ``StopRequested``."""
    steps_per_epoch, total_steps = steps
    if state.step < total_steps and (notice := state.stop.agreed(state.strategy.device)):
        stop_after_step(state, epoch, steps_per_epoch, notice, checkpoint_name)


def _run_train_step(
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


def _log_step(
    job: Job, state: TrainState, epoch: int, loss_sum: torch.Tensor, global_count: torch.Tensor
) -> None:
    """Emit the step's exact mean loss over the whole global batch (all ranks), every rank's
    figures since the last logged step, and any straggler among the ranks."""
    mean_loss = float(all_reduce_sum(loss_sum.double()) / global_count)
    state.timers.resolve()  # after the loss: the device has finished the step
    lr = float(state.scheduler.get_last_lr()[0])
    ranks, rate = rank_interval(state.timers, state.strategy.device)
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
            rate=unit_rate(state.timers, state.task.count_name),
            throughput_text=format_throughput(tflops, utilization, on_cpu=on_cpu),
        )
    )
    for straggler in state.stragglers.check(state.step, ranks):
        state.events.emit(straggler)


def _evaluate(
    state: TrainState, loader: EvalBatches, split: str, ctx: WorkerContext
) -> dict[str, float]:
    return evaluate(
        state.model, state.task, loader, split, state.metrics, state.precision, ctx.device
    )

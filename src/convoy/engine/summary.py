"""A run's timing and throughput: what each step books, the rates a logged step reports, and
the summary ``train`` returns.

``Timers`` books every step (its duration from the ``StepClock``, its data wait, the local
work straggler detection compares); ``Throughput`` holds the FLOPs a sample costs (counted
once) and the device's peak. A logged step reports the interval since the last one over all
ranks (``rank_interval``); the summary reports the whole run (``run_summary``), its steady
rates (the median step after ``WARMUP_STEPS_EXCLUDED``) beside the whole run's, and the first
batch's wait apart from the rest.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convoy.config import Job, tp_size_of
from convoy.distributed import (
    WorkerContext,
    all_gather_objects,
    peak_memory_bytes,
    peak_reserved_bytes,
)
from convoy.engine.events import RankStats
from convoy.engine.flops import mfu
from convoy.engine.monitor import ForwardTimer, StepClock, gather_rank_stats
from convoy.strategies.blocks import compile_seconds

# Steps excluded from the steady-state step time (allocator and thread-pool warm-up).
WARMUP_STEPS_EXCLUDED = 3


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
    setup_peak_memory: int = 0
    """Peak memory (bytes) when the model is built, laid out, filled or restored, before the
    first step: the set-up peak, which ``convoy plan`` plans apart from the step's."""
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

    def record_step(
        self, times: tuple[float, float, float], forward: ForwardTimer, batch: int
    ) -> None:
        """Book a step that ran from ``start`` over ``data_ready`` to ``end`` (wall clock); its
        duration is the clock's (``resolve``), less ``forward.discount`` (compilation)."""
        start, data_ready, end = times
        wait = data_ready - start
        if self.first_step_end is None:
            self.first_step_end = time.time()
            self.first_batch = (wait, end - start - forward.discount)
        self.clock.end(end - start, forward.discount)
        self.local_work.append((wait, forward))
        self.data_wait_seconds += wait
        self.samples += batch
        for i, value in ((0, 1), (2, wait), (3, batch)):
            self.interval[i] += value


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


def rank_interval(timers: Timers, device: torch.device) -> tuple[RankStats, float]:
    """Every rank's mean step time and data wait, median local work and peak memory since
    the last logged step (one small all-gather), and the global samples/s over it."""
    steps, step_seconds, wait_seconds, samples = timers.interval
    # The median step's local work: one hiccup (a page fault, a busy core) is not a straggler.
    work = [wait + forward.seconds() for wait, forward in timers.local_work]
    local = statistics.median(work or [0.0])
    timers.interval, timers.local_work = [0.0] * 4, []
    per = max(1.0, steps)
    stats, _ = gather_rank_stats(step_seconds / per, wait_seconds / per, local, device)
    # The step is synchronous: the slowest rank sets the pace of all.
    return stats, samples / max(max(stats.step_seconds) * steps, 1e-9)


def unit_rate(timers: Timers, count_name: str) -> tuple[float, str]:
    """Throughput in the task's unit (``count_name``): samples/s, or tokens/s for language
    modeling."""
    seconds = max(timers.train_seconds, 1e-9)
    if count_name == "samples":
        return timers.samples / seconds, "samples"
    return float(timers.units) / seconds, count_name


def run_summary(
    job: Job,
    ctx: WorkerContext,
    timers: Timers,
    throughput: Throughput,
    count_name: str,
    *,
    steps: tuple[int, int],
    resumed_from: str | None,
    metrics: dict[str, float],
) -> dict[str, Any]:
    """The run's summary (``summary.json``): what ran, its final ``metrics``, its timing and
    throughput. ``steps``: the steps taken and the steps planned. Gathers every rank's peak
    memory (collectives: every rank calls it)."""
    timers.resolve()
    steady = timers.step_seconds[WARMUP_STEPS_EXCLUDED:] or timers.step_seconds
    samples_per_second = timers.samples / max(timers.train_seconds, 1e-9)
    median_step = statistics.median(steady) if steady else None
    steady_rate = job.data.batch_size / median_step if median_step else None
    peak_memory = all_gather_objects(peak_memory_bytes(ctx.device))
    setup_peak = all_gather_objects(timers.setup_peak_memory)
    peak_reserved = all_gather_objects(peak_reserved_bytes(ctx.device))
    end = time.time()
    return {
        "run_name": job.run.name,
        "strategy": job.strategy.name,
        "tp_size": tp_size_of(job.strategy),
        "launcher": job.scaling.launcher,
        "world_size": ctx.world_size,
        "precision": job.precision,
        "steps": steps[0],
        "resumed_from": resumed_from,
        "planned_steps": steps[1],
        "metrics": metrics,
        "engine_start_time": timers.start,
        "first_step_end_time": timers.first_step_end,
        "end_time": end,
        "wall_seconds": end - timers.start,
        "train_seconds": timers.train_seconds,
        "compile_seconds": compile_seconds() - timers.compiled_before if job.run.compile else None,
        "task": job.task.name,
        "samples_per_second": samples_per_second,
        f"{count_name}_per_second": unit_rate(timers, count_name)[0],
        **_steady_rates(timers, throughput, count_name, steady_rate, ctx.world_size),
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
        "setup_peak_memory_bytes_per_rank": setup_peak,
        "peak_memory_reserved_bytes_per_rank": None if None in peak_reserved else peak_reserved,
    }


def data_counts(meta: dict[str, Any]) -> dict[str, Any]:
    """What the data source counted that the summary keeps beside the metrics: for ``sft``,
    ``sft_rows``, per split, the rows read, the samples kept, those cut to ``data.seq_len``,
    those left out as too long (``too_long``) or with no trained token (``untrained``), their
    tokens and trained tokens, and the rows of ``seq_len`` they fill (the figures the driver
    prints before the run, kept where a comparison of runs can read them)."""
    if "sft" not in meta:
        return {}
    return {"sft_rows": {split: dict(counts) for split, counts in meta["sft"].items()}}


def _steady_rates(
    timers: Timers, throughput: Throughput, count_name: str, rate: float | None, world_size: int
) -> dict[str, Any]:
    """Throughput at ``rate``, the global batch over the median step after the warm-up
    (``steady_*``), beside the whole run's (every step, the first ones and each epoch's start
    included): the figure to compare with other trainers' step time, which a short run's
    whole-run rate understates."""
    if rate is None:
        return {"steady_samples_per_second": None, "steady_mfu": None}
    figures: dict[str, Any] = {"steady_samples_per_second": rate}
    if count_name != "samples" and timers.samples:
        units_per_sample = float(timers.units) / timers.samples
        figures[f"steady_{count_name}_per_second"] = rate * units_per_sample
    figures["steady_tflops_per_second"] = throughput.tflops(rate)
    figures["steady_mfu"] = throughput.mfu(rate, world_size)
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

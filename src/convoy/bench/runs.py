"""Engine runs for ``bench scaling`` and ``bench compare``: launch one, read its step timing.

A benchmark run is an ordinary training run (``launcher.launch(job)``) for ``warmup + steps``
steps with every step logged and no checkpoints. What it measured is read back from the run
directory: the step records of ``metrics.jsonl`` (loss, and each rank's step time) and
``summary.json``. A step's time is its slowest rank's (``max`` of ``rank_step_seconds``): the
ranks wait for each other at every collective, so the slowest sets the pace. Runs written
before step records carried per-rank times fall back to the interval between consecutive
step records on rank 0 (which also holds the logging), and say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from convoy.bench.common import spread
from convoy.config import Job, load_job
from convoy.distributed import default_threads
from convoy.errors import ConfigError
from convoy.launchers import get_launcher
from convoy.outputs import read_metrics
from convoy.tasks import resolve_task

RANK_TIMING = "slowest rank's step time (max of rank_step_seconds)"
RECORD_TIMING = "interval between step records on rank 0 (no rank_step_seconds in this run)"
# Large enough that run.max_steps, not the epoch count, ends every benchmark run.
MANY_EPOCHS = 1_000_000


def engine_overrides(storage: str, name: str, workers: int, steps: int, warmup: int) -> list[str]:
    """What every benchmark run sets: its size, its length, every step logged, no
    checkpoints, no progress output, and epochs/eval out of the way of ``max_steps``."""
    return [
        f"scaling.num_workers={workers}",
        f"run.max_steps={warmup + steps}",
        f"run.epochs={MANY_EPOCHS}",
        f"run.eval_every_epochs={MANY_EPOCHS}",
        "run.log_every_steps=1",
        "run.progress=off",
        "checkpoint.every_steps=null",
        "checkpoint.every_epochs=null",
        "checkpoint.resume=false",
        f"run.storage_dir={storage}",
        f"run.name={name}",
    ]


def pinned_threads(job: Job, largest: int) -> list[str]:
    """Hold torch's threads per worker fixed across sizes (unless the user set them).

    Under ``local`` and ``torchrun`` a worker's default is the node's CPUs split between its
    workers, so 1 worker would get every core and N workers 1/N each: the sizes would not be
    like for like. The count the largest size gets on a node is used for every size. Under
    Ray a worker's threads follow its ``cpus_per_worker``, the same at every size.
    """
    if job.scaling.threads_per_worker is not None:
        return []
    scaling = job.scaling.model_copy(update={"num_workers": largest})
    try:
        per_node = scaling.launcher_section.workers_per_node(scaling)
    except ConfigError:  # bench_job refuses this size, naming the flag
        return []
    if per_node is None:  # placed by the cluster (Ray): threads follow cpus_per_worker
        return []
    return [f"scaling.threads_per_worker={default_threads(per_node)}"]


# The fields a benchmark sets from its --workers flag: an error about them is about the flag.
WORKER_FIELDS = ("scaling.num_workers", "data.batch_size")


def bench_job(
    recipe: str | None,
    overrides: list[str],
    extra: list[str],
    flag: tuple[str, Any] | None = None,
) -> Job:
    """The recipe with the user's overrides, then the benchmark's own (which win).

    ``flag`` is the command-line option (name, value) that set the world size: a refusal of
    ``scaling.num_workers`` or of the batch split (the local launcher's one worker, a batch
    N does not divide) names it, since the user typed that, not the field."""
    try:
        return load_job(recipe, [*overrides, *extra])
    except ConfigError as exc:
        if flag is None or exc.field not in WORKER_FIELDS:
            raise
        raise ConfigError(flag[0], flag[1], f"{exc.field} = {exc.value}: {exc.allowed}") from None


@dataclass
class Measured:
    """What one run measured over its timed steps (warm-up excluded)."""

    name: str
    world_size: int
    global_batch: int
    count_name: str
    """samples, or tokens for language modeling."""
    step_seconds: list[float]
    count_per_step: float
    """The task's count (samples or tokens) in one global batch."""
    losses: list[float]
    """``train/loss`` of every step, warm-up included."""
    timing: str
    summary: dict[str, Any] = field(repr=False)

    @property
    def throughput(self) -> float:
        """Global count (samples or tokens) per second over the timed steps."""
        return self.count_per_step * len(self.step_seconds) / max(sum(self.step_seconds), 1e-12)

    @property
    def samples_per_second(self) -> float:
        return self.global_batch * len(self.step_seconds) / max(sum(self.step_seconds), 1e-12)

    def row(self) -> dict[str, Any]:
        """The JSON fields every benchmark reports for a run."""
        times = spread(self.step_seconds) if self.step_seconds else {}
        return {
            "run": self.name,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "timed_steps": len(self.step_seconds),
            "step_seconds": times,
            "samples_per_second": self.samples_per_second,
            f"{self.count_name}_per_second": self.throughput,
            "timing": self.timing,
        }


def launch_and_measure(job: Job, warmup: int) -> Measured:
    """Train ``job`` on its launcher; measure the steps after the first ``warmup``."""
    result = get_launcher(job.scaling.launcher).launch(job)
    records = [r for r in read_metrics(result.run_uri) if r.get("kind") == "step"]
    records.sort(key=lambda r: r["step"])
    times, timing = step_times(records, warmup)
    summary = result.summary
    count_name = resolve_task(job.task.name).count_name
    return Measured(
        name=job.run.name or "",
        world_size=int(summary["world_size"]),
        global_batch=job.data.batch_size,
        count_name=count_name,
        step_seconds=times,
        count_per_step=job.data.batch_size * count_per_sample(summary, count_name),
        losses=[float(r["train/loss"]) for r in records],
        timing=timing,
        summary=summary,
    )


def step_times(records: list[dict[str, Any]], warmup: int) -> tuple[list[float], str]:
    """Per-step seconds of the steps after ``warmup`` (records logged every step), and how
    they were measured."""
    if records and all("rank_step_seconds" in r for r in records):
        return [max(r["rank_step_seconds"]) for r in records if r["step"] > warmup], RANK_TIMING
    by_step = {r["step"]: r["time"] for r in records}
    times = [
        by_step[s] - by_step[s - 1] for s in sorted(by_step) if s > warmup and s - 1 in by_step
    ]
    return times, RECORD_TIMING


def count_per_sample(summary: dict[str, Any], count_name: str) -> float:
    """The task's count per sample (1 for samples; tokens per sequence from the summary's two
    rates, which share one denominator)."""
    if count_name == "samples":
        return 1.0
    return float(summary[f"{count_name}_per_second"]) / max(summary["samples_per_second"], 1e-12)


def device_label(job: Job, summary: dict[str, Any]) -> tuple[str, str]:
    """(backend, device) of a run: gloo on CPU, NCCL on GPU."""
    backend = "nccl" if job.scaling.use_gpu else "gloo"
    return backend, str(summary.get("device_name") or ("cuda" if job.scaling.use_gpu else "cpu"))

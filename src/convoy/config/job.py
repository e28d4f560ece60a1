"""The whole job: ``Job``, its sections, and the checks that span them.

A check that needs one section lives with that section (a validator); one that asks a
strategy or a launcher is asked of its section class (``StrategySection``,
``LauncherSection``); the ones here tie sections together: the global batch against the
workers, and ``check_job``, run once the whole job is known.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from convoy.config.base import Section
from convoy.config.k8s import K8sConfig
from convoy.config.run import (
    CheckpointConfig,
    FaultConfig,
    LightningConfig,
    MonitorConfig,
    RunConfig,
    TrackingConfig,
)
from convoy.config.scaling import LAUNCHER_MODELS, ScalingConfig, world_sizes
from convoy.config.strategy import DDPStrategyConfig, StrategyConfig, check_strategy_workers
from convoy.config.training import DataConfig, ModelConfig, OptimConfig, TaskConfig
from convoy.errors import ConfigError


class Job(Section):
    """A whole training job."""

    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    strategy: StrategyConfig = Field(default_factory=DDPStrategyConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    lightning: LightningConfig = Field(default_factory=LightningConfig)
    k8s: K8sConfig = Field(default_factory=K8sConfig)

    @model_validator(mode="after")
    def _check_across_sections(self) -> Job:
        # Frozen, but still being built: the one place a section is filled from another.
        object.__setattr__(self, "data", resolve_data(self))
        check_job(self)
        return self

    @property
    def data_from_driver(self) -> bool:
        """Whether the launcher builds the data loader in the driver and streams it into the
        workers (``data.loader: ray_data`` under ray), else each worker builds torch's
        DataLoader: the one place the loader is chosen, asked of the launcher."""
        return self.scaling.launcher_section.builds_in_driver(self.data.loader)

    @property
    def run_uri(self) -> str:
        """``<storage_dir>/<name>``: an absolute local path or an ``s3://`` URI (launchers name
        unnamed runs first)."""
        name = self.run.name or "unnamed"
        if self.run.storage_dir.startswith("s3://"):
            return f"{self.run.storage_dir.rstrip('/')}/{name}"
        return str(Path(self.run.storage_dir).expanduser().resolve() / name)

    @property
    def run_dir(self) -> Path:
        """The run directory on this machine's file system; for local storage only."""
        if self.run.storage_dir.startswith("s3://"):
            raise ValueError(f"run.storage_dir: {self.run.storage_dir!r} is not a local path")
        return Path(self.run_uri)


TASK_TARGETS = {"language_modeling": "next_token", "classification": "class", "regression": "value"}
"""``data.target`` of an ``hf_dataset`` for each built-in task."""


def resolve_data(job: Job) -> DataConfig:
    """``job.data`` with what the other sections decide filled in (``convoy config show``
    prints it): the folder of ``data.tokenizer: model`` (``model.kwargs.path`` of an ``hf``
    model) and an ``hf_dataset``'s ``data.target`` (from ``task.name``)."""
    data, filled = job.data, dict[str, Any]()
    if data.tokenizer == "model" and data.tokenizer_path is None:
        filled["tokenizer_path"] = model_folder(job)
    if data.name == "hf_dataset" and data.target is None and job.task.name in TASK_TARGETS:
        filled["target"] = TASK_TARGETS[job.task.name]
    return data.model_copy(update=filled) if filled else data


def model_folder(job: Job) -> str:
    """The folder whose tokenizer ``data.tokenizer: model`` reads: an ``hf`` model's
    ``model.kwargs.path``; a ``ConfigError`` on ``data.tokenizer`` where there is none."""
    path = job.model.kwargs.get("path") if job.model.name == "hf" else None
    if isinstance(path, str) and path:
        return path
    why = (
        "the hf model is given by model.kwargs.config, with no folder"
        if job.model.name == "hf"
        else f"model.name is {job.model.name!r}"
    )
    raise ConfigError(
        "data.tokenizer",
        "model",
        f"reads the tokenizer in the folder of model.name: hf (model.kwargs.path), and {why}; "
        "set data.tokenizer_path to a folder with tokenizer files, or use data.tokenizer: bpe "
        "or bytes",
    )


def split_batch(batch: int, world_size: int, accum_steps: int) -> int | None:
    """The one rule for splitting a global batch: each of ``world_size`` ranks runs
    ``accum_steps`` forwards of ``batch / (world_size x accum_steps)`` samples. None where
    that does not divide evenly (a step's batch must never change with the split)."""
    parts = world_size * accum_steps
    return None if batch % parts else batch // parts


def micro_batch(job: Job, world_size: int) -> int:
    """Samples per rank per forward of ``job`` on ``world_size`` ranks (``split_batch``).
    Raises ``ConfigError`` where the global batch does not split: an elastic launcher may
    start fewer workers than the config names, and a plan may ask about any world size."""
    accum = job.optim.grad_accum_steps
    shares = job.strategy.data_parallel_size(world_size)
    rows = split_batch(job.data.batch_size, shares, accum)
    if rows is None:
        raise ConfigError(
            "data.batch_size",
            job.data.batch_size,
            f"must divide by data-parallel ranks x optim.grad_accum_steps = {shares} x {accum}",
        )
    return rows


def check_batch_split(job: Job) -> None:
    """The global batch must split evenly over workers x accumulation at every world size the
    run may have (``world_sizes``), so a step's batch never changes."""
    sizes = [job.strategy.data_parallel_size(n) for n in world_sizes(job.scaling)]
    accum, batch = job.optim.grad_accum_steps, job.data.batch_size
    uneven = [n for n in sizes if split_batch(batch, n, accum) is None]
    if not uneven:
        return
    if not job.scaling.elastic:
        ranks = (
            "scaling.num_workers / strategy.tp_size"
            if job.strategy.data_parallel_size(job.scaling.max_workers) < job.scaling.max_workers
            else "scaling.num_workers"
        )
        raise ConfigError(
            "data.batch_size",
            batch,
            f"the global batch must be divisible by {ranks} x "
            f"optim.grad_accum_steps = {uneven[0]} x {accum} = {uneven[0] * accum}",
        )
    fits = math.lcm(*(n * accum for n in sizes))
    raise ConfigError(
        "data.batch_size",
        batch,
        f"an elastic run keeps its global batch at every world size in scaling.num_workers "
        f"{job.scaling.worker_bounds}, but {batch} does not split over "
        f"{', '.join(map(str, uneven))} worker(s) x {accum} accumulation step(s); use a "
        f"multiple of {fits}, or narrow the range",
    )


def check_job(job: Job) -> None:
    """Checks that need more than one section, in the order a user meets them. Raises
    ``ConfigError``."""
    scaling, launcher = job.scaling, job.scaling.launcher_section
    workers = scaling.max_workers
    check_batch_split(job)
    launcher.check_layout(scaling)
    _check_precision(job)
    check_strategy_workers(
        job.strategy, workers, scaling.worker_bounds if scaling.elastic else workers
    )
    job.strategy.check_layout(world_sizes(scaling), launcher.workers_per_node(scaling))
    _check_fault_rank(job)
    _check_relaxed_collectives(job)
    _check_stop_notice(job)
    launcher.check_checkpoint(job.checkpoint)
    check_loader(job)
    launcher.check_workers(scaling)


def _check_precision(job: Job) -> None:
    if job.precision == "fp16" and not job.scaling.use_gpu:
        raise ConfigError(
            "precision",
            "fp16",
            "fp16 with a grad scaler needs a GPU (scaling.use_gpu: true); on CPU use 'bf16' or 'fp32'",
        )


def _check_fault_rank(job: Job) -> None:
    """The injected fault hits a rank the run has."""
    workers = job.scaling.max_workers
    if job.fault.kind != "none" and job.fault.rank >= workers:
        raise ConfigError("fault.rank", job.fault.rank, f"ranks are 0..{workers - 1}")


def _check_stop_notice(job: Job) -> None:
    """An injected stop notice is acted on."""
    if job.fault.kind == "preempt" and not job.run.stop_on_signal:
        raise ConfigError(
            "fault.kind",
            "preempt",
            "a stop notice needs run.stop_on_signal: true (with false, notices are ignored)",
        )


def _check_relaxed_collectives(job: Job) -> None:
    """Relaxed collectives are Ray Train's, and need every rank to hold the whole model."""
    if not job.scaling.relax_collectives_on_preemption:
        return
    field = "scaling.relax_collectives_on_preemption"
    if not job.scaling.launcher_section.runs_ray_train:
        raise ConfigError(field, True, "an option of scaling.launcher 'ray' (Ray Train's)")
    if job.strategy.shards_model_state:
        raise ConfigError(
            field,
            True,
            f"needs every rank to hold the whole model and optimizer (ddp), so one rank can "
            f"save them alone; strategy '{job.strategy.name}' shards them",
        )
    if not job.run.stop_on_signal:
        raise ConfigError(field, True, "acts on preemption notices: needs run.stop_on_signal: true")


def check_loader(job: Job) -> None:
    """``data.loader`` against the launcher: its own limits first (asked of the launcher
    that builds it in the driver, whichever the job names), then whether the job's launcher
    takes it."""
    loader, launcher = job.data.loader, job.scaling.launcher_section
    for model in LAUNCHER_MODELS.values():
        model.check_driver_loader(loader, job.scaling, job.strategy)
    if launcher.takes_loader(loader):
        return
    takers = [model for model in LAUNCHER_MODELS.values() if model.takes_loader(loader)]
    reason = " ".join(model.driver_loader_reason for model in takers if model.driver_loader_reason)
    raise ConfigError(
        "data.loader",
        loader,
        f"{reason or loader}, so it needs scaling.launcher: "
        f"{' or '.join(model.name for model in takers)} (got {launcher.name!r}); "
        f"use data.loader: {launcher.loaders[0]} with that launcher",
    )

"""The ``Launcher`` interface: decide where workers run, start them, return the result.

Launchers are the boundary with the outside world: they read the environment (``RAY_ADDRESS``,
torchrun's variables) and translate it into a ``WorkerContext`` for the engine. Everything
that can be checked before a worker starts (GPUs, cluster resources) is checked here.
"""

from __future__ import annotations

import importlib
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from convoy.config import Job, LauncherSection
from convoy.distributed import WorkerContext
from convoy.errors import ConfigError, ResourceError
from convoy.storage import check_writable_dir, is_remote


@dataclass(frozen=True)
class RunResult:
    """Where a finished run lives and its summary (see ``convoy.outputs``)."""

    run_uri: str
    """The run directory: an absolute local path or an ``s3://`` URI."""
    summary: dict[str, Any]

    @property
    def run_dir(self) -> Path:
        """The run directory on this machine (local storage only)."""
        if is_remote(self.run_uri):
            raise ValueError(f"the run is stored at {self.run_uri}, not on a local path")
        return Path(self.run_uri)


@dataclass(frozen=True)
class WorkerEntry:
    """What every worker runs: ``target(job, ctx, **kwargs)``, by import path.

    The default is the training engine. Benchmarks name their own function, so they run on
    exactly the workers, process groups and nodes a training run gets. The target returns
    the run's summary; rank 0 writes it to ``summary.json`` (``RunOutputs.write_summary``),
    which is what ``RunResult.summary`` holds. ``kwargs`` must be JSON values: torchrun's
    workers receive them on their command line, Ray's in the train loop config.
    """

    target: str = "convoy.engine.loop:train"
    """``package.module:function``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    preflight: bool = True
    """Check the job's task, model and data before launching (an entry that uses none of
    them, such as the all-reduce benchmark, skips it)."""

    def function(self) -> Callable[..., dict[str, Any]]:
        module, _, name = self.target.partition(":")
        function: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), name)
        return function

    def run(self, job: Job, ctx: WorkerContext) -> dict[str, Any]:
        """Run the target on this worker; returns its summary."""
        return self.function()(job, ctx, **self.kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "kwargs": self.kwargs, "preflight": self.preflight}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> WorkerEntry:
        return cls(**value)


TRAIN = WorkerEntry()
LIGHTNING = WorkerEntry("convoy.integrations.lightning:train_lightning")
"""A recipe with a ``lightning:`` section: the user's LightningModule under Lightning's Trainer."""


def default_entry(job: Job) -> WorkerEntry:
    """What ``convoy train`` runs for ``job``: the engine, or the Lightning entry."""
    return LIGHTNING if job.lightning.enabled else TRAIN


class Launcher(ABC):
    """Base class: check a job, then start its workers. The launcher's facts that the schema
    and the rest of Convoy ask (worker counts and layouts, the loaders it takes and builds,
    its checks before start) are its config model's (``convoy.config.scaling``), so that a
    recipe loads without importing any launcher."""

    name: ClassVar[str]
    config_model: ClassVar[type[LauncherSection]]
    """The launcher's section class in ``convoy.config`` (``job.scaling.launcher_section``)."""

    def launch(self, job: Job, entry: WorkerEntry = TRAIN) -> RunResult:
        """Check where the run writes (``check_run_location``) and ``job`` itself
        (``convoy.preflight``), fix its run directory, and run ``entry`` (the training engine
        unless told otherwise) to completion on this launcher's workers. A job with a
        ``lightning:`` section trains with the Lightning entry instead."""
        check_run_location(job)
        return self.start(*self.check(job, entry))

    def check(self, job: Job, entry: WorkerEntry = TRAIN) -> tuple[Job, WorkerEntry]:
        """``launch``'s checks of the job, in the driver before any worker starts: the job as
        it will run (preflight's resolved settings, its run directory fixed) and the entry
        for it. Where the run writes is checked before, by ``check_run_location``."""
        from convoy.preflight import preflight

        if entry == TRAIN:
            entry = default_entry(job)
        checked = preflight(job) if entry.preflight else job
        return resolve_run(checked), entry

    @abstractmethod
    def start(self, job: Job, entry: WorkerEntry = TRAIN) -> RunResult:
        """Run ``entry`` for a checked job whose run directory is resolved (``resolve_run``)."""


def resolve_run(job: Job) -> Job:
    """Fix the run's directory in the driver: an absolute storage path and a unique name.

    Unnamed runs get ``<model>-<data>-<strategy>-<timestamp>-<id>``: the short random id keeps
    two runs started in the same second apart (and from resuming each other). Resolved once
    here so every worker (whatever its working directory: Ray's workers run elsewhere) and
    every restart agree on the directory.
    """
    storage_dir = job.run.storage_dir
    updates: dict[str, str] = {
        "storage_dir": storage_dir if is_remote(storage_dir) else str(job.run_dir.parent)
    }
    if job.run.name is None:
        # A user factory's path names the run by its function: pkg.models:net -> net; a
        # Lightning run by its module and datamodule classes.
        named = (job.model.name, job.data.name)
        if job.lightning.enabled:
            named = (job.lightning.module or "", job.lightning.datamodule or "module_data")
        model, data = (re.sub(r"[^A-Za-z0-9_]+", "_", name.rpartition(":")[2]) for name in named)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        updates["name"] = f"{model}-{data}-{job.strategy.name}-{stamp}-{secrets.token_hex(3)}"
    return with_absolute_paths(job.model_copy(update={"run": job.run.model_copy(update=updates)}))


def with_absolute_paths(job: Job) -> Job:
    """``job`` with the recipe's relative local paths made absolute against the directory
    the command runs in: ``data.path``, ``data.tokenizer_path`` and an ``hf`` model's
    ``model.kwargs.path``. Ray's workers run in another directory."""

    def absolute(value: Any) -> Any:
        if not isinstance(value, str) or not value or is_remote(value):
            return value
        return str(Path(value).expanduser().absolute())

    data = {key: absolute(getattr(job.data, key)) for key in ("path", "tokenizer_path")}
    kwargs = dict(job.model.kwargs)
    if job.model.name == "hf" and "path" in kwargs:
        kwargs["path"] = absolute(kwargs["path"])
    return job.model_copy(
        update={
            "data": job.data.model_copy(update=data),
            "model": job.model.model_copy(update={"kwargs": kwargs}),
        }
    )


def check_run_location(job: Job) -> None:
    """Refuse a local run directory that cannot be one, in one line: ``run.storage_dir`` or
    ``<run.storage_dir>/<run.name>`` a file, or a folder that cannot be created or written.

    Creates and touches nothing, and takes a few file-system calls, so launchers run it
    first: before the checks that build the model and data, and before a private Ray starts.
    Without it, rank 0's first write fails as a traceback. ``s3://`` is not checked here.
    """
    check_writable_dir(job.run.storage_dir, "run.storage_dir")
    check_run_dir(job)


def check_run_dir(job: Job) -> None:
    """Refuse a named run whose local directory (``<run.storage_dir>/<run.name>``) is a file
    or cannot be created or written; an existing folder (a run to resume) passes. Creates
    and touches nothing. An unnamed run gets a fresh name of its own (``resolve_run``)."""
    if job.run.name is None or is_remote(job.run_uri):
        return
    run_dir = job.run_dir
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(
            "run.name",
            job.run.name,
            f"the run's directory {run_dir} is a file, not a folder; choose another run.name "
            "or move that file away",
        )
    check_writable_dir(str(run_dir), "run.name", job.run.name)


def check_local_gpus(job: Job, workers_on_this_node: int) -> None:
    """Fail before starting when GPUs are requested but this machine cannot supply them."""
    if not job.scaling.use_gpu:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < workers_on_this_node:
        raise ResourceError(
            f"scaling.use_gpu: got true with {workers_on_this_node} worker(s) on this machine, "
            f"but it has {available} CUDA device(s); set scaling.use_gpu=false or use fewer workers"
        )


def local_device(job: Job, local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if job.scaling.use_gpu else torch.device("cpu")


def check_shared_storage(job: Job, nodes: int, where: str) -> None:
    """Refuse a local run directory when workers may sit on several nodes.

    Each node would write its own shards into its own disk, and no node could read a
    complete checkpoint back. ``run.shared_storage: true`` says the path is a filesystem every
    node mounts at the same place (NFS, EFS, a Kubernetes PVC); ``s3://`` needs nothing.
    """
    if nodes <= 1 or is_remote(job.run.storage_dir) or job.run.shared_storage:
        return
    raise ConfigError(
        "run.storage_dir",
        job.run.storage_dir,
        f"workers may run on {nodes} nodes ({where}), and a local path on one node is not "
        "seen by the others; use s3://bucket/prefix, or a path every node mounts at the same "
        "place and run.shared_storage: true",
    )

"""What runs on every Ray Train worker: the worker context built from Ray's (rank, device,
CPUs, the latest checkpoint, preemption notices, report sinks), the job's entry run in it,
and each committed checkpoint registered with Ray Train.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from convoy.config import Job, job_from_dict
from convoy.data.ray_data_worker import ray_worker_data
from convoy.distributed import WorkerContext
from convoy.engine.stop import StopRequested
from convoy.integrations.prometheus import PrometheusSink
from convoy.integrations.ray_train import RayTrainReportSink
from convoy.launchers.base import WorkerEntry
from convoy.launchers.ray_local import (
    enter_own_session,
    prometheus_enabled,
    quiet_ray_loggers,
    set_process_niceness,
)
from convoy.launchers.ray_preemption import RayPreemptionNotices, wait_for_preemption
from convoy.launchers.ray_stop import DriverStopReader, from_driver


def ray_worker_main(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker: build the context from Ray's, run the entry."""
    import ray
    import ray.train
    from ray.train.torch import get_device

    quiet_ray_loggers()
    job = job_from_dict(config["job"])
    context = ray.train.get_context()
    refused = set_process_niceness(config["niceness"])
    if refused and context.get_world_rank() == 0:
        print(f"convoy: train workers keep Ray's priority: {refused}", flush=True)
    not_moved = enter_own_session()
    if not_moved and context.get_world_rank() == 0:
        print(f"convoy: {not_moved}", flush=True)
    reports = RayTrainReportSink()
    ctx = WorkerContext(
        rank=context.get_world_rank(),
        local_rank=context.get_local_rank(),
        world_size=context.get_world_size(),
        local_world_size=context.get_local_world_size(),
        device=get_device() if job.scaling.use_gpu else torch.device("cpu"),
        cpus=ray.get_runtime_context().get_assigned_resources().get("CPU"),
        checkpoint_reporter=functools.partial(report_checkpoint, job, reports),
        resume_from=_ray_latest_checkpoint(),
        stop_notices=RayPreemptionNotices(
            job.scaling.relax_collectives_on_preemption, DriverStopReader(config.get("stop_key"))
        ),
        sinks=(reports, *_prometheus_sinks(job, context.get_world_rank())),
    )
    if "ray_data" in config:
        data = ray_worker_data(job, config["ray_data"], ctx.rank, ctx.world_size)
        ctx = dataclasses.replace(ctx, data=data)
    try:
        summary = WorkerEntry.from_dict(config["entry"]).run(job, ctx)
    except StopRequested as stopped:
        if from_driver(stopped.notice):
            return  # saved and said; the driver, which asked, ends the run as stopped
        wait_for_preemption(stopped, ctx.rank)
    # The last report: the run's final metrics (rank 0's copy reaches Result.metrics).
    reports.finish(dict(summary.get("metrics", {})))


def _prometheus_sinks(job: Job, rank: int) -> tuple[Any, ...]:
    if not prometheus_enabled(job):
        return ()
    return (PrometheusSink(job.run.name or "unnamed", rank),)


def report_checkpoint(
    job: Job, reports: Any, relative_path: str, metrics: dict[str, float]
) -> None:
    """Register a committed checkpoint with Ray Train (every rank calls this once per save).

    Convoy has already written every rank's shards and the commit marker into the run
    directory, which is Ray's experiment directory, so Ray uploads nothing (``NO_UPLOAD``); it
    records the checkpoint (``Result.checkpoint``, ``get_checkpoint()`` on a restart) and
    applies the retention of ``checkpoint_config`` (``convoy.launchers.ray``). Reporting only
    after the commit keeps Ray from deleting an older checkpoint before the newer one is
    complete.
    """
    import ray.train
    from ray.train import Checkpoint

    storage = ray.train.get_context().get_storage()
    checkpoint = Checkpoint(
        path=f"{storage.experiment_fs_path}/{relative_path}",
        filesystem=storage.storage_filesystem,
    )
    score = job.checkpoint.best_metric
    # A checkpoint without the ranking metric (saved before the first evaluation) ranks last.
    worst = float("inf") if job.checkpoint.best_mode == "min" else float("-inf")
    reports.report_checkpoint(
        {**metrics, score: metrics.get(score, worst), "checkpoint": relative_path}, checkpoint
    )


def _ray_latest_checkpoint() -> str | None:
    """Ray Train's latest registered checkpoint, relative to the run directory."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    storage = ray.train.get_context().get_storage()
    prefix = storage.experiment_fs_path.rstrip("/") + "/"
    path = str(checkpoint.path)
    return path[len(prefix) :] if path.startswith(prefix) else path

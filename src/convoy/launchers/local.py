"""``local``: the engine in this process, world size 1.

Strategies that need a process group (ddp, fsdp, fsdp2) get a one-rank gloo/nccl group on a
free loopback port, so every strategy can be debugged in-process.
"""

from __future__ import annotations

from convoy.config import Job, LocalLauncherConfig
from convoy.distributed import WorkerContext, free_port
from convoy.launchers.base import (
    TRAIN,
    Launcher,
    RunResult,
    WorkerEntry,
    check_local_gpus,
    local_device,
)
from convoy.outputs import write_config


class LocalLauncher(Launcher):
    name = "local"
    config_model = LocalLauncherConfig

    def start(self, job: Job, entry: WorkerEntry = TRAIN) -> RunResult:
        check_local_gpus(job, workers_on_this_node=1)
        storage = write_config(job)
        ctx = WorkerContext(
            device=local_device(job, 0), init_method=f"tcp://127.0.0.1:{free_port()}"
        )
        return RunResult(storage.uri, entry.run(job, ctx))

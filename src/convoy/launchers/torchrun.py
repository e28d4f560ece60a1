"""``torchrun``: the vanilla PyTorch baseline.

The driver writes the resolved config into the run directory and spawns
``python -m torch.distributed.run ... -m convoy.launchers.torchrun <config.yaml>``; each worker
(this module's ``__main__``) reads torchrun's environment once and runs the engine. Elastic
``nnodes: MIN:MAX``, c10d rendezvous and ``--max-restarts`` (from ``scaling.max_failures``)
come straight from the config.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from convoy.config import Job, job_to_yaml, load_job
from convoy.distributed import WorkerContext, exit_without_teardown, free_port
from convoy.errors import ConfigError, LaunchError
from convoy.launchers.base import Launcher, RunResult, check_local_gpus, local_device
from convoy.outputs import CONFIG_FILE, read_summary, write_config


def nodes_range(nnodes: str) -> tuple[int, int]:
    """Parse ``"2"`` or ``"1:4"`` into (min, max) nodes."""
    try:
        low, _, high = nnodes.partition(":")
        bounds = int(low), int(high or low)
    except ValueError:
        bounds = (0, 0)
    if not 0 < bounds[0] <= bounds[1]:
        raise ConfigError(
            "scaling.torchrun.nnodes", nnodes, "expected N or MIN:MAX with 0 < MIN <= MAX"
        )
    return bounds


def procs_per_node(job: Job) -> int:
    """Workers per node: ``scaling.num_workers`` spread over the (maximum) node count."""
    _, max_nodes = nodes_range(job.scaling.torchrun.nnodes)
    if job.scaling.num_workers % max_nodes:
        raise ConfigError(
            "scaling.num_workers",
            job.scaling.num_workers,
            f"must be a multiple of the node count {max_nodes} (scaling.torchrun.nnodes)",
        )
    return job.scaling.num_workers // max_nodes


def torchrun_command(job: Job, config_path: Path) -> list[str]:
    """The torchrun command line for ``job`` (public so tests and docs can show it)."""
    opts = job.scaling.torchrun
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={opts.nnodes}",
        f"--nproc-per-node={procs_per_node(job)}",
        f"--max-restarts={job.scaling.max_failures}",
        f"--rdzv-backend={opts.rdzv_backend}",
        f"--rdzv-endpoint={opts.rdzv_endpoint or f'127.0.0.1:{free_port()}'}",
        f"--rdzv-id={opts.rdzv_id or job.run.name}",
    ]
    if opts.node_rank is not None:
        command.append(f"--node-rank={opts.node_rank}")
    return [*command, "-m", "convoy.launchers.torchrun", str(config_path)]


class TorchrunLauncher(Launcher):
    name = "torchrun"

    def start(self, job: Job) -> RunResult:
        check_local_gpus(job, workers_on_this_node=procs_per_node(job))
        storage = write_config(job)
        with tempfile.TemporaryDirectory(prefix="convoy-torchrun-") as scratch:
            # Workers read the resolved config from a local file, wherever the run is stored.
            config_path = Path(scratch) / CONFIG_FILE
            config_path.write_text(job_to_yaml(job))
            returncode = subprocess.call(torchrun_command(job, config_path))
        if returncode != 0:
            raise LaunchError(
                f"torchrun exited with code {returncode}; the workers' output is above"
            )
        return RunResult(storage.uri, read_summary(storage.uri))


def worker_context_from_env(job: Job) -> WorkerContext:
    """torchrun's contract: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT."""
    local_rank = int(os.environ["LOCAL_RANK"])
    return WorkerContext(
        rank=int(os.environ["RANK"]),
        local_rank=local_rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
        device=local_device(job, local_rank),
        init_method="env://",
        store_namespace=f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
    )


def worker_main(argv: list[str]) -> None:
    from convoy.engine.loop import train

    job = load_job(argv[0])
    try:
        train(job, worker_context_from_env(job))
    except BaseException:
        # Fail fast: peers blocked in a collective see the connection drop at once.
        traceback.print_exc()
        exit_without_teardown(1)
    exit_without_teardown()


if __name__ == "__main__":
    worker_main(sys.argv[1:])

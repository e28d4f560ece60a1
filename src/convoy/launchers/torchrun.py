"""``torchrun``: the vanilla PyTorch baseline.

The driver writes the resolved config into the run directory and spawns
``python -m torch.distributed.run ... -m convoy.launchers.torchrun <config.yaml>``; each worker
(this module's ``__main__``) reads torchrun's environment once and runs the engine. Elastic
``nnodes: MIN:MAX``, c10d rendezvous and ``--max-restarts`` (from ``scaling.max_failures``)
come straight from the config.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from convoy.config import (
    Job,
    TorchrunConfig,
    job_to_yaml,
    load_job,
    nodes_range,
    torchrun_layout,
)
from convoy.distributed import WorkerContext, exit_without_teardown
from convoy.engine.stop import STOPPED_EXIT_CODE, STOPPED_FILE, StopRequested, forwarded_to
from convoy.errors import ConfigError, LaunchError
from convoy.launchers.base import (
    TRAIN,
    Launcher,
    RunResult,
    WorkerEntry,
    check_local_gpus,
    check_shared_storage,
    local_device,
)
from convoy.network import address_towards, interface_with_address, socket_interface_env
from convoy.outputs import CONFIG_FILE, read_summary, write_config


def procs_per_node(job: Job) -> int:
    """Workers per node (``convoy.config.torchrun_layout``)."""
    return torchrun_layout(job.scaling)[1]


def nnodes_argument(job: Job) -> str:
    """torchrun's ``--nnodes``: the configured count, or MIN:MAX nodes of an elastic range."""
    return torchrun_layout(job.scaling)[0]


def rendezvous_endpoint(job: Job) -> str:
    """host:port of the rendezvous: the configured one, or loopback port 0 (as ``--standalone``).

    Port 0 lets the c10d store bind a port the kernel picks; a port chosen beforehand could be
    taken by another socket before torchrun binds it, and then every agent waits a minute for
    a store nobody hosts.
    """
    return job.scaling.torchrun.rdzv_endpoint or "127.0.0.1:0"


def node_address(job: Job, endpoint: str) -> str | None:
    """This node's address as the other nodes see it, for a rendezvous on another host.

    torchrun otherwise advertises the node's host name, which on many machines resolves to
    a loopback address; None when everything stays on this machine.
    """
    if job.scaling.torchrun.local_addr:
        return job.scaling.torchrun.local_addr
    host, _, port = endpoint.rpartition(":")
    if host in ("127.0.0.1", "localhost", "::1") and nodes_range(nnodes_argument(job))[1] == 1:
        return None
    try:
        return address_towards(host, int(port))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "scaling.torchrun.rdzv_endpoint",
            endpoint,
            f"expected host:port of the rendezvous that this node can reach ({exc}); or set "
            "scaling.torchrun.local_addr to this node's address",
        ) from None


def hosts_rendezvous(endpoint: str) -> bool:
    """True if the rendezvous endpoint's (non-loopback) address is on this node's interface."""
    host = endpoint.rpartition(":")[0]
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return not address.startswith("127.") and interface_with_address(address) is not None


def torchrun_command(
    job: Job, config_path: Path, endpoint: str | None = None, entry: WorkerEntry = TRAIN
) -> list[str]:
    """The torchrun command line for ``job`` (public so tests and docs can show it)."""
    opts = job.scaling.torchrun
    endpoint = endpoint or rendezvous_endpoint(job)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes_argument(job)}",
        f"--nproc-per-node={procs_per_node(job)}",
        f"--max-restarts={job.scaling.max_failures}",
        f"--rdzv-backend={opts.rdzv_backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={opts.rdzv_id or job.run.name}",
    ]
    local_addr = node_address(job, endpoint)
    if local_addr:
        command.append(f"--local-addr={local_addr}")
    if hosts_rendezvous(endpoint):
        # torchrun decides who hosts the c10d store by the host name's addresses, which miss
        # this node's own interface when the name resolves to loopback; then nobody hosts it.
        command.append("--rdzv-conf=is_host=1")
    if opts.node_rank is not None:
        command.append(f"--node-rank={opts.node_rank}")
    worker = ["-m", "convoy.launchers.torchrun", str(config_path)]
    if entry != TRAIN:
        worker.append(json.dumps(entry.to_dict()))
    return [*command, *worker]


AGENT_FLAG = "--agent"


def agent_command(command: list[str]) -> list[str]:
    """``torchrun_command``'s line run by this module's ``agent_main``: torchrun's own agent,
    quiet when a stop signal ends it."""
    return [sys.executable, "-m", "convoy.launchers.torchrun", AGENT_FLAG, *command[3:]]


# torchrun's agent's lines on a stop signal, which say what Convoy's line says after it.
STOP_LOG_LINES = (
    "Received %s death signal, shutting down workers",
    "Sending process %s closing signal %s",
)


def agent_main(argv: list[str]) -> None:
    """torchrun (``torch.distributed.run``'s main) on ``argv``. A stop signal ends it as it
    ends torchrun: the agent sends its workers the signal and waits for them, and they save
    and say so; then it exits with 128 + the signal's number, without the traceback of its
    ``SignalException`` or its log lines about the signal."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    def not_a_stop_line(record: logging.LogRecord) -> bool:
        return record.msg not in STOP_LOG_LINES

    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logging.getLogger(name).addFilter(not_a_stop_line)
    try:
        main(argv)
    except SignalException as stopped:
        sys.exit(128 + int(stopped.sigval))


def worker_environment(job: Job, endpoint: str) -> dict[str, str]:
    """The workers' environment: gloo / NCCL on the interface of this node's address."""
    local_addr = node_address(job, endpoint)
    return {**os.environ, **(socket_interface_env(local_addr) if local_addr else {})}


class TorchrunLauncher(Launcher):
    name = "torchrun"
    config_model = TorchrunConfig

    def start(self, job: Job, entry: WorkerEntry = TRAIN) -> RunResult:
        check_local_gpus(job, workers_on_this_node=procs_per_node(job))
        max_nodes = nodes_range(nnodes_argument(job))[1]
        check_shared_storage(job, max_nodes, f"--nnodes {nnodes_argument(job)}")
        storage = write_config(job)
        storage.delete(STOPPED_FILE)  # a stop of an earlier attempt is not this one's
        endpoint = rendezvous_endpoint(job)
        with tempfile.TemporaryDirectory(prefix="convoy-torchrun-") as scratch:
            # Workers read the resolved config from a local file, wherever the run is stored.
            config_path = Path(scratch) / CONFIG_FILE
            config_path.write_text(job_to_yaml(job))
            # In a session of its own, as torchrun starts its workers: a terminal's Ctrl-C
            # reaches only this process, which passes it on once (``forwarded_to``). Also
            # reached itself, the agent got it twice, and the second interrupted its wait for
            # the saving workers with a traceback.
            process = subprocess.Popen(
                agent_command(torchrun_command(job, config_path, endpoint, entry)),
                env=worker_environment(job, endpoint),
                start_new_session=True,
            )
            with forwarded_to(process):
                returncode = process.wait()
        if returncode != 0 and storage.exists(STOPPED_FILE):
            # Rank 0 wrote it after printing the same line: said once.
            raise StopRequested(storage.read_text(STOPPED_FILE), shown=True)
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
    """A torchrun worker: ``CONFIG.yaml [ENTRY.json]`` (the engine when no entry is given)."""
    job = load_job(argv[0])
    entry = WorkerEntry.from_dict(json.loads(argv[1])) if len(argv) > 1 else TRAIN
    try:
        entry.run(job, worker_context_from_env(job))
    except StopRequested:
        # Saved and stopped on a request: an exit the agent restarts (--max-restarts) and
        # the launcher reads from STOPPED_FILE, without a traceback.
        exit_without_teardown(STOPPED_EXIT_CODE)
    except BaseException:
        # Fail fast: peers blocked in a collective see the connection drop at once.
        traceback.print_exc()
        exit_without_teardown(1)
    exit_without_teardown()


if __name__ == "__main__":
    if sys.argv[1:2] == [AGENT_FLAG]:
        agent_main(sys.argv[2:])
    else:
        worker_main(sys.argv[1:])

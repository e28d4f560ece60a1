"""``torchrun``: the vanilla PyTorch baseline.

The driver writes the resolved config into the run directory and runs torchrun's agent
(``torch.distributed.run ... -m convoy.launchers.torchrun <config.yaml>``) in its own process.
The agent forks each worker (``convoy_worker``) from a fork server that has imported torch and
the engine once (``convoy.fork_server``), rather than starting an interpreter per worker; the
command line stays what ``torchrun`` would run on its own (this module's ``__main__``, for
``torchrun_command`` and for users who run torchrun themselves). Each worker reads torchrun's
environment once and runs the engine. Elastic ``nnodes: MIN:MAX``, c10d rendezvous and
``--max-restarts`` (from ``scaling.max_failures``) come straight from the config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from convoy.config import (
    Job,
    TorchrunConfig,
    job_to_yaml,
    load_job,
    nodes_range,
    torchrun_layout,
)
from convoy.distributed import (
    WorkerContext,
    default_threads,
    exit_without_teardown,
    lost_a_peer,
)
from convoy.engine.stop import (
    STOPPED_EXIT_CODE,
    STOPPED_FILE,
    StopRequested,
    handling_stop_signals,
)
from convoy.errors import ConfigError, LaunchError
from convoy.fork_server import (
    CallerStdio,
    as_a_new_process,
    handed_environment,
    start_fork_server,
    without_main_module,
)
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
    """The torchrun command line for ``job`` (public so tests and docs can show it); the
    launcher runs its arguments (``torchrun_arguments``) in its own process."""
    arguments = torchrun_arguments(job, config_path, endpoint, entry)
    return [sys.executable, "-m", "torch.distributed.run", *arguments]


def torchrun_arguments(
    job: Job, config_path: Path, endpoint: str | None = None, entry: WorkerEntry = TRAIN
) -> list[str]:
    """torchrun's arguments for ``job``: its options, then the worker module and its own."""
    opts = job.scaling.torchrun
    endpoint = endpoint or rendezvous_endpoint(job)
    command = [
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


# torchrun's agent's lines, by logger, that say what a line after them says: Convoy's line
# on a stop signal, or torchrun's summary of a failed worker (a forked worker's failure is
# also logged with the agent's own traceback, and the others' ending).
QUIET_LOG_LINES = {
    "torch.distributed.elastic.agent.server.api": (
        "Received %s death signal, shutting down workers",
    ),
    "torch.distributed.elastic.multiprocessing.api": (
        "Sending process %s closing signal %s",
        "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
        "Closing process %s via signal %s",
    ),
    "torch.multiprocessing.spawn": ("Terminating process %s via signal SIGTERM",),
}
# Above this many workers on a node, torchrun starts them as commands: each forked worker's
# arguments carry every local worker's result pipe, and multiprocessing's fork server takes
# at most 255 descriptors a worker.
MAX_FORKED_WORKERS = 64
# The signals torchrun's own handler keeps while its agent runs in this process; the stop
# signals are Convoy's (``stopping_the_agent``).
AGENT_HANDLED_SIGNALS = "SIGHUP,SIGQUIT"


def run_agent(argv: list[str], env: dict[str, str]) -> int:
    """torchrun's agent on ``argv`` (torchrun's own arguments), in this process, its workers
    forked from the fork server (``convoy_worker``) and given ``env``; its exit code.

    The agent runs here rather than in an interpreter of its own, and its workers are forked
    rather than started: each interpreter cost a launch about 2-3 CPU-s (Python, ``import
    torch``, DCP and the engine). A stop signal ends it as it ends torchrun: the agent sends its
    workers the signal and waits for them, and they save and say so; then 128 + the signal's
    number, without the traceback of its ``SignalException`` or its log lines about the
    signal. A worker's failure is torchrun's summary of it, without the traceback around it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run

    with agent_environment(env), quiet_agent_lines(), stopping_the_agent(SignalException):
        try:
            args = parse_args(argv)
            if int(args.nproc_per_node) > MAX_FORKED_WORKERS:
                run(args)  # workers started as commands
                return 0
            config, _, _ = config_from_args(args)
            worker_args = (CallerStdio(), env, *args.training_script_args)
            with without_main_module():
                config.start_method = start_fork_server()
                elastic_launch(config, entrypoint=convoy_worker)(*worker_args)
        except SignalException as stopped:
            return 128 + int(stopped.sigval)
        except ChildFailedError as failed:
            print(failed.format_msg(), file=sys.stderr)
            return 1
        except SystemExit as exited:  # torchrun's argument errors
            return exited.code if isinstance(exited.code, int) else 1
    return 0


@contextlib.contextmanager
def agent_environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` as this process's environment (torchrun gives its workers its own), and
    torchrun's handlers on ``AGENT_HANDLED_SIGNALS`` only, while inside; then this process's
    environment, handlers, thread name (torchrun renames its thread) and fault handler
    (torchrun turns it on) as they were. Where standard error is not a file (a notebook,
    pytest's capture) torchrun's warning that it could not turn the fault handler on is left
    out: nothing of the run depends on it."""
    import faulthandler

    import torch.multiprocessing

    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    thread_name = torch.multiprocessing._get_thread_name()
    fault_handler_was_on = faulthandler.is_enabled()
    os.environ.clear()
    os.environ.update(env, TORCHELASTIC_SIGNALS_TO_HANDLE=AGENT_HANDLED_SIGNALS)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Unable to enable fault handler")
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.multiprocessing._set_thread_name(thread_name)
        if not fault_handler_was_on:
            faulthandler.disable()


@contextlib.contextmanager
def quiet_agent_lines() -> Iterator[None]:
    """torchrun's agent's ``QUIET_LOG_LINES`` left out while inside."""
    filters = {
        name: (lambda record, lines=lines: record.msg not in lines)
        for name, lines in QUIET_LOG_LINES.items()
    }
    for name, keep in filters.items():
        logging.getLogger(name).addFilter(keep)
    try:
        yield
    finally:
        for name, keep in filters.items():
            logging.getLogger(name).removeFilter(keep)


@contextlib.contextmanager
def stopping_the_agent(signal_exception: Any) -> Iterator[None]:
    """While inside, the first stop signal raises torchrun's ``SignalException``, as its own
    handler does: the agent sends its workers SIGINT (Ctrl-C, so their line says what the user
    did) or SIGTERM (the others: a worker would die of SIGUSR1) and waits while they save.
    A repeated signal (a second Ctrl-C, or the terminal's and a supervisor's) is not raised
    into that wait: interrupting it left the saving workers behind, with a traceback."""
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        sigval = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        raise signal_exception(f"convoy got {signal.Signals(signum).name}", sigval=sigval)

    with handling_stop_signals(stop):
        yield


def worker_environment(job: Job, endpoint: str) -> dict[str, str]:
    """The workers' environment: gloo / NCCL on the interface of this node's address, and
    ``OMP_NUM_THREADS`` at the threads each worker will use (``scaling.threads_per_worker``,
    else its share of this node's CPUs), unless the user set it: without it, torchrun sets 1
    and prints a five-line banner asking for it to be tuned."""
    local_addr = node_address(job, endpoint)
    env = {**os.environ, **(socket_interface_env(local_addr) if local_addr else {})}
    threads = job.scaling.threads_per_worker or default_threads(procs_per_node(job))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


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
            # Each worker is in a session of its own (``convoy_worker``): a terminal's Ctrl-C
            # reaches only this process, whose agent passes it on once.
            arguments = torchrun_arguments(job, config_path, endpoint, entry)
            returncode = run_agent(arguments, worker_environment(job, endpoint))
        if returncode != 0 and storage.exists(STOPPED_FILE):
            # Rank 0 wrote it after printing the same line: said once.
            raise StopRequested(storage.read_text(STOPPED_FILE), shown=True)
        if returncode != 0:
            raise LaunchError(
                f"torchrun exited with code {returncode}; the workers' output is above"
            )
        return RunResult(storage.uri, read_summary(storage.uri))


# How long a rank that failed on a lost peer waits before it exits: longer than the agent takes
# to notice a worker's end (torchrun's monitor interval, 0.1 s).
LOST_PEER_GRACE_S = 2.0


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


def run_worker(argv: list[str]) -> None:
    """A torchrun worker's work: ``CONFIG.yaml [ENTRY.json]`` (the engine when no entry is
    given). It returns when the entry is done; on a stop or a failure it exits at once."""
    job = load_job(argv[0])
    entry = WorkerEntry.from_dict(json.loads(argv[1])) if len(argv) > 1 else TRAIN
    try:
        entry.run(job, worker_context_from_env(job))
    except StopRequested:
        # Saved and stopped on a request: an exit the agent restarts (--max-restarts) and
        # the launcher reads from STOPPED_FILE, without a traceback.
        exit_without_teardown(STOPPED_EXIT_CODE)
    except BaseException as exc:
        # Fail fast: peers blocked in a collective see the connection drop at once.
        traceback.print_exc()
        if lost_a_peer(exc):
            # Failed because another rank is gone: that rank ends first, so that the agent's
            # summary names it, and the agent ends this one meanwhile.
            time.sleep(LOST_PEER_GRACE_S)
        exit_without_teardown(1)


def convoy_worker(stdio: CallerStdio, environ: dict[str, str], *argv: str) -> None:
    """A worker forked from the fork server by the agent of ``run_agent``: as a new process
    (default signal handlers, a session of its own: a terminal's Ctrl-C reaches the driver
    only, whose agent passes it on once), with the driver's standard streams and environment
    (``environ``, torchrun's variables over it), then ``run_worker``.

    It returns, rather than exit as ``worker_main`` does, because the agent counts a forked
    worker done by its return value; the process then ends without the interpreter's
    teardown, within ``EXIT_AFTER_RETURN_S`` even if a thread of the run is still busy."""
    as_a_new_process()
    stdio.attach()
    handed_environment(environ)
    run_worker(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    # multiprocessing joins the process's non-daemon threads before its exit; the return value
    # is in the agent's pipe by the time this fires.
    exit_soon = threading.Timer(EXIT_AFTER_RETURN_S, os._exit, args=(0,))
    exit_soon.daemon = True
    exit_soon.start()


# How long a forked worker that returned may take to exit on its own.
EXIT_AFTER_RETURN_S = 10.0


def worker_main(argv: list[str]) -> None:
    """A torchrun worker started as ``python -m convoy.launchers.torchrun CONFIG.yaml
    [ENTRY.json]`` (``torchrun_command``)."""
    run_worker(argv)
    exit_without_teardown()


if __name__ == "__main__":
    worker_main(sys.argv[1:])

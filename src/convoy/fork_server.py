"""Worker processes forked from a fork server that has imported torch and the engine once.

A fresh interpreter spends seconds of CPU importing torch, DCP and the engine before its first
step, in every worker of every launch and restart. Python's ``forkserver`` start method keeps
one clean process per launching process that imports them once (``PRELOAD``) and forks each
worker from it. The server never runs tensor math, so a forked worker's OpenMP pool and CUDA
are as fresh as a new interpreter's: forking the launching process itself would be cheaper,
but a child forked after its parent used OpenMP hangs in its first parallel region.

The server moves to a session of its own as it starts (this module is its first preload): in
the launching process's session and process group, a signal to the whole group (a terminal's
Ctrl-C or hang-up, ``kill -- -PGID``, a supervisor stopping a group) would end it under the
launcher's feet. It still ends with the launching process, when that one's end of its pipe
closes.

What a forked worker does not get from the fork server by itself, it is handed
(``CallerStdio``, ``handed_environment``, ``as_a_new_process``), so that it runs as a
started one would: the launching process's environment and its standard input, output and
error at the launch, the default signal handlers, and no ``__main__`` of the launching
process's (``without_main_module``).

The server keeps what it imported: a long-lived launching process (a notebook) that edits
Convoy's own modules sees the edits in its workers after a restart of the process. Variables
read once at import (``TORCH_LOGS``, for one) are read with the environment of the server's
start. The handed standard streams stand in for torchrun's own redirection (``--redirects``,
``--tee``), which Convoy does not set.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["convoy.fork_server", "torch", "torch.distributed.checkpoint", "convoy.engine.loop"]
"""What every worker imports, imported once in the fork server: modules, not state (importing
them starts no thread, touches no device and joins no process group). This module comes first:
importing it in the server moves the server to a session of its own."""

_preload = list(PRELOAD)


def also_preload(modules: list[str]) -> None:
    """Have this process's fork server import ``modules`` too, if it has not started yet (a
    module that is not installed is skipped there). For a process that forks many workers
    that import them: each would otherwise import them itself."""
    _preload.extend(m for m in modules if m not in _preload)


# The environment this module was imported with. In a forked worker that is the fork server's
# (the module is imported there first), so what differs from it is what the launcher set.
SERVER_ENVIRON = dict(os.environ)

# What torchrun's agent sets for every worker it starts, whatever the server's values.
TORCHRUN_WORKER_VARIABLES = frozenset(
    (
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    )
)


def _in_the_fork_server_start() -> bool:
    """Whether this module is being imported by ``multiprocessing``'s fork server, as one of
    its preloads (its ``main`` is on the stack)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and (
            frame.f_globals.get("__name__") == "multiprocessing.forkserver"
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _in_the_fork_server_start() and os.getsid(0) != os.getpid():
    os.setsid()


def fork_server_start_method() -> str:
    """``forkserver``, with ``PRELOAD`` (and what ``also_preload`` added) imported in the
    server, where the platform has it; else ``spawn``. The list takes effect when this
    process's server starts; every later launch of the process shares that server."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(list(_preload))
    return "forkserver"


def start_fork_server() -> str:
    """Start this process's fork server now and wait until it has imported its preloads (a
    no-op worker forked and joined), so that a signal in the seconds that takes finds no
    worker half started; the start method (``fork_server_start_method``)."""
    method = fork_server_start_method()
    if method == "forkserver":
        ready = mp.get_context("forkserver").Process(target=os.getpid, daemon=True)
        ready.start()
        ready.join()
    return method


@contextlib.contextmanager
def without_main_module() -> Iterator[None]:
    """While inside, this process's ``__main__`` is hidden from the workers it starts. A
    forked (or spawned) worker otherwise runs the launching script again as ``__mp_main__``,
    and a script that launches a run at its top level, without ``if __name__ ==
    "__main__":``, would launch it again in every worker."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def handed_environment(environ: dict[str, str]) -> None:
    """In a forked worker: ``environ`` (the launching process's) as the environment, with the
    variables torchrun set for this worker (``TORCHRUN_WORKER_VARIABLES``, and any that differ
    from the server's) over it."""
    per_worker = {
        k: v
        for k, v in os.environ.items()
        if k in TORCHRUN_WORKER_VARIABLES or SERVER_ENVIRON.get(k) != v
    }
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(per_worker)


def as_a_new_process() -> None:
    """In a forked worker: the default handlers of the signals a worker stops on, as a new
    interpreter has them (the server's would be inherited), and a session of its own, as
    torchrun's started workers have."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()


class CallerStdio:
    """The launching process's standard input, output and error, handed to a forked worker.

    Pickled for the fork server (``multiprocessing``'s ``DupFd``), the descriptors travel with
    the worker's arguments; ``attach`` makes them the worker's own 0, 1 and 2.
    """

    def __init__(self, *handed: Any) -> None:
        self._handed = handed

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return (
            CallerStdio,
            tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (0, 1, 2)),
        )

    def attach(self) -> None:
        """Make the handed descriptors this process's standard streams (a no-op where nothing
        was handed: a worker started without a fork server)."""
        for target, handed in enumerate(self._handed):
            if handed is None:
                continue
            fd = handed.detach()
            os.dup2(fd, target)
            os.close(fd)
            if target == 0:
                # multiprocessing gave the child /dev/null; a rank's debugger reads the terminal.
                sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        # Unbuffered, as torchrun's ``python -u`` workers: lines from the ranks interleave as
        # they are written.
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True, write_through=True)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True

"""Worker processes forked from a fork server that has imported torch and the engine once.

A fresh interpreter spends seconds of CPU importing torch, DCP and the engine before its first
step, in every worker of every launch and restart. Python's ``forkserver`` start method keeps
one clean process per launching process that imports them once (``PRELOAD``) and forks each
worker from it. The server never runs tensor math, so a forked worker's OpenMP pool and CUDA
are as fresh as a new interpreter's: forking the launching process itself would be cheaper,
but a child forked after its parent used OpenMP hangs in its first parallel region.

What a forked worker does not get from the fork server by itself, it is handed here, so that it
runs as a spawned one would:

- the launching process's environment at the launch (``handed_environment``), over the
  server's own, which is the environment of the server's start;
- the launching process's standard output and error at the launch (``CallerStdio``), instead
  of the server's: where a run's output goes can change between launches of one process
  (pytest's capture, a notebook's redirection).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed.checkpoint", "convoy.engine.loop"]
"""What every worker imports, imported once in the fork server: modules, not state (importing
them starts no thread, touches no device and joins no process group)."""

_preload = list(PRELOAD)


def also_preload(modules: list[str]) -> None:
    """Have this process's fork server import ``modules`` too, if it has not started yet (a
    module that is not installed is skipped there). For a process that forks many workers
    that import them: each would otherwise import them itself."""
    _preload.extend(m for m in modules if m not in _preload)


# The environment this module was imported with. In a forked worker that is the fork server's
# (the module is imported there, or while the worker's arguments are unpickled, before the
# launcher's per-worker variables are set), so what differs from it is what the launcher set.
SERVER_ENVIRON = dict(os.environ)


def fork_server_start_method() -> str:
    """``forkserver``, with ``PRELOAD`` (and what ``also_preload`` added) imported in the
    server, where the platform has it; else ``spawn``. The list takes effect when this
    process's server starts; every later launch of the process shares that server."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(list(_preload))
    return "forkserver"


def handed_environment(environ: dict[str, str]) -> None:
    """In a forked worker: ``environ`` (the launching process's) as the environment, with the
    variables the launcher set for this worker (what differs from the server's) over it."""
    per_worker = {k: v for k, v in os.environ.items() if SERVER_ENVIRON.get(k) != v}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(per_worker)


class CallerStdio:
    """The launching process's standard output and error, handed to a forked worker.

    Pickled for the fork server (``multiprocessing``'s ``DupFd``), the two descriptors travel
    with the worker's arguments; ``attach`` makes them the worker's own 1 and 2.
    """

    def __init__(self, out: Any = None, err: Any = None) -> None:
        self._out, self._err = out, err

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return (CallerStdio, (reduction.DupFd(1), reduction.DupFd(2)))

    def attach(self) -> None:
        """Make the handed descriptors this process's standard output and error (a no-op where
        nothing was handed: a worker started without a fork server)."""
        for handed, target in ((self._out, 1), (self._err, 2)):
            if handed is None:
                continue
            fd = handed.detach()
            os.dup2(fd, target)
            os.close(fd)
        # Unbuffered, as torchrun's ``python -u`` workers: lines from the ranks interleave as
        # they are written.
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True, write_through=True)

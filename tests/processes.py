"""This machine's processes as ``/proc`` shows them: for tests that find and end the processes
they started (a Ray's workers, a run's train workers) by what they are, not by a PID they kept."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path


def other_pids() -> list[int]:
    """Every live process but this one."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]


def pids_matching(accept: Callable[[str], bool]) -> list[int]:
    """The processes whose command line (arguments joined by spaces) ``accept`` takes."""
    found = []
    for pid in other_pids():
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if accept(cmdline):
                found.append(pid)
    return found


def pids_with_environ(entry: str) -> list[int]:
    """The processes whose environment holds ``entry`` (``KEY=value``)."""
    found = []
    for pid in other_pids():
        with contextlib.suppress(OSError):
            if entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after "pid (comm)": state, parent, ...; ``OSError`` when gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    """The parent's PID; ``OSError`` when the process is gone."""
    return int(stat_fields(pid)[1])


def children_named(name: str) -> list[int]:
    """This process's children whose name (``comm``) is ``name``: Ray's raylet is its driver's."""
    found = []
    for pid in other_pids():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if (
                parent_of(pid) == os.getpid()
                and Path(f"/proc/{pid}/comm").read_text().strip() == name
            ):
                found.append(pid)
    return found


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie waiting to be reaped)."""
    try:
        state = stat_fields(pid)[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def survivors(find: Callable[[], list[int]], timeout: float) -> list[int]:
    """The live processes ``find`` still names after up to ``timeout`` seconds of waiting for
    them to end (a guard against a hang, not a measurement): empty once all are gone."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in find() if is_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def command_line(pid: int) -> str:
    """``pid``'s arguments joined by spaces (empty when it is gone), for a failure message."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return ""

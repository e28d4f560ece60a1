"""The private Ray's own folder, ``$RAY_TMPDIR/ray/cv<id>`` (``/tmp/ray/cv<id>`` without it).

Ray puts Unix sockets inside the folder it is given, under
``<folder>/session_<YYYY-MM-DD_HH-MM-SS_ffffff>_<pid>/sockets/``, and a Unix socket's path has
a hard limit (107 bytes on Linux, 103 on macOS). A private Ray nests one folder deeper than
Ray alone (``$RAY_TMPDIR/ray/session_...``), so that folder's name is kept short (8
characters: the pid is in the session's name already), and the longest socket path is
checked before Ray starts: too long a ``RAY_TMPDIR`` is said at once, in one line, instead of
as Ray's error on every attempt to start.
"""

from __future__ import annotations

import datetime
import os
import secrets
import sys
from pathlib import Path

# What the private folders' names start with, then 6 hex digits: unique among the runs of a
# machine (a clash is retried), and short (see the module's docstring).
PRIVATE_PREFIX = "cv"

# The longest names Ray 2.60 gives sockets in a session's sockets folder: its object store's
# and raylet's (ray/_private/node.py, _prepare_socket_file: "plasma_store", "raylet"), and the
# dashboard's modules' (ray/dashboard/subprocesses/utils.py, get_socket_path: "dash_" + the
# module's class name; TaskEventsHead is the longest), made only when the dashboard runs.
RAY_SOCKET = "plasma_store"
DASHBOARD_SOCKET = "dash_TaskEventsHead"


def private_ray_root() -> Path:
    """The folder that holds private Rays' folders: ``$RAY_TMPDIR/ray``, else ``/tmp/ray``."""
    return Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray"


def private_folder_name() -> str:
    """A new private Ray folder's name: ``cv`` and 6 random hex digits."""
    return f"{PRIVATE_PREFIX}{secrets.token_hex(3)}"


def make_private_folder(root: Path) -> Path:
    """Create a new folder of this process's own under ``root`` for a private Ray."""
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = root / private_folder_name()
        try:
            path.mkdir()
        except FileExistsError:  # another run's, by a 1 in 16 million chance
            continue
        return path


def socket_path_limit(platform: str = sys.platform) -> int:
    """The longest Unix socket path in bytes, as Ray checks it (``validate_socket_filepath``)."""
    return (104 if platform.startswith("darwin") else 108) - 1


def longest_socket_path(
    temp_dir: str, pid: int, dashboard: bool, now: datetime.datetime | None = None
) -> str:
    """The longest socket path a Ray started by process ``pid`` with ``_temp_dir=temp_dir``
    makes (``dashboard``: with the dashboard's modules), at ``now`` (the date has a fixed
    width, so the time only fills the path in)."""
    stamp = (now or datetime.datetime.now()).strftime("%Y-%m-%d_%H-%M-%S_%f")
    name = DASHBOARD_SOCKET if dashboard else RAY_SOCKET
    return os.path.join(temp_dir, f"session_{stamp}_{pid}", "sockets", name)


def socket_path_problem(temp_dir: str, pid: int, dashboard: bool) -> str | None:
    """What to tell the user, in one line, when a Ray started in ``temp_dir`` by process
    ``pid`` would make a socket path over the limit; None when every path fits."""
    path = longest_socket_path(temp_dir, pid, dashboard)
    length, limit = len(path.encode()), socket_path_limit()
    if length <= limit:
        return None
    return (
        f"RAY_TMPDIR: Ray's socket path {path} would be {length} bytes, over the {limit}-byte limit "
        f"of a Unix socket path; set RAY_TMPDIR to a folder at least {length - limit} "
        "characters shorter (such as /tmp), or leave it unset"
    )

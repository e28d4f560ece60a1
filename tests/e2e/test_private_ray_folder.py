"""The private Ray's folder under a user's ``RAY_TMPDIR``: a folder whose socket paths just
fit starts a real Ray, and one a byte too long for them is said at once, in one line.

Each test runs in its own process (this session's Ray is the only one a pytest process may
hold), with a ``RAY_TMPDIR`` of its own under a short folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
DEFAULT = str(Path(__file__).resolve().parents[2] / "recipes" / "default.yaml")
TIMEOUT_S = 300  # a guard against a hang, not a measurement

# Pads RAY_TMPDIR so that the longest socket path of the private Ray this process starts is
# exactly the limit, starts that Ray, and prints its object store's socket path.
START_AT_THE_LIMIT = """
import os, sys
import ray
from convoy.config import RayLauncherConfig
from convoy.launchers.ray_folder import longest_socket_path, private_folder_name, socket_path_limit
from convoy.launchers.ray_local import start_private_ray

base = sys.argv[1]
shortest = longest_socket_path(f"{base}/ray/{private_folder_name()}", os.getpid(), False)
spare = socket_path_limit() - len(shortest.encode())
os.environ["RAY_TMPDIR"] = f"{base}/" + "t" * (spare - 1)  # the "/" counts too
start_private_ray(ray, RayLauncherConfig(start_timeout_s=120))
print(",".join(sorted(ray._private.worker._global_node.all_processes)))
print(ray._private.node.Node.start_monitor.__qualname__)
print(os.environ["RAY_TMPDIR"])
print(ray._private.worker.global_worker.node.plasma_store_socket_name)
ray.shutdown()
"""


def private_env() -> dict[str, str]:
    """This environment without a Ray to join: each test's process starts its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("RAY_API_SERVER_ADDRESS", None)
    return {**env, "PYTHONUNBUFFERED": "1"}


def end_processes_naming(folder: Path) -> None:
    """SIGKILL what a failed test left running of its own Ray (its command lines name
    ``folder``, a folder of this test's only)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if str(folder).encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)


def test_a_private_ray_starts_when_its_socket_paths_just_fit(short_tmp_path: Path) -> None:
    try:
        result = subprocess.run(
            [sys.executable, "-c", START_AT_THE_LIMIT, str(short_tmp_path)],
            capture_output=True,
            text=True,
            env=private_env(),
            timeout=TIMEOUT_S,
        )
    finally:
        end_processes_naming(short_tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    processes, start_monitor, ray_tmpdir, socket = result.stdout.strip().splitlines()[-4:]
    # A one-node Ray that lives as long as its run: no autoscaler monitor, no API server
    # (dashboard); Ray's head Node is as it was once the Ray has started.
    assert {"gcs_server", "raylet", "log_monitor"} <= set(processes.split(","))
    assert not {"monitor", "dashboard"} & set(processes.split(",")), processes
    assert start_monitor == "Node.start_monitor"
    # Longer than the issue's `$(mktemp -d)/rt` (22 characters), and Ray's socket where the
    # check said it would be: exactly at the limit.
    assert len(ray_tmpdir) > 22
    assert socket.startswith(f"{ray_tmpdir}/ray/cv") and socket.endswith("/sockets/plasma_store")
    assert len(socket.encode()) == 107


def test_too_long_a_ray_tmpdir_is_one_line_before_ray_starts(
    short_tmp_path: Path, tmp_path: Path
) -> None:
    ray_tmpdir = short_tmp_path / ("t" * 60)
    result = subprocess.run(
        [sys.executable, "-m", "convoy", "train", DEFAULT, "-o", f"run.storage_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env={**private_env(), "RAY_TMPDIR": str(ray_tmpdir)},
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"convoy: error: RAY_TMPDIR: Ray's socket path {ray_tmpdir}/")
    assert "over the 107-byte limit of a Unix socket path; set RAY_TMPDIR to a folder" in (
        result.stderr
    )
    assert "trying again" not in result.stdout and "started a private Ray" not in result.stdout
    assert not ray_tmpdir.exists()  # no Ray started, no folder made

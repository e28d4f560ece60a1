"""The private Ray's folder: a short name, Ray's socket-path limit checked before it starts,
and a start that cannot succeed said at once, with nothing left behind."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from convoy.config import RayLauncherConfig
from convoy.errors import LaunchError
from convoy.launchers import ray_folder, ray_local
from convoy.launchers.ray_folder import (
    longest_socket_path,
    make_private_folder,
    private_folder_name,
    socket_path_limit,
    socket_path_problem,
)

NOON = datetime.datetime(2026, 11, 27, 12, 0, 0, 1234)
ISSUE_RAY_TMPDIR = "/tmp/tmp.KCONVI1Zwv/rt"  # `$(mktemp -d)/rt`: 22 characters
LARGEST_PID = 4194304  # Linux's pid_max at its highest: 7 digits


def test_the_longest_socket_path_is_where_ray_puts_its_sockets() -> None:
    # ray/_private/node.py: <temp>/session_<%Y-%m-%d_%H-%M-%S_%f>_<pid>/sockets/plasma_store
    assert longest_socket_path("/tmp/ray/cv0a1b2c", 4242, dashboard=False, now=NOON) == (
        "/tmp/ray/cv0a1b2c/session_2026-11-27_12-00-00_001234_4242/sockets/plasma_store"
    )
    # With the dashboard, its modules' sockets are longer: dash_<module class>.
    with_dashboard = longest_socket_path("/tmp/ray/cv0a1b2c", 4242, dashboard=True, now=NOON)
    assert with_dashboard.endswith("_4242/sockets/dash_TaskEventsHead")


def test_the_limit_is_rays_own() -> None:
    assert socket_path_limit("linux") == 107
    assert socket_path_limit("darwin") == 103


def test_private_folders_have_short_names_of_one_length() -> None:
    names = {private_folder_name() for _ in range(50)}
    assert len(names) == 50
    assert all(re.fullmatch(r"cv[0-9a-f]{6}", name) for name in names)


def test_a_short_ordinary_ray_tmpdir_leaves_room_for_every_socket() -> None:
    folder = f"{ISSUE_RAY_TMPDIR}/ray/{private_folder_name()}"
    for dashboard in (False, True):
        assert socket_path_problem(folder, LARGEST_PID, dashboard) is None
    # The old name (convoy-<pid>-<6 hex>) did not leave room, with a 5-digit pid.
    old = f"{ISSUE_RAY_TMPDIR}/ray/convoy-54321-0a1b2c"
    assert socket_path_problem(old, 54321, dashboard=False) is not None


def test_too_long_a_ray_tmpdir_is_one_line_naming_the_path_its_length_and_the_fix() -> None:
    folder = "/tmp/" + "x" * 60 + "/ray/cv0a1b2c"
    problem = socket_path_problem(folder, 54321, dashboard=False)
    assert problem is not None and "\n" not in problem
    path = longest_socket_path(folder, 54321, dashboard=False)
    length = len(path.encode())
    assert problem.startswith(f"RAY_TMPDIR: Ray's socket path {folder}/session_")
    assert f"/sockets/plasma_store would be {length} bytes, over the 107-byte limit" in problem
    assert f"set RAY_TMPDIR to a folder at least {length - 107} characters shorter" in problem


def test_the_limit_is_exact_to_the_byte() -> None:
    def folder_of(length: int) -> str:
        """A folder whose longest socket path is ``length`` bytes."""
        spare = length - len(longest_socket_path("/", 54321, dashboard=False).encode())
        return "/" + "x" * (spare - 1)  # and a "/" after it

    assert socket_path_problem(folder_of(107), 54321, dashboard=False) is None
    assert socket_path_problem(folder_of(108), 54321, dashboard=False) is not None


def test_a_new_folder_never_reuses_another_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cv000000").mkdir()
    names = iter(["cv000000", "cv000001"])
    monkeypatch.setattr(ray_folder, "private_folder_name", lambda: next(names))
    assert make_private_folder(tmp_path) == tmp_path / "cv000001"


class FailingRay:
    """A Ray whose start fails with ``error`` (control logic only; e2e tests start real Ray)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.folders: list[str] = []

    def init(self, **kwargs: object) -> None:
        self.folders.append(str(kwargs["_temp_dir"]))
        (Path(self.folders[-1]) / "session_x" / "logs").mkdir(parents=True)  # as Ray does
        raise self.error

    def shutdown(self) -> None:
        pass

    def LoggingConfig(self, **kwargs: object) -> dict[str, object]:
        return kwargs


def test_too_long_a_ray_tmpdir_fails_before_ray_or_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_tmpdir = tmp_path / ("x" * 80)
    monkeypatch.setenv("RAY_TMPDIR", str(long_tmpdir))
    fake = FailingRay(RuntimeError("never reached"))
    with pytest.raises(LaunchError, match=r"^RAY_TMPDIR: Ray's socket path .* 107-byte limit"):
        ray_local.start_private_ray(fake, RayLauncherConfig(start_timeout_s=60))
    assert fake.folders == []
    assert not long_tmpdir.exists()


def test_a_start_that_would_fail_the_same_way_is_not_retried(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(short_tmp_path))
    error = OSError("validate_socket_filename failed: AF_UNIX path length cannot exceed 107 bytes")
    fake = FailingRay(error)
    with pytest.raises(LaunchError) as caught:
        ray_local.start_private_ray(fake, RayLauncherConfig(start_timeout_s=60))
    message = str(caught.value)
    assert message.startswith("the embedded Ray could not start (validate_socket_filename")
    assert message.endswith("trying again would fail the same way") and "\n" not in message
    assert len(fake.folders) == 1 and "trying again" not in capsys.readouterr().out
    assert list((short_tmp_path / "ray").iterdir()) == []  # the failed attempt's folder is gone


def test_failed_attempts_leave_no_folders_behind(
    short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(short_tmp_path))
    monkeypatch.setattr(ray_local, "RETRY_PAUSE_S", 0.05)
    fake = FailingRay(RuntimeError("Failed to start the dashboard"))  # a busy machine's
    with pytest.raises(LaunchError, match=r"^scaling\.ray\.start_timeout_s: "):
        ray_local.start_private_ray(fake, RayLauncherConfig(start_timeout_s=0.3))
    assert len(set(fake.folders)) == len(fake.folders) >= 2
    assert list((short_tmp_path / "ray").iterdir()) == []


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (RuntimeError("Failed to start the dashboard"), True),
        (TimeoutError("the GCS did not answer"), True),
        (ConnectionError("connection refused"), True),
        (OSError("validate_socket_filename failed: AF_UNIX path length cannot exceed"), False),
        (PermissionError("[Errno 13] Permission denied: '/tmp/ray'"), False),
        (TypeError("init() got an unexpected keyword argument"), False),
        (LaunchError("said already"), False),
    ],
)
def test_only_what_may_pass_is_retried(error: Exception, retried: bool) -> None:
    assert ray_local.worth_retrying(error) is retried

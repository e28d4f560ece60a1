"""The Ray a ``convoy`` command runs on when ``RAY_ADDRESS`` is unset: private, robust, quiet.

Several ``convoy`` commands often run at once on one machine (a sweep, a benchmark and a
training run), next to a ``ray start --head`` someone may have killed instead of stopping.
Four rules follow from what went wrong there:

- **Join only what a user started.** A local Ray is joined when ``ray start`` wrote Ray's
  address file and its GCS answers within seconds, at that exact address. A dead address is
  said in one line and a private Ray is started instead. Never ``ray.init("auto")``, which
  joins any Ray it finds running here, another run's private one included.
- **A private Ray is private.** It lives in its own temp folder (``/tmp/ray/cv<id>``,
  ``convoy.launchers.ray_folder``), so it writes no address file another process could find,
  and its logs, which the run names, are its own.
- **Start on a busy machine.** Ray's fixed start-up waits (60 s for the dashboard and for a
  worker process to register) become ``scaling.ray.start_timeout_s``, and a failed start is
  retried within that bound; one that would fail the same way again (a folder Ray may not
  write, a ``RAY_TMPDIR`` too long for Ray's socket paths) is said at once. The dashboard
  starts only for callers that need its state API (``convoy tune``); if it cannot start, the
  run goes on and says what that costs.
- **Quiet.** The terminal shows what the train workers (and Tune's trials) print, and the
  controller's lines saying where the workers are; Ray's other lines (the controller's
  requests, the autoscaler's, retries and their tracebacks) go to a log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from convoy.config import Job, RayLauncherConfig
from convoy.distributed import free_port
from convoy.errors import ConvoyError, LaunchError
from convoy.launchers.ray_folder import (
    make_private_folder,
    private_folder_name,
    private_ray_root,
    socket_path_problem,
)

# Ray Train's controller polls its workers every 2 s by default, so a finished run waits up to
# that long before fit() returns; 0.5 s keeps that wait short without the controller polling
# five times a second on a busy machine. Set for every run, on any cluster: Ray Train passes
# this variable from the driver to its controller (a user's own value wins).
RUN_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}

# Set for the embedded Ray only (its processes inherit this environment):
# - Ray Train's preemption watcher follows node drains, which a one-machine Ray never has; it
#   only adds an actor and an error-level line to every run.
# - Ray starts one idle worker process per CPU when the first driver connects, for the
#   driver's tasks. A run's actors (controller, workers, helpers) each start a process of
#   their own instead (Ray Train gives them their own environment variables), so the idle
#   ones only took CPU from the start-up: 2.4 CPU-s here, while the driver and the
#   controller start.
EMBEDDED_RAY_ENV = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_prestart_worker_first_driver": "0",
}

# Ray's start-up waits that a busy machine outlasts, each raised to the start-up bound.
STARTUP_WAIT_VARIABLES = ("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "RAY_worker_register_timeout_seconds")

# Between two attempts to start a private Ray: a busy machine gets a moment to settle.
RETRY_PAUSE_S = 2.0

# How long a local Ray named in Ray's address file may take to answer before it counts as dead.
LOCAL_PROBE_TIMEOUT_S = 3.0


def ray_address_file() -> Path:
    """Ray's address file: written by ``ray start``, read by ``ray.init()`` and the Ray CLI."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def user_started_cluster() -> str | None:
    """The address of a Ray that a user started on this machine (``ray start``) and that
    answers; None when there is none. A stale address file is said in one line."""
    try:
        address = ray_address_file().read_text().strip()
    except OSError:
        return None
    if not address:
        return None
    problem = gcs_problem(address, LOCAL_PROBE_TIMEOUT_S)
    if problem is None:
        return address
    print(
        f"convoy: the Ray at {address} named in {ray_address_file()} is not running "
        f"({problem}; a head stopped without `ray stop`?); starting a private Ray for this run",
        flush=True,
    )
    return None


def gcs_problem(address: str, timeout: float) -> str | None:
    """Why no Ray GCS answers at ``host:port`` within ``timeout`` seconds; None if one does."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        return f"nothing accepts connections there: {getattr(exc, 'strerror', None) or exc}"
    use_token_if_available()
    error = probe_gcs_client(address, timeout)
    if error is None or type(error).__name__ == "AuthenticationError":
        return None  # it answers (a token problem is reported when joining it)
    return f"it accepts connections but does not answer as a Ray GCS ({type(error).__name__})"


TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def use_token_if_available() -> None:
    """Join clusters with token authentication when this machine has a token, as
    ``ray.init("auto")`` does."""
    if not os.environ.get("RAY_AUTH_MODE") and token_available():
        from ray._raylet import Config  # type: ignore[attr-defined]

        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # Ray caches its config at import; make it read the mode again


def token_available() -> bool:
    """True if Ray would find an authentication token on this machine."""
    if any(os.environ.get(name) for name in TOKEN_VARIABLES):
        return True
    return (Path.home() / ".ray" / "auth_token").is_file()


def probe_gcs_client(address: str, timeout: float) -> BaseException | None:
    """Connect a GCS client to ``address``; the error, a TimeoutError, or None if it answers."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            GcsClient(address=address)
            outcome.append(None)
        except BaseException as exc:  # reported in the caller's thread
            outcome.append(exc)

    # The client blocks for up to ~40 s on a port that is not a GCS: wait in a daemon thread.
    probe = threading.Thread(target=connect, name="convoy-gcs-probe", daemon=True)
    probe.start()
    probe.join(timeout)
    return outcome[0] if outcome else TimeoutError()


def start_private_ray(
    ray: Any,
    settings: RayLauncherConfig,
    resources: dict[str, float] | None = None,
    state_api: bool = False,
    metrics: bool = False,
) -> None:
    """Start a local Ray private to this process, retrying within ``settings.start_timeout_s``.

    ``state_api``: start the dashboard too (on loopback), for callers that keep Ray running
    after a Ray Train run is stopped (``convoy tune``): Ray Train's placement-group cleaner
    needs its state API. A plain run stops its Ray at the end, which frees everything.
    ``metrics``: keep Ray's metrics collection (``monitor.prometheus`` exports through it).
    A ``RAY_TMPDIR`` too long for Ray's socket paths, and a failure that trying again cannot
    mend, end at once in one line; a failed attempt leaves no folder behind.
    """
    root = private_ray_root()
    # Every attempt's folder has a name of the same length: one check covers them all.
    problem = socket_path_problem(str(root / private_folder_name()), os.getpid(), state_api)
    if problem:
        raise LaunchError(problem)
    deadline = time.monotonic() + settings.start_timeout_s
    private_env = private_ray_environment(settings, metrics)
    while True:
        try:
            with environment(private_env):
                start_once(ray, root, resources, state_api, metrics)
            break
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if not worth_retrying(exc):
                raise LaunchError(
                    f"the embedded Ray could not start ({first}); trying again would fail the "
                    "same way"
                ) from None
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"scaling.ray.start_timeout_s: the embedded Ray did not start within "
                    f"{settings.start_timeout_s:g} s ({first}); raise it on a busy machine, or "
                    "start Ray once with `ray start --head` and let runs join it"
                ) from None
            print(f"convoy: Ray did not start ({first}); trying again", flush=True)
            time.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
    if state_api and not state_api_running():
        logs = ray._private.worker._global_node.get_logs_dir_path()
        print(
            f"convoy: Ray's dashboard did not start within {settings.start_timeout_s:g} s "
            f"(its log: {logs}/dashboard.log); training goes on without its state API, so a "
            "trial stopped early keeps its CPUs until the sweep ends",
            flush=True,
        )
    print(f"convoy: started a private Ray for this run; {ray_logs_note(ray)}", flush=True)


def private_ray_environment(settings: RayLauncherConfig, metrics: bool) -> dict[str, str]:
    """Set a private Ray's settings in this process's environment, where the user has not
    (Ray's processes inherit them); returns those to set only while it starts."""
    for key in STARTUP_WAIT_VARIABLES:
        os.environ.setdefault(key, str(int(settings.start_timeout_s)))
    for key, value in EMBEDDED_RAY_ENV.items():
        os.environ.setdefault(key, value)
    # Ray starts its workers at nice 15; at the user's priority they compete with torchrun's.
    os.environ.setdefault("RAY_worker_niceness", str(worker_niceness(settings)))
    # Every Ray process (the train workers too) records and exports its metrics every few
    # seconds for the dashboard's Prometheus endpoint, which nothing reads in a run without
    # monitor.prometheus: steady step 1.048x torchrun's with it, 1.007x without
    # (benchmarks/launcher_overhead_cpu_2026-11-26.md). Set while this Ray starts (its
    # processes keep it), not after: a later private Ray in this process may want metrics.
    metrics_env = {} if metrics else {"RAY_enable_metrics_collection": "0"}
    return {PRIVATE_RAY_VARIABLE: "1", **metrics_env}


def start_once(
    ray: Any,
    root: Path,
    resources: dict[str, float] | None,
    state_api: bool,
    metrics: bool,
) -> None:
    """One attempt to start a private Ray in a new folder under ``root``. A failed attempt
    stops what it started and removes its folder (Ray's logs of it included: the error is
    said, and the next attempt makes its own), then raises Ray's error."""
    temp_dir = make_private_folder(root)
    try:
        with (
            state_api_pinned(state_api) as dashboard_port,
            silenced("ray._private.services"),  # its 20-line dump of a failed dashboard
            one_node_head(lean=not state_api and not metrics),
        ):
            ray.init(
                num_cpus=os.cpu_count(),
                resources=resources or None,
                # None, not True: a dashboard that cannot start is said, not fatal.
                include_dashboard=None if state_api else False,
                dashboard_host="127.0.0.1",
                dashboard_port=dashboard_port,
                _temp_dir=str(temp_dir),
                logging_config=ray.LoggingConfig(log_level="ERROR"),
            )
    except Exception:
        with contextlib.suppress(Exception):
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


# What one_node_head leaves out: the methods of Ray's head Node that start them.
LEFT_OUT_OF_ONE_NODE_HEAD = ("start_monitor", "start_api_server")


@contextlib.contextmanager
def one_node_head(lean: bool) -> Iterator[None]:
    """While ``ray.init`` starts a private Ray with ``lean``: without the autoscaler's monitor
    and without the API server's minimal dashboard (job submission, usage reports), which a
    one-node Ray that lives as long as its run never uses: 2-2.5 CPU-s of a launch here
    (benchmarks/ray_share_cpu_2026-11-28.md). ``ray.init`` has no switch for either, so this
    leaves out the two calls of Ray's head ``Node`` that start them; a Ray with a state API
    (``convoy tune``) or Prometheus metrics keeps both."""
    if not lean:
        yield
        return
    from ray._private.node import Node

    # A Ray whose Node names them otherwise starts them, as ray.init would.
    saved = {name: getattr(Node, name) for name in LEFT_OUT_OF_ONE_NODE_HEAD if hasattr(Node, name)}
    for name in saved:
        setattr(Node, name, _start_nothing)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


def _start_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


# Ray's start-up errors that come back the same on every attempt: arguments of a wrong type,
# a folder it may not write, and its check of a Unix socket path's length
# (validate_socket_filepath). Any other error may be a busy machine's, and is retried.
DETERMINISTIC_ERRORS = (TypeError, PermissionError, ConvoyError)
SOCKET_PATH_ERROR = "AF_UNIX path length"


def worth_retrying(error: BaseException) -> bool:
    """Whether another attempt to start Ray may succeed where ``error`` ended this one: a busy
    machine's time-outs may pass; a folder Ray may not write or too long a path will not."""
    if isinstance(error, DETERMINISTIC_ERRORS):
        return False
    return not (isinstance(error, OSError) and SOCKET_PATH_ERROR in str(error))


# Set in the processes of a private Ray (its workers and Tune's trial actors inherit it).
PRIVATE_RAY_VARIABLE = "CONVOY_PRIVATE_RAY"


def on_private_ray() -> bool:
    """Whether this process belongs to a private Ray (its driver, worker or trial actor)."""
    return os.environ.get(PRIVATE_RAY_VARIABLE) == "1"


def prometheus_enabled(job: Job, private: bool | None = None) -> bool:
    """``monitor.prometheus``, or where unset, whether the run's Ray is shared (``private``
    None: whether this process belongs to a private Ray)."""
    if job.monitor.prometheus is not None:
        return job.monitor.prometheus
    return not (on_private_ray() if private is None else private)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block, where the user has not set them."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def silenced(logger_name: str) -> Iterator[None]:
    """Drop every record of ``logger_name`` inside the block."""
    logger = logging.getLogger(logger_name)
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def quiet_ray_loggers() -> None:
    """Keep Ray Train's per-report and Ray Data's per-execution INFO lines out of the run log."""
    for name in ("ray.train", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray Train's worker context logs every report at INFO under a logger named by its file.
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def worker_niceness(settings: RayLauncherConfig) -> int:
    """The nice value train workers should run at: the recipe's, else this process's."""
    if settings.worker_niceness is not None:
        return settings.worker_niceness
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_process_niceness(niceness: int) -> str | None:
    """Give every thread of this process (Linux keeps a nice value per thread) ``niceness``;
    threads started later inherit it. Returns why not, in a few words, when it cannot."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current == niceness:
        return None
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    try:
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except PermissionError:
        return (
            f"they run at nice {current}; lowering it to {niceness} needs root or "
            "CAP_SYS_NICE (or start the cluster's Ray with RAY_worker_niceness="
            f"{niceness})"
        )
    return None


def enter_own_session() -> str | None:
    """Move this process into a session of its own, as torchrun starts each of its workers.

    Linux shares the CPU fairly between sessions (scheduler autogroups) before it looks at
    processes. A Ray worker is in the session of whatever started Ray (the ``convoy`` command,
    a shell), together with every Ray process and anything else that session runs, so on a
    busy machine two train workers got one session's share where torchrun's two got two.
    Ray makes each worker a process group leader, which cannot start a session: it first
    joins its parent's group, and ``setsid`` then makes it the leader of a group whose id is
    its PID again, the group Ray signals when it ends the worker. Returns why not, in a few
    words, when it cannot (the run goes on in Ray's session).
    """
    try:
        if os.getsid(0) == os.getpid():
            return None  # already a session leader
        if os.getpgid(0) == os.getpid():
            os.setpgid(0, os.getpgid(os.getppid()))
        os.setsid()
    except OSError as error:
        return f"the worker stays in Ray's session ({error.strerror or error})"
    return None


def ray_logs_note(ray: Any) -> str:
    """Where this process's Ray keeps its logs (for the run's log and bug reports)."""
    node = ray._private.worker._global_node
    return f"Ray at {node.gcs_address}, its logs in {node.get_logs_dir_path()}"


def state_api_running(timeout: float = 5.0) -> bool:
    """True if the connected Ray's dashboard serves the state API.

    A Ray started without the dashboard still runs a minimal one (usage statistics only)
    that registers its address, so the address alone does not tell; its state endpoint does.
    """
    import urllib.error
    import urllib.request

    from ray._private import ray_constants
    from ray.experimental import internal_kv

    address = internal_kv._internal_kv_get(
        ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD
    )
    if not address:
        return False
    url = f"http://{address.decode()}/api/v0/actors?limit=1"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError as exc:
        return exc.code != 404  # 401/403: there, behind the cluster's authentication
    except OSError:
        return False


@contextlib.contextmanager
def state_api_pinned(enabled: bool = True) -> Iterator[int | None]:
    """Around starting an embedded Ray with a dashboard: a free dashboard port, named in the
    environment the new Ray's processes inherit as ``RAY_API_SERVER_ADDRESS`` (and only
    theirs: the variable is restored afterwards, so no process started later points at this
    Ray by mistake). Yields None, and sets nothing, when ``enabled`` is False.

    Ray Train's placement-group cleaner finds the state API through that variable, else by
    looking for Ray on this machine, which fails when another Ray runs here too ("Found
    multiple active Ray instances"): a stopped run's workers would then keep their CPUs. A
    variable the user set is kept, and its port used.
    """
    if not enabled:
        yield None
        return
    given = os.environ.get("RAY_API_SERVER_ADDRESS")
    if given:
        tail = given.rstrip("/").rpartition(":")[2]
        yield int(tail) if tail.isdigit() else free_port()
        return
    port = free_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    try:
        yield port
    finally:
        os.environ.pop("RAY_API_SERVER_ADDRESS", None)


# Actors whose output is the run's own: Ray Train's workers and Tune's function trials.
SHOWN_ACTORS = ("RayTrainWorker", "ImplicitFunc")
INFO_MARKER = ":info_message:"  # ray_constants.LOG_PREFIX_INFO_MESSAGE
# Ray Train's own note from every worker at start-up, which says nothing the run does not.
WORKER_NOISE = ("Setting up process group for:",)
# Rank 0's line after a stop signal to the driver, which the driver says itself as it ends
# (convoy.launchers.ray_stop): forwarded, it could come after the driver has exited.
DRIVER_STOP_LINE = re.compile(r"^convoy: stopped on SIG[A-Z0-9]+ ")
# The controller's lines a user wants: where the workers are, and when the group resizes.
CONTROLLER_SHOWN = re.compile(r"worker group of size \d+|^- \(ip=")


class RayOutputRouter:
    """Where the driver sends the lines Ray forwards from its processes: train workers' and
    trials' lines to the terminal as Ray prints them, every other line (Ray's controller,
    autoscaler and helper actors, the raylet) to a log file, with its origin."""

    def __init__(self, show: Callable[[dict[str, Any]], None], log_path: Path) -> None:
        self._show = show
        self._lock = threading.Lock()
        self._log: TextIO | None = None
        self.log_path = log_path

    def __call__(self, data: dict[str, Any]) -> None:
        shown: list[str] = []
        hidden: list[str] = []
        wanted = line_filter(str(data.get("actor_name") or ""))
        for line in data.get("lines", []):
            (shown if wanted(line) else hidden).append(line)
        if shown:
            self._show({**data, "lines": shown})
        if hidden:
            self._write(data, hidden)

    def _write(self, data: dict[str, Any], lines: list[str]) -> None:
        origin = data.get("actor_name") or data.get("task_name") or ""
        prefix = f"({origin} pid={data.get('pid')}, ip={data.get('ip')})"
        with self._lock:
            if self._log is None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = self.log_path.open("a", encoding="utf-8")
            for line in lines:
                self._log.write(f"{prefix} {line}\n")
            self._log.flush()

    def move_to(self, log_path: Path) -> None:
        """Write the lines that come from now on to ``log_path``."""
        self.close()
        self.log_path = log_path

    def close(self) -> None:
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None


def line_filter(actor: str) -> Callable[[str], bool]:
    """Which of an actor's lines belong on the terminal."""
    if actor.startswith(SHOWN_ACTORS):
        # All but Ray's own notes (they carry its info-message marker) and start-up note.
        return lambda line: (
            INFO_MARKER not in line
            and not line.startswith(WORKER_NOISE)
            and DRIVER_STOP_LINE.match(line) is None
        )
    if actor.startswith("TrainController"):
        return lambda line: CONTROLLER_SHOWN.search(line) is not None
    return lambda line: False


HANDLER_NAME = "ray_print_logs"  # the name under which ray.init registers its printer
_router: RayOutputRouter | None = None  # this driver's, while connected


def route_ray_output(ray: Any, log_path: Path | None = None) -> RayOutputRouter | None:
    """Put a ``RayOutputRouter`` in front of Ray's printer of forwarded lines in this driver.

    ``log_path`` defaults to ``ray-driver.log`` in the connected Ray's log folder. Returns
    None when Ray forwards nothing to this driver (``log_to_driver=False``).
    """
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printers = [handler for name, handler in dispatcher.handlers if name == HANDLER_NAME]
    if not printers:
        return None
    if log_path is None:
        log_path = Path(ray._private.worker._global_node.get_logs_dir_path()) / "ray-driver.log"
    global _router
    if _router is not None:
        _router.close()
    _router = RayOutputRouter(printers[0], log_path)
    dispatcher.remove_handler(HANDLER_NAME)
    dispatcher.add_handler(HANDLER_NAME, _router)
    return _router


def send_ray_output_to(log_path: Path) -> None:
    """From now on, write Ray's own forwarded lines to ``log_path`` (a run's ``ray.log``)."""
    if _router is not None:
        _router.move_to(log_path)

"""``ray``: Ray Train V2's ``TorchTrainer`` on an embedded local Ray or any Ray cluster.

Without ``RAY_ADDRESS`` the launcher starts a local Ray sized to this machine (dashboard on
loopback) and stops it afterwards; with it, it connects to that cluster (or KubeRay head). Before
submitting it compares the request with what the cluster can ever place, because Ray would
otherwise wait for resources forever. Ray is imported lazily: ``import convoy`` and the
other launchers work without it. What runs on each worker is ``convoy.launchers.ray_worker``;
how a failed run is told, ``convoy.launchers.ray_failures``.
"""

from __future__ import annotations

import math
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from convoy.config import Job, RayLauncherConfig, world_sizes
from convoy.data.ray_data import build_ray_data
from convoy.engine.stop import STOPPED_FILE, StopRequested
from convoy.errors import LaunchError, ResourceError
from convoy.imports import missing_extra
from convoy.launchers.base import (
    TRAIN,
    Launcher,
    RunResult,
    WorkerEntry,
    check_run_location,
    check_shared_storage,
)
from convoy.launchers.ray_failures import fit
from convoy.launchers.ray_local import (
    RUN_ENV,
    probe_gcs_client,
    prometheus_enabled,
    quiet_ray_loggers,
    route_ray_output,
    send_ray_output_to,
    start_private_ray,
    use_token_if_available,
    user_started_cluster,
    worker_niceness,
)
from convoy.launchers.ray_stop import DriverStop
from convoy.launchers.ray_worker import ray_worker_main
from convoy.outputs import read_summary, write_config


@dataclass(frozen=True)
class RayCluster:
    """How to reach Ray: the ``RAY_ADDRESS`` read once here, at the launcher boundary."""

    address: str | None

    @classmethod
    def from_env(cls) -> RayCluster:
        return cls(address=os.environ.get("RAY_ADDRESS", "").strip() or None)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise LaunchError(
            f"scaling.launcher: got 'ray'; {missing_extra('the ray launcher', 'ray', 'ray')}, "
            "or use 'local' / 'torchrun'"
        ) from None
    return ray


def worker_resources(job: Job) -> dict[str, float]:
    """What one train worker asks Ray for."""
    scaling = job.scaling
    resources = {"CPU": scaling.cpus_per_worker, **scaling.resources_per_worker}
    if scaling.use_gpu:
        resources["GPU"] = scaling.gpus_per_worker or 1.0
    return resources


def placeable_workers(request: dict[str, float], nodes: list[dict[str, float]]) -> int:
    """How many workers needing ``request`` fit on these nodes' total resources."""
    wanted = {k: v for k, v in request.items() if v > 0}
    total = 0
    for node in nodes:
        total += min(int(node.get(k, 0.0) / v + 1e-9) for k, v in wanted.items()) if wanted else 0
    return total


def check_cluster_resources(job: Job, nodes: list[dict[str, float]]) -> None:
    """Raise ``ResourceError`` if the workers can never all be placed."""
    request = worker_resources(job)
    fits = placeable_workers(request, nodes)
    if fits < job.scaling.min_workers:
        totals: dict[str, float] = {}
        for node in nodes:
            for key in request:
                totals[key] = totals.get(key, 0.0) + node.get(key, 0.0)
        wanted = (
            f"at least {job.scaling.min_workers}"
            if job.scaling.elastic
            else job.scaling.min_workers
        )
        raise ResourceError(
            f"scaling.num_workers: got {wanted} workers of {request} each, but "
            f"this Ray cluster ({len(nodes)} node(s), {totals} in all) can place at most {fits}; "
            f"lower scaling.num_workers or scaling.cpus_per_worker (fractions are allowed), "
            f"or add nodes"
        )


def worker_nodes(job: Job, nodes: list[dict[str, float]]) -> list[dict[str, float]]:
    """The nodes that can host at least one train worker."""
    request = worker_resources(job)
    return [node for node in nodes if placeable_workers(request, [node]) > 0]


def alive_node_resources(ray: Any) -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def ensure_ray(
    ray: Any,
    cluster: RayCluster,
    resources: dict[str, float] | None = None,
    settings: RayLauncherConfig | None = None,
    state_api: bool = False,
    metrics: bool = False,
) -> RayConnection | None:
    """Connect to or start Ray; the connection if this call made it (and must shut it down).

    ``RAY_ADDRESS`` names a cluster to join. Without it, a Ray a user started on this machine
    (``ray start``) is joined if it answers, and said so; otherwise a private local Ray is
    started for this process and stopped after it (``convoy.launchers.ray_local``), with the
    custom ``resources`` given (a sweep's trial-driver slots), with ``state_api``, the
    dashboard, and without ``metrics``, no metrics collection. Either way, Ray's own output
    is routed away from the terminal.
    """
    if ray.is_initialized():
        return None
    for key, value in RUN_ENV.items():
        os.environ.setdefault(key, value)
    address = cluster.address or user_started_cluster()
    if address:
        if not cluster.address:
            print(
                f"convoy: joining the Ray started on this machine at {address} (`ray start`); "
                "it keeps running after this run",
                flush=True,
            )
        join_cluster(ray, address)
    else:
        start_private_ray(ray, settings or RayLauncherConfig(), resources, state_api, metrics)
    # After Ray starts, not before: importing Ray Train takes 1.5 s here, which would hold up
    # the start of Ray's own processes.
    quiet_ray_loggers()
    route_ray_output(ray)
    return RayConnection(private=not address)


@dataclass(frozen=True)
class RayConnection:
    """A connection ``ensure_ray`` made: to a private Ray it started, or to a shared one."""

    private: bool


def join_cluster(ray: Any, address: str) -> None:
    """``ray.init`` on a running cluster at ``address``, after checking it can be joined."""
    check_reachable(address)
    try:
        ray.init(address=address, logging_config=ray.LoggingConfig(log_level="ERROR"))
    except ConnectionError as exc:
        raise LaunchError(
            f"RAY_ADDRESS: could not join the Ray cluster at {address}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None


# How long to wait for anything to accept a connection at RAY_ADDRESS before saying so.
CONNECT_TIMEOUT_S = 5.0


def check_reachable(address: str) -> None:
    """Fail in seconds, with the fix, when ``RAY_ADDRESS`` cannot be joined.

    ``ray.init`` would retry for about 20 s, printing a line a second, both when nothing
    listens there and when the cluster wants a token this machine lacks, and for longer when
    something else answers (the dashboard's port). A cluster started with token auth is
    joined like ``ray.init("auto")`` does: token mode is turned on when a token is available
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``).
    """
    if address == "auto":
        return  # Ray's own discovery of a cluster on this machine
    scheme, _, rest = address.rpartition("://")
    if scheme in ("http", "https"):
        raise LaunchError(
            f"RAY_ADDRESS: got {address!r}, a URL (the dashboard's, for `ray job submit`); "
            "training joins the cluster's GCS: host:6379 as `ray start --head` prints it"
        )
    if scheme not in ("", "ray"):
        raise LaunchError(f"RAY_ADDRESS: got {address!r}; expected host:port of the Ray head")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(
            f"RAY_ADDRESS: got {address!r}; expected host:port of the Ray head (the GCS port, "
            "6379 unless `ray start --head --port` said otherwise)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise LaunchError(
            f"RAY_ADDRESS: nothing accepts connections at {host}:{port} "
            f"({exc.strerror or exc}); start the head there (ray start --head --port {port}) "
            "or unset RAY_ADDRESS to train on an embedded local Ray"
        ) from None
    if scheme == "ray":
        return  # Ray Client's server: its own handshake
    use_token_if_available()
    probe_gcs(address)


# How long a GCS may take to answer the probe; a real one answers in milliseconds.
GCS_PROBE_TIMEOUT_S = 10.0


def probe_gcs(address: str) -> None:
    """Check that a Ray GCS answers at ``address`` and accepts this machine's token."""
    error = probe_gcs_client(address, GCS_PROBE_TIMEOUT_S)
    if error is None:
        return
    if type(error).__name__ == "AuthenticationError":
        mode = os.environ.get("RAY_AUTH_MODE") or "unset"
        raise LaunchError(
            f"RAY_ADDRESS: the Ray cluster at {address} uses token authentication and refused "
            f"this machine's token (RAY_AUTH_MODE is {mode}); set RAY_AUTH_TOKEN to the "
            "cluster's token (the head's ~/.ray/auth_token) or RAY_AUTH_TOKEN_PATH to a file "
            "holding it, and RAY_AUTH_MODE=token"
        )
    raise LaunchError(
        f"RAY_ADDRESS: something at {address} accepts connections but does not answer as a Ray "
        f"GCS ({type(error).__name__}); give the head's GCS port (6379 unless `ray start --head "
        "--port` said otherwise; 8265 is the dashboard)"
    )


def checkpoint_config(job: Job) -> Any:
    """Ray Train's retention for the checkpoints Convoy reports (Ray owns it under Ray).

    keep_latest K maps to ``num_to_keep=K``; keep_best K to the best K by the metric, which
    Ray keeps together with the latest one (config validation refuses keep_latest > 1 then).
    """
    from ray.train import CheckpointConfig

    cfg = job.checkpoint
    if not cfg.keep_best:
        return CheckpointConfig(num_to_keep=cfg.keep_latest)
    return CheckpointConfig(
        num_to_keep=cfg.keep_best,
        checkpoint_score_attribute=cfg.best_metric,
        checkpoint_score_order=cfg.best_mode,
    )


def check_data_resources(job: Job, nodes: list[dict[str, float]]) -> None:
    """``data.ray_data.resources`` must be offered by a node with CPUs, or every map task would
    wait for it for ever."""
    for name, amount in job.data.ray_data.resources.items():
        if not any(node.get(name, 0.0) >= amount and node.get("CPU", 0.0) > 0 for node in nodes):
            offered = sorted({k for node in nodes for k in node if not k.startswith("node:")})
            raise ResourceError(
                f"data.ray_data.resources: no node of this cluster with CPUs offers "
                f"{name}={amount:g} (resources here: {', '.join(offered)}); start the "
                f"preprocessing nodes with ray start --resources='{{\"{name}\": 8}}'"
            )


def reserve_data_cpus(job: Job, nodes: list[dict[str, float]]) -> Job:
    """Leave ``data.ray_data.reserved_cpus`` to Ray Data: Ray Data with Train hangs when the
    train workers hold every CPU.

    When ``scaling.cpus_per_worker`` was not set, the train workers get the fraction that
    fits; when it was set and does not fit, the layout is refused before anything starts.
    """
    if not job.data_from_driver:
        return job
    check_data_resources(job, nodes)
    total = sum(node.get("CPU", 0.0) for node in nodes)
    workers, reserve = job.scaling.max_workers, job.data.ray_data.reserved_cpus
    wanted = workers * job.scaling.cpus_per_worker
    if wanted + reserve <= total + 1e-9:
        return job
    fitted = math.floor((total - reserve) / workers * 100) / 100
    if "cpus_per_worker" in job.scaling.model_fields_set or fitted < 0.01:
        fix = (
            f"set scaling.cpus_per_worker to {fitted:g} or less"
            if fitted >= 0.01
            else "lower data.ray_data.reserved_cpus or scaling.num_workers, or add nodes"
        )
        raise ResourceError(
            f"scaling.cpus_per_worker: {workers} train workers x {job.scaling.cpus_per_worker:g} "
            f"CPU leave {max(0.0, total - wanted):g} of this cluster's {total:g} CPUs to Ray "
            f"Data, which needs data.ray_data.reserved_cpus={reserve:g} to make progress; {fix}"
        )
    print(
        f"convoy: train workers get {fitted:g} CPU each, leaving {reserve:g} of {total:g} "
        "CPUs to Ray Data (data.ray_data.reserved_cpus)",
        flush=True,
    )
    scaling = job.scaling.model_copy(update={"cpus_per_worker": fitted})
    return job.model_copy(update={"scaling": scaling})


def build_trainer(
    job: Job,
    entry: WorkerEntry = TRAIN,
    callbacks: tuple[Any, ...] = (),
    private_ray: bool = False,
    sole_run: bool = False,
    stop_key: str | None = None,
) -> Any:
    """Ray Train's ``TorchTrainer`` for ``job``: ``entry`` on every worker, the run directory as
    the experiment directory (so Ray's ``get_checkpoint`` resumes it), ``callbacks`` (Ray Train
    ``UserCallback``s such as Tune's ``TuneReportCallback``) on the controller.
    ``private_ray``: the run's own one-node Ray (no autoscaler to ask, no drain notices to
    watch); ``sole_run``: the driver exits with this run (``convoy train``, not a Tune
    trial); ``stop_key``: where the driver writes a stop signal's request for the workers
    (``convoy.launchers.ray_stop``), in place of Ray Train's Ctrl-C handler."""
    from ray.train import DataConfig, ScalingConfig

    # ray_torch imports Ray Train at its top: here, it keeps the ray extra optional.
    from convoy.launchers.ray_controller import ProcessGroupConfig
    from convoy.launchers.ray_torch import ConvoyTorchTrainer

    config: dict[str, Any] = {
        "job": job.model_dump(mode="json"),
        "entry": entry.to_dict(),
        "niceness": worker_niceness(job.scaling.ray),
        "stop_key": stop_key,
    }
    data: dict[str, Any] = {}
    if job.data_from_driver:
        plan = build_ray_data(job, job.scaling.max_workers)
        config["ray_data"] = plan.worker_info()
        # Train is planned per rank (the worker info); each rank gets its eval chunk whole.
        data = {"datasets": plan.datasets, "dataset_config": DataConfig(datasets_to_split=[])}
    return ConvoyTorchTrainer(
        prometheus=prometheus_enabled(job),
        private_ray=private_ray,
        sole_run=sole_run,
        signals_handled=stop_key is not None,
        train_loop_per_worker=ray_worker_main,
        train_loop_config=config,
        **data,
        torch_config=ProcessGroupConfig(
            backend="nccl" if job.scaling.use_gpu else "gloo",
            timeout_s=int(job.run.collective_timeout_s),
        ),
        # mypy sees Train V1's ScalingConfig; Ray 2.60 exports V2's, which takes these.
        scaling_config=ScalingConfig(  # type: ignore[call-arg]
            # A (min, max) tuple selects Ray Train's elastic policy: it restarts the workers
            # at the new size from the latest checkpoint when the cluster grows or shrinks.
            num_workers=job.scaling.num_workers,  # type: ignore[arg-type]
            use_gpu=job.scaling.use_gpu,
            resources_per_worker=worker_resources(job),
            elastic_resize_monitor_interval_s=job.scaling.elastic_monitor_interval_s,
        ),
        run_config=run_config(job, callbacks),
    )


def run_config(job: Job, callbacks: tuple[Any, ...] = ()) -> Any:
    """Ray Train's ``RunConfig``: the run directory as the experiment directory, the failures
    and preemptions to restart from, the checkpoint retention and the controller's
    ``callbacks``."""
    from ray.train import FailureConfig, RunConfig

    storage_path, _, name = job.run_uri.rpartition("/")
    return RunConfig(
        name=name,
        storage_path=storage_path,
        # mypy reads Train V1's FailureConfig; Ray 2.60 exports V2's, which has this field.
        failure_config=FailureConfig(  # type: ignore[call-arg]
            max_failures=job.scaling.max_failures,
            max_preemption_failures=job.scaling.max_preemption_failures,
            relax_collectives_on_preemption=job.scaling.relax_collectives_on_preemption,
        ),
        checkpoint_config=checkpoint_config(job),
        callbacks=list(callbacks),
    )


# Ray's own lines from a run (its controller's, the autoscaler's), kept out of the terminal.
RAY_LOG_FILE = "ray.log"


class RayLauncher(Launcher):
    name = "ray"
    config_model = RayLauncherConfig

    def __init__(self, cluster: RayCluster | None = None) -> None:
        self.cluster = cluster or RayCluster.from_env()

    def launch(self, job: Job, entry: WorkerEntry = TRAIN) -> RunResult:
        """As every launcher's, with Ray joined or started while the job is checked: each
        takes seconds (starting a private Ray, 4-5 s here; the checks import torch and build
        the model and data), and neither needs the other. A bad job still fails before any
        worker starts, and with its own error even when Ray fails too. Where the run writes
        is checked first, before Ray starts: it takes a few file-system calls. A stop signal
        from here on stops the run as under ``local`` (``convoy.launchers.ray_stop``)."""
        check_run_location(job)
        ray = import_ray()
        stop = DriverStop()
        with stop.listening(job.run.stop_on_signal):
            with ThreadPoolExecutor(1, thread_name_prefix="convoy-check") as pool:
                checking = pool.submit(self.check, job, entry)
                try:
                    started = ensure_ray(
                        ray,
                        self.cluster,
                        settings=job.scaling.ray,
                        metrics=job.monitor.prometheus is True,
                    )
                except BaseException:
                    checking.result()
                    raise
                try:
                    checked, entry = checking.result()
                except BaseException:
                    if started:
                        ray.shutdown()
                    raise
            return self.run_on(ray, started, checked, entry, stop)

    def start(self, job: Job, entry: WorkerEntry = TRAIN) -> RunResult:
        ray = import_ray()
        stop = DriverStop()
        with stop.listening(job.run.stop_on_signal):
            started = ensure_ray(
                ray, self.cluster, settings=job.scaling.ray, metrics=job.monitor.prometheus is True
            )
            return self.run_on(ray, started, job, entry, stop)

    def run_on(
        self,
        ray: Any,
        started: RayConnection | None,
        job: Job,
        entry: WorkerEntry,
        stop: DriverStop | None = None,
    ) -> RunResult:
        """Run a checked ``job`` on the Ray ``ensure_ray`` connected to; stop the connection
        after if it made one. ``stop``: the stop signals this driver listens for, which the
        workers act on."""
        try:
            # A cluster Convoy did not start can gain nodes while an elastic run grows onto it.
            shared = started is not None and not started.private
            job = prepare_on_cluster(ray, job, shared_cluster=shared)
            storage = write_config(job)
            run_dir = storage.local_path("")
            if run_dir is not None:
                send_ray_output_to(run_dir / RAY_LOG_FILE)
            private = started is not None and started.private
            monitor = job.monitor.model_copy(
                update={"prometheus": prometheus_enabled(job, private=private)}
            )
            job = job.model_copy(update={"monitor": monitor})
            trainer = build_trainer(
                job,
                entry,
                private_ray=private,
                sole_run=True,
                stop_key=stop.workers_key if stop else None,
            )
            if stop is not None:
                stop.publish_from_now()
            fit(trainer, job)
        finally:
            if started:
                ray.shutdown()
        if stop is not None and stop.notice is not None and storage.exists(STOPPED_FILE):
            # Rank 0's line, said here: Ray's copy of it is kept off the terminal (it could
            # arrive after this process has ended).
            raise StopRequested(storage.read_text(STOPPED_FILE))
        return RunResult(storage.uri, read_summary(storage.uri))


def prepare_on_cluster(ray: Any, job: Job, shared_cluster: bool = False) -> Job:
    """Check ``job`` against the connected cluster before anything starts: storage every host
    can reach, CPUs left to Ray Data, a placeable worker group. Returns the job as it runs
    (train workers' CPUs fitted next to Ray Data)."""
    nodes = alive_node_resources(ray)
    hosts = len(worker_nodes(job, nodes))
    where = f"this Ray cluster has {hosts} that can host them"
    if job.scaling.elastic and shared_cluster and hosts < 2:
        hosts, where = 2, "an elastic run grows onto nodes that join"
    check_shared_storage(job, hosts, where)
    job = reserve_data_cpus(job, nodes)
    check_cluster_resources(job, nodes)
    if hosts == 1 and not job.scaling.elastic:
        # Every worker lands on the one node that can host them: a layout that depends on
        # the workers per node (hsdp's default shard group) is checked before they start.
        job.strategy.check_layout(world_sizes(job.scaling), job.scaling.max_workers)
    return job

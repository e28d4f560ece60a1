"""The MLflow sink: one MLflow run per Convoy run (rank 0).

Params are the resolved recipe as dotted keys (``optim.lr``), metrics the event stream under
the names of ``convoy.integrations.scalars`` (``step/loss`` at every logged step, the epoch's
``train/``/``val/`` metrics, ``test/`` at the end), tags the strategy, launcher, world size and
run directory, and artifacts ``config.yaml`` and ``summary.json``; ``convoy export`` adds the
exported files under ``export/<checkpoint>``.

Where: ``tracking.mlflow.tracking_uri``, or by default a SQLite store
``<run.storage_dir>/mlflow.db`` with artifacts under ``<run.storage_dir>/mlruns`` (one store
for every run kept there). The MLflow run id is written to ``<run>/mlflow_run.json``, so a
resumed attempt continues the same MLflow run and an export finds it.

MLflow must never hold training up: an HTTP server is probed with one short request before
the sink starts (an unreachable one turns the sink off with one line), and every call the sink
makes runs with MLflow's HTTP retries and timeout bounded (``HTTP_LIMITS``, unless the user
set those variables), so a server that goes away mid-run costs seconds before the event bus
switches the sink off, not MLflow's default minutes of back-off.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from convoy.config import Job
from convoy.distributed import WorkerContext
from convoy.engine.events import (
    EndEvent,
    EpochEvent,
    EvalEvent,
    Sink,
    StartEvent,
    StepEvent,
    StragglerEvent,
)
from convoy.engine.sinks import SinkUnavailable
from convoy.imports import missing_extra
from convoy.integrations.scalars import (
    epoch_scalars,
    eval_scalars,
    flatten,
    step_scalars,
    straggler_scalars,
)
from convoy.outputs import CONFIG_FILE
from convoy.storage import RunStorage, is_remote

RUN_FILE = "mlflow_run.json"
"""In the run directory: the tracking URI, experiment and run id of the run's MLflow run."""
DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlruns"
PROBE_TIMEOUT_S = 3.0
HTTP_LIMITS = {
    # MLflow's defaults (7 retries, back-off factor 2, 120 s timeout) wait minutes on a dead
    # server; these give up within about 20 s at worst (3 s when the port is closed).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
}
QUIET_LOGGERS = ("urllib3.connectionpool", "mlflow.store.db.utils", "alembic")
"""A retry's warning and a new SQLite store's "creating tables" lines."""
PACKAGE = "mlflow"
MISSING = (
    f"{missing_extra('the MLflow sink', PACKAGE, 'tracking')}, "
    "or set tracking.mlflow.enabled: false"
)
"""Why the sink is off where MLflow is not installed (``convoy.preflight`` says it)."""
T = TypeVar("T")


def build(job: Job, ctx: WorkerContext) -> Sink:
    """The MLflow sink of this run: a new MLflow run, or the one an earlier attempt started."""
    client_class = _import_client()
    uri = tracking_uri(job)
    storage = RunStorage.at(job.run_uri)
    with bounded_http():
        probe(uri)
        try:
            client = client_class(uri)
            run_id, resumed = _open_run(client, job, uri, storage)
            client.log_batch(run_id, tags=_run_tags(job, ctx))
        except Exception as exc:  # any store error: the run goes on without MLflow
            raise SinkUnavailable(f"cannot open an MLflow run at {uri} ({_reason(exc)})") from None
    return MlflowSink(client, uri, run_id, storage, resumed)


def tracking_uri(job: Job) -> str:
    """The configured tracking URI, or the default SQLite store in ``run.storage_dir``."""
    configured = job.tracking.mlflow.tracking_uri
    if configured:
        return configured
    if is_remote(job.run.storage_dir):
        raise SinkUnavailable(
            f"run.storage_dir {job.run.storage_dir!r} is remote and the default MLflow store is "
            "a local SQLite file; set tracking.mlflow.tracking_uri to a tracking server "
            "(http://host:5000)"
        )
    return f"sqlite:///{_storage_root(job) / DEFAULT_DB}"


def probe(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """For an HTTP tracking URI: one request to ``/health`` without retries. Any answer, even
    an error status, means the server is reachable; no answer raises ``SinkUnavailable``."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests  # the tracking extra (mlflow's)

    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout)
    except requests.Timeout:
        reason = f"no answer within {timeout:g} s"
    except requests.RequestException as exc:
        reason = _reason(exc)
    else:
        return
    raise SinkUnavailable(f"the MLflow tracking server {uri} is unreachable ({reason})")


@contextmanager
def bounded_http() -> Iterator[None]:
    """MLflow's HTTP retry and timeout variables set to ``HTTP_LIMITS`` for the duration (the
    only way MLflow's client takes them; values the user exported are kept), and the lines
    that retries and a new store log kept out of the run log (the sink says what matters)."""
    added = {key: value for key, value in HTTP_LIMITS.items() if key not in os.environ}
    os.environ.update(added)
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


class TrackingServerError(RuntimeError):
    """An MLflow call failed (after its bounded retries); the message is one short line."""


def _bounded(method: Callable[..., T]) -> Callable[..., T]:
    """A sink method run under ``bounded_http``, its failure shortened to one line."""

    @functools.wraps(method)
    def wrapper(self: MlflowSink, *args: Any) -> T:
        with bounded_http():
            try:
                return method(self, *args)
            except Exception as exc:
                raise TrackingServerError(f"{self.uri}: {_reason(exc)}") from exc

    return wrapper


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(
        self, client: Any, uri: str, run_id: str, storage: RunStorage, resumed: bool
    ) -> None:
        from mlflow.utils import validation  # the tracking extra

        self.client = client
        self.uri = uri
        self.run_id = run_id
        self.storage = storage
        self.resumed = resumed
        self.finished = False
        self._limits = validation

    @_bounded
    def on_start(self, event: StartEvent) -> None:
        params = {
            _key(k): _param_value(v, self._limits.MAX_PARAM_VAL_LENGTH)
            for k, v in flatten(event.job).items()
        }
        self._log_params(params)
        if self.storage.exists(CONFIG_FILE):
            self.client.log_text(self.run_id, self.storage.read_text(CONFIG_FILE), CONFIG_FILE)

    @_bounded
    def on_step(self, event: StepEvent) -> None:
        self._metrics(step_scalars(event), event.step)

    @_bounded
    def on_epoch(self, event: EpochEvent) -> None:
        self._metrics(epoch_scalars(event), event.step)

    @_bounded
    def on_eval(self, event: EvalEvent) -> None:
        self._metrics(eval_scalars(event), event.step)

    @_bounded
    def on_straggler(self, event: StragglerEvent) -> None:
        self._metrics(straggler_scalars(event), event.step)

    @_bounded
    def on_end(self, event: EndEvent) -> None:
        text = json.dumps(event.summary, indent=2, default=str)
        self.client.log_text(self.run_id, text, "summary.json")
        self.client.set_terminated(self.run_id, "FINISHED")
        self.finished = True

    @_bounded
    def close(self) -> None:
        if not self.finished:  # the attempt failed; a resumed attempt sets it running again
            self.client.set_terminated(self.run_id, "FAILED")

    def _metrics(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric  # the tracking extra

        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), v, now, step) for k, v in values.items()]
        size = self._limits.MAX_METRICS_PER_BATCH
        for start in range(0, len(metrics), size):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + size])

    def _log_params(self, params: dict[str, str]) -> None:
        """Log the recipe; on a resumed run only the new keys. MLflow params cannot change, so
        a value changed since the first attempt becomes the tag ``resumed.<key>``."""
        from mlflow.entities import Param, RunTag  # the tracking extra

        logged = self.client.get_run(self.run_id).data.params if self.resumed else {}
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = {k: v for k, v in params.items() if k in logged and logged[k] != v}
        tags = [RunTag(_key(f"resumed.{k}"), v) for k, v in changed.items()]
        size = self._limits.MAX_PARAMS_TAGS_PER_BATCH
        for start in range(0, len(new), size):
            self.client.log_batch(self.run_id, params=new[start : start + size])
        for start in range(0, len(tags), size):
            self.client.log_batch(self.run_id, tags=tags[start : start + size])
        if changed:
            _say(
                f"MLflow params are fixed once logged; the values changed since the first "
                f"attempt are tags resumed.<key>: {', '.join(sorted(changed))}"
            )


def log_export(run: str | Path, export_dir: Path, checkpoint: str) -> None:
    """Log an export's files as artifacts (``export/<checkpoint>``) of the run's MLflow run,
    when the run had one; a missing library or an unreachable server is said, not raised."""
    storage = RunStorage.at(run)
    if not storage.exists(RUN_FILE):
        return
    record = json.loads(storage.read_text(RUN_FILE))
    where = f"MLflow run {record['run_id']} at {record['tracking_uri']}"
    try:
        client_class = _import_client()
        with bounded_http():
            probe(record["tracking_uri"])
            client = client_class(record["tracking_uri"])
            client.log_artifacts(record["run_id"], str(export_dir), f"export/{checkpoint}")
    except SinkUnavailable as exc:
        _say(f"the export is not logged to {where}: {exc}")
    except Exception as exc:  # the export itself succeeded; tracking is secondary
        _say(f"the export is not logged to {where}: {_reason(exc)}")
    else:
        _say(f"logged the export to {where} under export/{checkpoint}", sys.stdout)


def read_run_record(run: str | Path) -> dict[str, str] | None:
    """What ``mlflow_run.json`` of a run holds (tracking_uri, experiment_id, run_id), if any."""
    storage = RunStorage.at(run)
    if not storage.exists(RUN_FILE):
        return None
    record: dict[str, str] = json.loads(storage.read_text(RUN_FILE))
    return record


def _import_client() -> Any:
    try:
        from mlflow.tracking import MlflowClient  # the tracking extra
    except ImportError:
        raise SinkUnavailable(MISSING) from None
    return MlflowClient


def _open_run(client: Any, job: Job, uri: str, storage: RunStorage) -> tuple[str, bool]:
    """(run id, resumed): the MLflow run an earlier attempt recorded for this URI, set running
    again, or a new one, recorded in the run directory."""
    recorded = read_run_record(storage.uri)
    if recorded and recorded.get("tracking_uri") == uri and _active(client, recorded["run_id"]):
        client.update_run(recorded["run_id"], status="RUNNING")
        return recorded["run_id"], True
    experiment_id = _experiment_id(client, job)
    run = client.create_run(experiment_id, run_name=job.run.name)
    record = {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run.info.run_id}
    storage.write_text(RUN_FILE, json.dumps(record, indent=2) + "\n")
    return run.info.run_id, False


def _active(client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException  # the tracking extra

    try:
        return bool(client.get_run(run_id).info.lifecycle_stage == "active")
    except MlflowException:  # deleted from the store, or another store
        return False


def _experiment_id(client: Any, job: Job) -> str:
    """The experiment's id, created if new (with artifacts beside the default store)."""
    from mlflow.exceptions import MlflowException  # the tracking extra

    name = job.tracking.mlflow.experiment
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    location = None
    if job.tracking.mlflow.tracking_uri is None:
        location = (_storage_root(job) / DEFAULT_ARTIFACTS).as_uri()
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except MlflowException:  # another run created it in between
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _run_tags(job: Job, ctx: WorkerContext) -> list[Any]:
    from mlflow.entities import RunTag  # the tracking extra

    tags = {
        "convoy.strategy": job.strategy.name,
        "convoy.launcher": job.scaling.launcher,
        "convoy.world_size": str(ctx.world_size),
        "convoy.run_dir": job.run_uri,
    }
    return [RunTag(k, v) for k, v in tags.items()]


def _storage_root(job: Job) -> Path:
    return Path(job.run.storage_dir).expanduser().resolve()


def _key(name: str) -> str:
    # MLflow names allow alphanumerics, _ - . / : and spaces, up to 250 characters.
    return re.sub(r"[^/\w.\- :]", "_", name)[:250]


def _param_value(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(exc: BaseException) -> str:
    """A short cause: a timeout or the OS error inside a requests/urllib3 error, else the
    exception's first line."""
    text = str(exc)
    timeout = re.search(r"timed out\. \((?:read|connect) timeout=([\d.]+)\)", text)
    if timeout:
        return f"no answer within {timeout.group(1)} s"
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno.group(1).strip()
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _say(text: str, stream: Any = None) -> None:
    print(f"convoy: mlflow: {text}", file=stream or sys.stderr, flush=True)

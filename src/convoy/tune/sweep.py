"""Running a sweep: Ray Tune trials, each a normal Convoy run on Ray Train V2.

``plan_sweep`` checks everything that needs no Ray (recipe, space, search, metric, names) and
returns a ``Sweep``. ``run_sweep`` connects to Ray, sizes the concurrency to what the cluster
can hold, and fits a ``ray.tune.Tuner`` (or restores one). Every trial is ``run_trial``: it
builds its job from the recipe and its sampled values, names the run after its trial id
under the sweep's directory (so a re-launched trial resumes from its own Ray Train
checkpoint), and fits a ``TorchTrainer`` whose ``TuneReportCallback`` hands each Convoy
report (one per epoch, per committed checkpoint, and the final one) to Tune.

The trial's Tune actor is only a driver: it holds one ``TRIAL_DRIVER`` custom resource and no
CPU, so drivers never take the CPUs their own train workers wait for. ASHA's time axis is
``epoch`` (every Convoy report carries it; checkpoint reports also count as Tune results, so
``training_iteration`` is not the epoch), with ``max_t = run.epochs``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convoy.config import Job, RayLauncherConfig, apply_overrides, load_job, read_yaml, set_field
from convoy.errors import ConfigError, ConvoyError, ResourceError, one_of
from convoy.imports import installed, missing_extra
from convoy.launchers.ray import (
    RayCluster,
    alive_node_resources,
    ensure_ray,
    import_ray,
    placeable_workers,
    prepare_on_cluster,
    worker_resources,
)
from convoy.preflight import preflight
from convoy.storage import is_remote
from convoy.tune.space import (
    Dim,
    check_search,
    check_space,
    draws_at_random,
    job_with,
    load_space,
    trial_count,
    tune_domains,
)

TRIAL_DRIVER = "convoy_trial_driver"
"""The custom Ray resource a trial's driver holds instead of a CPU (one per trial)."""
TUNE_DIR = "tune"
"""Ray Tune's experiment directory inside the sweep's (its state, for ``--resume``)."""
PLAN_FILE = "sweep.json"
"""What the sweep was started with; ``--resume`` refuses a changed recipe or space."""
SCHEDULERS = ("asha", "none")
DEFAULT_SAMPLES = 8
ASHA_STOPS_FILE = "asha_stops.txt"
"""The trials ASHA stopped, one id a line (told apart from trials an interruption ended)."""
PLACEMENT_GROUP_SETTLE_S = 30.0
"""Ray Train's cleaner removes a stopped trial's worker group within seconds; wait this long."""


class SweepError(ConvoyError):
    """A sweep that cannot start or resume as asked."""


@dataclass(frozen=True)
class Sweep:
    """A checked sweep: everything decided before Ray starts."""

    name: str
    sweep_dir: Path
    recipe: dict[str, Any]
    """The recipe as trials start from it (launcher ray, storage under the sweep)."""
    base: Job
    """The recipe's job, checked by preflight."""
    dims: list[Dim]
    search: str
    scheduler: str
    metric: str
    mode: str
    samples: int
    trials: int
    grace_epochs: int
    reduction_factor: float
    max_concurrent: int | None
    largest: Job
    """Of the checked combinations, the one whose worker group asks for the most."""
    origin_storage_dir: str
    """The recipe's own ``run.storage_dir``: where ``best.yaml`` trains."""
    command: list[str] = field(default_factory=list)

    @property
    def tune_dir(self) -> Path:
        return self.sweep_dir / TUNE_DIR

    @property
    def lightning(self) -> bool:
        """Trials train the recipe's LightningModule (metrics are the names it logs)."""
        return self.base.lightning.enabled

    @property
    def asha_stops(self) -> Path:
        return self.sweep_dir / ASHA_STOPS_FILE

    def record(self) -> dict[str, Any]:
        """What a resumed sweep must share with the one it continues."""
        return {
            "recipe": self.recipe,
            "space": {d.key: {d.kind: list(d.values)} for d in self.dims},
            "search": self.search,
            "scheduler": self.scheduler,
            "metric": self.metric,
            "mode": self.mode,
            "samples": self.samples,
            "grace_epochs": self.grace_epochs,
            "reduction_factor": self.reduction_factor,
        }


def recipe_data(path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The recipe as a plain dict with overrides applied (``load_job`` has checked it).

    Sampled values go into this dict, not into a dumped ``Job``: a dump holds every default
    of the recipe's strategy, which another ``strategy.name`` would refuse.
    """
    loaded = read_yaml(Path(path).read_text()) if path else None
    return apply_overrides(loaded or {}, overrides)


def plan_sweep(
    recipe: str | None,
    overrides: list[str],
    space: str,
    *,
    name: str | None = None,
    search: str = "random",
    scheduler: str | None = None,
    metric: str | None = None,
    mode: str | None = None,
    samples: int | None = None,
    max_concurrent: int | None = None,
    grace_epochs: int = 1,
    reduction_factor: float = 2.0,
    resume: bool = False,
    retry_errored: bool = False,
) -> Sweep:
    """Check the recipe, the space and the options; nothing starts. Raises ``ConvoyError``."""
    check_options(overrides, resume, retry_errored)
    job, data = _trial_recipe(recipe, overrides)
    dims = load_space(space)
    check_search(dims, search, space)
    if resume and not name:
        raise SweepError("--resume: name the sweep to continue with --name SWEEP")
    name = name or _default_name(recipe)
    sweep_dir = Path(job.run.storage_dir).expanduser().resolve() / name
    if resume and samples is None:
        samples = _saved_samples(sweep_dir)  # as started, whatever today's default
    samples = _check_samples(dims, search, samples, resume)
    _check_counts(job, search, max_concurrent, grace_epochs, reduction_factor)
    scheduler = _check_scheduler(scheduler)
    data = set_field(data, "run.storage_dir", str(sweep_dir))
    data.get("run", {}).pop("name", None)
    jobs = check_space(data, dims, space)
    base = job_with(data, {})
    if base.lightning.enabled:
        metric, mode = check_lightning_metric(metric, mode)
    else:
        metric, mode = check_metric(base, metric or job.checkpoint.best_metric, mode)
    sweep = Sweep(
        name=name,
        sweep_dir=sweep_dir,
        recipe=data,
        base=base,
        dims=dims,
        search=search,
        scheduler=scheduler,
        metric=metric,
        mode=mode,
        samples=samples,
        trials=trial_count(dims, search, samples),
        grace_epochs=grace_epochs,
        reduction_factor=reduction_factor,
        max_concurrent=max_concurrent,
        largest=max(jobs, key=_trial_size),
        origin_storage_dir=job.run.storage_dir,
    )
    check_resume(sweep, resume)
    return sweep


def _trial_recipe(recipe: str | None, overrides: list[str]) -> tuple[Job, dict[str, Any]]:
    """The recipe's job, checked for a sweep, and its data as the trials run it: on Ray
    Train, whatever launcher the recipe names."""
    job = load_job(recipe, overrides)
    if is_remote(job.run.storage_dir):
        raise ConfigError(
            "run.storage_dir",
            job.run.storage_dir,
            "convoy tune keeps a sweep (Ray Tune's state, the trials' runs) on a local or "
            "shared path",
        )
    data = recipe_data(recipe, overrides)
    if not job.scaling.launcher_section.runs_ray_train:
        print(f"convoy: trials run on Ray Train (scaling.launcher was {job.scaling.launcher!r})")
        data = set_field(data, "scaling.launcher", RayLauncherConfig.name)
    return job, data


def check_options(overrides: list[str], resume: bool, retry_errored: bool) -> None:
    """Options a sweep would otherwise ignore: ``-o run.name`` and a lone ``--retry-errored``."""
    for override in overrides:
        if override.partition("=")[0].strip() == "run.name":
            raise SweepError(
                f"-o {override}: a sweep does not take run.name; name the sweep with --name "
                "(each trial's run is named after its trial id)"
            )
    if retry_errored and not resume:
        raise SweepError(
            "--retry-errored: only with --resume (it re-runs the failed trials of the sweep "
            "--name SWEEP)"
        )


def check_lightning_metric(metric: str | None, mode: str | None) -> tuple[str, str]:
    """A Lightning recipe's metrics are the names its module logs (``self.log``), which Convoy
    cannot know before the trials run: ``--metric`` and ``--mode`` must be given."""
    if metric is None or mode is None:
        missing = " and ".join(
            flag for flag, value in (("--metric", metric), ("--mode", mode)) if value is None
        )
        raise SweepError(
            f"{missing}: required for a Lightning recipe (its metrics are the names the module "
            "logs with self.log each epoch), e.g. --metric val_loss --mode min"
        )
    return metric, _check_mode(mode)


def _check_mode(mode: str) -> str:
    if mode not in ("min", "max"):
        raise SweepError(f"--mode: got {mode!r}; {one_of(('min', 'max'))}")
    return mode


def _saved_samples(sweep_dir: Path) -> int | None:
    """The ``--samples`` a sweep was started with (its plan file), or None where there is no
    plan to read (``check_resume`` then says so)."""
    plan = sweep_dir / PLAN_FILE
    if not plan.is_file():
        return None
    saved = json.loads(plan.read_text()).get("samples")
    return saved if isinstance(saved, int) else None


def _check_samples(dims: list[Dim], search: str, samples: int | None, resume: bool) -> int:
    """``--samples``, or its default: ``DEFAULT_SAMPLES`` draws where the space draws values
    at random, else 1 (a grid is enumerated whole once). Repeating a space that draws nothing
    trains the same trials again with the same seed, so a new sweep is refused that; a
    resumed one keeps what it was started with."""
    random = draws_at_random(dims, search)
    if samples is None:
        return DEFAULT_SAMPLES if random else 1
    if samples < 1:
        raise SweepError(f"--samples: got {samples}; at least 1")
    if samples > 1 and not random and not resume:
        raise SweepError(
            f"--samples: got {samples}; this space draws nothing at random (it is enumerated "
            "whole), so every repeat would train the same trials with the same seed: leave "
            "--samples out, or repeat over seeds with run.seed: {grid: [0, 1, 2]} in the space"
        )
    return samples


def _check_counts(
    job: Job,
    search: str,
    max_concurrent: int | None,
    grace_epochs: int,
    reduction_factor: float,
) -> None:
    if max_concurrent is not None and max_concurrent < 1:
        raise SweepError(f"--max-concurrent: got {max_concurrent}; at least 1")
    if not 1 <= grace_epochs <= job.run.epochs:
        raise SweepError(
            f"--grace-epochs: got {grace_epochs}; between 1 and run.epochs ({job.run.epochs})"
        )
    if reduction_factor <= 1:
        raise SweepError(f"--reduction-factor: got {reduction_factor:g}; more than 1")
    if search == "optuna":
        check_optuna()


def _check_scheduler(scheduler: str | None) -> str:
    scheduler = scheduler or "asha"
    if scheduler not in SCHEDULERS:
        raise SweepError(f"--scheduler: got {scheduler!r}; {one_of(SCHEDULERS)}")
    return scheduler


def check_optuna() -> None:
    """``--search optuna`` needs the optional ``optuna`` package."""
    if not installed("optuna"):
        raise SweepError(missing_extra("--search optuna", "optuna", "tune"))


def _default_name(recipe: str | None) -> str:
    stem = Path(recipe).stem if recipe else "defaults"
    return f"{stem}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"


def _trial_size(job: Job) -> tuple[float, float]:
    """GPUs, then CPUs, that one trial's worker group asks for."""
    request = worker_resources(job)
    workers = job.scaling.max_workers
    return workers * request.get("GPU", 0.0), workers * request.get("CPU", 0.0)


def check_metric(job: Job, metric: str, mode: str | None) -> tuple[str, str]:
    """The metric must be one the task reports every epoch on this data; returns it with its
    mode (``--mode``, else the task's way for it).

    Preflight already checks ``checkpoint.best_metric`` against the task's rankable metrics
    (``Task.rankable`` on the real data's shape), and resolves its mode: the check is run on
    the recipe with the sweep's metric in that field, so the data is loaded once.
    """
    if mode is not None:
        _check_mode(mode)
    same = metric == job.checkpoint.best_metric
    checkpoint = job.checkpoint.model_copy(
        update={"best_metric": metric, "best_mode": job.checkpoint.best_mode if same else "auto"}
    )
    try:
        checked = preflight(job.model_copy(update={"checkpoint": checkpoint}))
    except ConfigError as exc:
        if exc.field != "checkpoint.best_metric":
            raise
        raise SweepError(
            f"--metric: got {metric!r}; ASHA and the ranking need a metric every epoch "
            f"reports: {exc.allowed}"
        ) from None
    resolved = mode or checked.checkpoint.best_mode
    if resolved not in ("min", "max"):
        # Tune takes only min or max; never start a sweep that it would refuse.
        raise SweepError(
            f"--mode: Convoy cannot tell which way is better for {metric!r}; add --mode min "
            "or --mode max"
        )
    return metric, resolved


def check_resume(sweep: Sweep, resume: bool) -> None:
    """A new sweep must not reuse a sweep's directory; a resumed one must find it unchanged."""
    plan = sweep.sweep_dir / PLAN_FILE
    started = plan.is_file() or (sweep.tune_dir / "tuner.pkl").is_file()
    if not resume:
        if started:
            raise SweepError(
                f"--name: a sweep named {sweep.name!r} exists at {sweep.sweep_dir}; add --resume "
                "to continue it, or pick another --name"
            )
        return
    if not (plan.is_file() and (sweep.tune_dir / "tuner.pkl").is_file()):
        raise SweepError(
            f"--resume: no sweep to resume at {sweep.sweep_dir} (no {PLAN_FILE} and Ray Tune "
            f"state in {TUNE_DIR}/); check --name and run.storage_dir"
        )
    saved = json.loads(plan.read_text())
    changed = record_changes(saved, _json(sweep.record()))
    if changed:
        raise SweepError(
            f"--resume: the sweep {sweep.name!r} was started otherwise: {'; '.join(changed)}; "
            "resume it with the same recipe, overrides, space and options"
        )


def record_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two ``Sweep.record()``s, one ``FIELD: the sweep has A, this
    command B`` each: recipe fields dotted, space fields as ``space FIELD``, options as flags."""
    lines: list[str] = []
    for key in sorted(set(saved) | set(now)):
        if key == "recipe":
            diffs = _dict_changes(saved.get(key) or {}, now.get(key) or {}, "")
        elif key == "space":
            diffs = _dict_changes(saved.get(key) or {}, now.get(key) or {}, "space ", depth=1)
        elif saved.get(key) != now.get(key):
            diffs = [(f"--{key.replace('_', '-')}", saved.get(key), now.get(key))]
        else:
            diffs = []
        lines += [
            f"{name}: the sweep has {_shown(a)}, this command {_shown(b)}" for name, a, b in diffs
        ]
    return lines


_MISSING = object()


def _dict_changes(
    a: dict[str, Any], b: dict[str, Any], prefix: str, depth: int | None = None
) -> list[tuple[str, Any, Any]]:
    """Dotted fields whose values differ between ``a`` and ``b`` (nested mappings walked,
    ``depth`` levels at most)."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key, _MISSING), b.get(key, _MISSING)
        name = f"{prefix}{key}"
        if isinstance(x, dict) and isinstance(y, dict) and depth != 0:
            deeper = None if depth is None else depth - 1
            out += _dict_changes(x, y, name + ".", deeper)
        elif x != y:
            out.append((name, x, y))
    return out


def _shown(value: Any) -> str:
    return "nothing" if value is _MISSING else json.dumps(value)


def _json(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


# ---------------------------------------------------------------------------------------------
# On Ray.


@dataclass(frozen=True)
class SweepOutcome:
    """What ``run_sweep`` leaves for the results table."""

    trials: list[Any]
    """Ray Tune's ``Trial`` objects (status, config, last result, metric analysis)."""
    concurrent: int
    wall_seconds: float
    placement_groups_left: int

    @property
    def unended(self) -> bool:
        """Whether Tune left a trial pending or running (an interruption ended the sweep)."""
        return any(t.status not in ("TERMINATED", "ERROR") for t in self.trials)


def run_sweep(sweep: Sweep, resume: bool = False, retry_errored: bool = False) -> SweepOutcome:
    """Connect to (or start) Ray and run the sweep to its end, or until interrupted."""
    ray = import_ray()
    cluster = RayCluster.from_env()
    # The dashboard's state API lets Ray Train free the workers of a trial ASHA stops.
    started = ensure_ray(
        ray,
        cluster,
        resources={TRIAL_DRIVER: float(sweep.trials)},
        settings=sweep.largest.scaling.ray,
        state_api=True,
        metrics=sweep.largest.monitor.prometheus is True,
    )
    try:
        prepare_on_cluster(ray, sweep.largest)
        concurrent = concurrency(ray, sweep)
        before = live_placement_groups(ray)
        sweep.sweep_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            (sweep.sweep_dir / PLAN_FILE).write_text(json.dumps(sweep.record(), indent=2))
        print(
            f"convoy: sweep {sweep.name}: {sweep.trials} trial(s), {concurrent} at once, "
            f"{sweep.search} search, scheduler {sweep.scheduler} on {sweep.metric} ({sweep.mode})"
            f"{' (resumed)' if resume else ''} -> {sweep.sweep_dir}",
            flush=True,
        )
        start = time.perf_counter()
        tuner = build_tuner(sweep, concurrent, resume, retry_errored)
        with sigterm_as_sigint():
            grid = tuner.fit()
        wall = time.perf_counter() - start
        # ResultGrid keeps the Trial objects (status included) only on its analysis.
        trials = list(grid._experiment_analysis.trials)
        left = settle_placement_groups(ray, before)
    finally:
        if started:
            ray.shutdown()
    return SweepOutcome(trials, concurrent, wall, left)


@contextmanager
def sigterm_as_sigint() -> Iterator[None]:
    """SIGTERM (``kill``, ``timeout``, a scheduler's stop) ends the sweep as Ctrl+C does: Tune
    stops its trials and saves its state, so the sweep can be resumed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def concurrency(ray: Any, sweep: Sweep) -> int:
    """Trials at once: ``--max-concurrent``, lowered to what the cluster can hold; by default
    all it can hold (its CPUs and GPUs // one trial's worker group, and its driver slots)."""
    slots = int(ray.cluster_resources().get(TRIAL_DRIVER, 0.0))
    if slots < 1:
        raise ResourceError(
            f"this Ray cluster has no {TRIAL_DRIVER!r} resource, which each trial's driver "
            "holds instead of a CPU (so drivers never starve their own workers); start the "
            f"head (or any node) with: ray start ... --resources='{{\"{TRIAL_DRIVER}\": 8}}' "
            "(8 trials at once), or unset RAY_ADDRESS to sweep on an embedded local Ray"
        )
    job = sweep.largest
    request = worker_resources(job)
    fits = placeable_workers(request, alive_node_resources(ray)) // job.scaling.max_workers
    capacity = min(fits, slots)
    wanted = sweep.max_concurrent
    if wanted is None:
        return max(1, min(capacity, sweep.trials))
    if wanted > capacity:
        held = f"{fits} worker group(s) of {job.scaling.max_workers} x {request}"
        print(
            f"convoy: --max-concurrent {wanted}: this cluster holds {capacity} trial(s) at once "
            f"({held}; {slots} {TRIAL_DRIVER} slot(s)); using {capacity}",
            flush=True,
        )
        return max(1, capacity)
    return wanted


def build_tuner(sweep: Sweep, concurrent: int, resume: bool, retry_errored: bool) -> Any:
    """A new ``Tuner`` for the sweep, or the interrupted one restored from its directory."""
    from ray import tune  # the ray extra
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from convoy.tune.trial import SweepProgress, run_trial, trial_dirname  # ray (imports ray.tune)

    # Tune's own TensorBoard logger would duplicate each trial's run-dir TensorBoard files
    # and print a driver_artifacts path; its CSV and JSON logs are kept (result analysis).
    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"

    trainable = tune.with_resources(
        tune.with_parameters(run_trial, recipe=sweep.recipe), {TRIAL_DRIVER: 1}
    )
    if resume:
        # Finished trials stay finished; unfinished ones continue (their runs resume from
        # their Ray Train checkpoints); errored ones restart from scratch only when asked.
        return tune.Tuner.restore(
            str(sweep.tune_dir),
            trainable=trainable,
            resume_unfinished=True,
            restart_errored=retry_errored,
        )
    return tune.Tuner(
        trainable,
        param_space=tune_domains(sweep.dims, sweep.search),
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            search_alg=_search_alg(sweep),
            scheduler=_scheduler(sweep),
            num_samples=sweep.samples,
            max_concurrent_trials=concurrent,
            trial_dirname_creator=trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=TUNE_DIR,
            storage_path=str(sweep.sweep_dir),
            verbose=0,
            callbacks=[
                SweepProgress(sweep.metric, sweep.base.run.epochs),
                CSVLoggerCallback(),
                JsonLoggerCallback(),
            ],
        ),
    )


def _search_alg(sweep: Sweep) -> Any:
    if sweep.search != "optuna":
        return None  # Ray Tune's BasicVariantGenerator: random draws, grid_search expanded
    from ray.tune.search.optuna import OptunaSearch  # the ray extra

    return OptunaSearch(seed=sweep.base.run.seed)


def _scheduler(sweep: Sweep) -> Any:
    from convoy.tune.trial import FinishingASHA  # ray (trial imports ray.tune)

    if sweep.scheduler == "none":
        return None
    return FinishingASHA(
        time_attr="epoch",
        max_t=sweep.base.run.epochs,
        grace_period=sweep.grace_epochs,
        reduction_factor=sweep.reduction_factor,
        stops_file=str(sweep.asha_stops),
    )


def live_placement_groups(ray: Any) -> set[str]:
    """Ids of the cluster's placement groups that are not removed."""
    from ray.util import placement_group_table  # the ray extra

    return {pg_id for pg_id, info in placement_group_table().items() if info["state"] != "REMOVED"}


def settle_placement_groups(
    ray: Any, before: set[str], timeout: float = PLACEMENT_GROUP_SETTLE_S
) -> int:
    """Placement groups the sweep created that are still not removed once Ray Train's cleaner
    has had ``timeout`` seconds (a stopped trial's worker group is removed by it)."""
    deadline = time.monotonic() + timeout
    while True:
        left = live_placement_groups(ray) - before
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.5)

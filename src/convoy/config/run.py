"""How a run is recorded and watched: ``run``, ``checkpoint``, ``fault``, ``tracking``,
``monitor`` and ``lightning``."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from convoy.config.base import Section


class RunConfig(Section):
    name: str | None = None
    """Run directory name; unnamed runs get ``<model>-<data>-<strategy>-<timestamp>-<id>``."""
    storage_dir: str = "runs"
    """Root for run outputs, ``<storage_dir>/<name>/``: a local or shared (NFS) path, or
    ``s3://bucket/prefix`` (an S3-compatible server via ``AWS_ENDPOINT_URL``)."""
    seed: int = 0
    epochs: Annotated[int, Field(gt=0)] = 1
    max_steps: Annotated[int, Field(gt=0)] | None = None
    """Stop after this many optimizer steps (overrides epochs when reached first)."""
    eval_every_epochs: Annotated[int, Field(gt=0)] = 1
    log_every_steps: Annotated[int, Field(gt=0)] = 10
    progress: Literal["auto", "bar", "plain", "off"] = "auto"
    """auto: a live bar on a TTY, plain lines otherwise (rank 0 only)."""
    collective_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Timeout of one collective operation (the process group's timeout)."""
    hang_timeout_s: Annotated[float, Field(gt=0)] | None = None
    """Fail the attempt, naming the stuck rank(s), when a rank makes no progress this long."""
    shared_storage: bool = False
    """Say that a local ``storage_dir`` is a filesystem every node mounts at the same path
    (NFS, EFS, a PVC); without it, runs whose workers span several nodes refuse local paths."""
    compile: bool | Literal["blocks", "model"] = False
    """``torch.compile``: ``blocks`` (or ``true``) compiles each of the model's ``blocks``
    (each block's forward, one graph), before sharding; ``model`` compiles the whole model's
    forward, the loss of a model that computes it (``gpt``) included, where the strategy
    keeps the model whole (``single``, ``ddp``; a sharded strategy compiles per block). The
    time spent compiling is reported apart from the step time."""
    stop_on_signal: bool = True
    """SIGTERM, SIGUSR1 or Ctrl-C (a spot notice, a scheduler, a user), and under Ray a
    preemption notice for a node of the run, save the step just finished and stop the run,
    resumable (exit code 75; under Ray, restarted by Ray Train once the node is gone); the
    ranks agree on it with a small all-reduce at most every ~0.1 s. false: a signal ends the
    workers as it would any program, and a preempted Ray run restarts from its last
    periodic checkpoint."""
    stop_poll_s: Annotated[float, Field(ge=0)] = 0.1
    """How often, at most, the ranks agree on stop requests (0: at every step boundary). A
    request is acted on within about two of these, after a finished step."""
    skip_memory_check: bool = False
    """Start the job even where its planned peak per rank (``convoy plan``: the set-up and
    the steps) is over a rank's memory, which is otherwise refused before any worker
    starts: a GPU rank's device memory (where this machine has the GPU), a CPU rank's share
    of this machine's available memory (or of its container's limit, where lower) among
    the workers on it. For a user who knows better: workers on other machines (a Ray
    cluster), or memory the plan over-counts."""

    @field_validator("storage_dir")
    @classmethod
    def _local_or_s3(cls, value: str) -> str:
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", value)
        if scheme and scheme.group(1) != "s3":
            raise ValueError("allowed: a local or shared path, or s3://bucket/prefix")
        if not re.match(r"^s3://[^/]+", value) and value.startswith("s3:"):
            raise ValueError("an s3:// location needs a bucket: s3://bucket/prefix")
        return value

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off_is_false(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False; the user meant the string.
        return "off" if value is False else value


class CheckpointConfig(Section):
    every_steps: Annotated[int, Field(gt=0)] | None = None
    """Save every this many optimizer steps (mid-epoch checkpoints resume mid-epoch)."""
    every_epochs: Annotated[int, Field(gt=0)] | None = None
    """Save at the end of every this many epochs."""
    keep_latest: Annotated[int, Field(gt=0)] = 2
    """Committed checkpoints to keep; older ones are deleted only after a newer one commits."""
    asynchronous: bool = False
    """Write shards in the background (dcp.async_save) while training continues."""
    keep_best: Annotated[int, Field(ge=0)] = 0
    """Also keep this many best checkpoints by ``best_metric`` (as of their save)."""
    best_metric: str = "val/loss"
    """A ``val/`` or ``train/`` metric the task reports (``val/acc``, ``val/bpb``, ``val/r2``...);
    checked against the task before the run starts."""
    best_mode: Literal["auto", "min", "max"] = "auto"
    """Which way is better for ``best_metric``; auto: the task's (min for losses, max for
    accuracy and R²)."""
    resume: bool = True
    """Continue from the latest committed checkpoint in the run directory, if there is one."""

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_epochs is not None


class FaultConfig(Section):
    """Fault injection, for tests and demonstrations of recovery."""

    kind: Literal["none", "raise", "kill", "hang", "slow", "preempt"] = "none"
    """raise: an exception; kill: SIGKILL the process; hang: stop making progress; slow: from
    ``at_step`` on, this rank spends ``slow_seconds`` more on every step's forward (a straggler:
    a slower device or a busier host); preempt: this rank gets a stop notice whose deadline is
    ``deadline_s`` away, as a spot reclaim or a scheduler's warning would give it (the run saves
    and stops if a save fits in that time, else stops and resumes from its last checkpoint)."""
    rank: Annotated[int, Field(ge=0)] = 0
    at_step: Annotated[int, Field(gt=0)] = 1
    """Fire right after this optimizer step (and after its checkpoint, if one is due)."""
    attempts: Annotated[int, Field(ge=0)] = 1
    """Fire on the first this many attempts of the run (restarts included); 0: every attempt."""
    slow_seconds: Annotated[float, Field(gt=0)] = 0.05
    """With ``kind: slow``: the delay added to each of the rank's steps."""
    deadline_s: Annotated[float, Field(ge=0)] = 30.0
    """With ``kind: preempt``: seconds from the notice to the (notional) kill."""


class MlflowConfig(Section):
    """The MLflow sink: params = the resolved recipe, metrics = the event stream, artifacts =
    the summary (and the export, when one is made)."""

    enabled: bool = False
    tracking_uri: str | None = None
    """Any MLflow tracking URI (``http://host:5000``, ``sqlite:///path.db``). Default: a local
    SQLite store ``mlflow.db`` with artifacts under ``mlruns/``, both in ``run.storage_dir``."""
    experiment: str = "convoy"


class TrackingConfig(Section):
    """Experiment tracking sinks, next to ``metrics.jsonl`` (which is always written)."""

    tensorboard: bool = True
    """TensorBoard event files under ``<run>/tensorboard/`` (needs ``convoy[tracking]``).
    Without it, the default is turned off quietly; a recipe that sets it is told so in one
    line before any worker starts, and trains without it."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)


class MonitorConfig(Section):
    """Live monitoring of the workers, at every logged step (``run.log_every_steps``)."""

    straggler_margin: Annotated[float, Field(gt=0)] = 0.25
    """A rank whose local work per step (data wait + forward) exceeds the median of the other
    ranks' by more than this fraction is named a straggler."""
    straggler_min_seconds: Annotated[float, Field(ge=0)] = 0.002
    """...and by more than this many seconds, so timer noise on tiny models names nobody."""
    straggler_patience: Annotated[int, Field(gt=0)] = 2
    """...in this many logged steps in a row: a rank slowed once (a busy core) is not named."""
    prometheus: bool | None = None
    """Under Ray: export the per-rank figures as ``ray.util.metrics`` (Prometheus) metrics.
    Unset: on when the run joins a Ray cluster (a Prometheus scrapes its nodes' metrics
    ports), off on the private Ray a run starts for itself, whose port is picked at random
    and which stops with the run (its metrics collection then costs every step about 4%
    here for nothing). ``true`` exports there too."""


class LightningConfig(Section):
    """Run a user's ``LightningModule`` unchanged (``module``), with its ``LightningDataModule``
    (``datamodule``), under Convoy's launchers and ``strategy.name``. Unset: Convoy's engine."""

    module: str | None = None
    """``package.module:Class`` of a ``lightning.LightningModule``."""
    module_kwargs: dict[str, Any] = Field(default_factory=dict)
    datamodule: str | None = None
    """``package.module:Class`` of a ``lightning.LightningDataModule``; required with module."""
    datamodule_kwargs: dict[str, Any] = Field(default_factory=dict)
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra ``lightning.Trainer`` arguments (e.g. ``gradient_clip_val``); Convoy sets the
    strategy, devices, epochs, precision, logging and checkpointing itself."""

    @property
    def enabled(self) -> bool:
        return self.module is not None

"""Run a user's ``LightningModule`` unchanged under Convoy's launchers and strategies.

``train_lightning(job, ctx)`` is the worker entry the launchers run instead of the engine
when the job has a ``lightning:`` section (``convoy.launchers.base.default_entry``). On every
worker it joins the process group as the engine does (Ray's already exists), builds the
user's module and datamodule, and fits them with a ``lightning.Trainer`` whose strategy,
devices, epochs, steps, seed, precision and logging interval come from the recipe
(``lightning_strategies``). Everything lands in Convoy's run directory:

- ``metrics.jsonl`` and the other sinks, through ``ConvoyEvents`` (``lightning_events``);
- ``lightning_logs/version_N/metrics.csv``: Lightning's own CSVLogger, for comparison;
- ``checkpoints/``: Lightning's ``ModelCheckpoint`` with ``last.ckpt`` (a directory under
  fsdp2's distributed checkpoint). Running the same ``run.name`` again resumes from it.

Under Ray the checkpoints are not registered with Ray Train: the run directory is Ray's
experiment directory, and a restarted attempt finds ``last.ckpt`` there by itself.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.config import Job
from convoy.distributed import (
    WorkerContext,
    all_gather_objects,
    peak_memory_bytes,
    peak_reserved_bytes,
    process_group,
    worker_threads,
)
from convoy.engine.events import EndEvent, EvalEvent
from convoy.engine.sinks import build_sinks
from convoy.errors import ConfigError
from convoy.imports import describe, import_attribute
from convoy.integrations.lightning_checks import EXTENSION_KWARGS, class_specs, extension_kwargs
from convoy.outputs import RunOutputs
from convoy.storage import RunStorage
from convoy.strategies import strategy_class

LIGHTNING_ENTRY = "convoy.integrations.lightning:train_lightning"
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
LOGS_DIR = "lightning_logs"
WARMUP_STEPS_EXCLUDED = 3
"""Batches left out of the steady-state step time, as in the engine's summary."""


def train_lightning(job: Job, ctx: WorkerContext) -> dict[str, Any]:
    """Fit (and test, when the module has a test loop) the job's LightningModule on this
    worker; returns the run summary (rank 0 also writes it)."""
    torch.set_num_threads(job.scaling.threads_per_worker or worker_threads(ctx))
    needed = strategy_class(job.strategy.name).requires_process_group or ctx.world_size > 1
    with process_group(ctx, job.run.collective_timeout_s, needed):
        return _train(job, ctx)


def _train(job: Job, ctx: WorkerContext) -> dict[str, Any]:
    import lightning  # the lightning extra

    # These import lightning at their top: here, they keep the lightning extra optional.
    from convoy.integrations.lightning_events import ConvoyEvents
    from convoy.integrations.lightning_strategies import prepare_module

    set_rank_zero(ctx.rank)
    resume = last_checkpoint(job)
    quiet_expected_noise(resuming=resume is not None)
    lightning.seed_everything(job.run.seed, verbose=False)
    module, datamodule = build_user_objects(job)
    prepare_module(job, module)
    outputs = RunOutputs(RunStorage.at(job.run_uri), enabled=ctx.is_main)
    events = ConvoyEvents(
        ctx, job, header(job, ctx), lambda steps: build_sinks(job, ctx, outputs, (), steps)
    )
    if resume is not None:
        events.pending_messages.append(f"convoy: resumed from {resume}")
    trainer = build_trainer(job, ctx, events)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume) if resume else None)
        bus = events.open_bus(events.total_steps)
        final = _final_metrics(trainer)
        if has_test_loop(module, datamodule):
            test = _test(trainer, module, datamodule)
            bus.emit(EvalEvent("test", trainer.global_step, trainer.current_epoch, test))
            final |= test
        summary = _summary(job, ctx, trainer, events, final, resume)
        bus.emit(EndEvent(summary))
    finally:
        if events.bus is not None:
            events.bus.close()
    return summary


def set_rank_zero(rank: int) -> None:
    """Tell Lightning's rank-zero helpers this worker's rank before any Trainer exists.

    They read ``RANK``/``LOCAL_RANK`` at import, which Ray's workers lack, so every rank
    printed the model summary and the end-of-fit line; Lightning's strategies set the same
    attributes later, in ``setup_environment``."""
    # the lightning extra
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as pytorch_rank_zero
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero

    for helper in (fabric_rank_zero, pytorch_rank_zero, utilities_rank_zero):
        helper.rank = rank  # type: ignore[attr-defined]


class _DropMessages(logging.Filter):
    """Drops log records whose message contains one of ``fragments``."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


LIGHTNING_INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"
_TIPS = _DropMessages("litlogger")
"""Lightning's advertisement for its cloud logger, printed by every Trainer."""


def quiet_expected_noise(resuming: bool) -> None:
    """Silence the run log's lines that say nothing about this run, each by its message
    (and category): Lightning's litlogger tip; torch's ``LeafSpec`` deprecation, raised
    inside Lightning; distributed checkpointing's notice that it overwrites ``last.ckpt``
    (Convoy overwrites it on purpose); and, when resuming, ``ModelCheckpoint``'s notice that
    the checkpoint directory is not empty."""
    info = logging.getLogger(LIGHTNING_INFO_LOGGER)
    if _TIPS not in info.filters:
        info.addFilter(_TIPS)
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    warnings.filterwarnings(
        "ignore", message=r"Detected an existing checkpoint in .*overwriting", category=UserWarning
    )
    if resuming:
        warnings.filterwarnings(
            "ignore",
            message=r"Checkpoint directory .* exists and is not empty",
            category=UserWarning,
        )


def build_user_objects(job: Job) -> tuple[Any, Any]:
    """The user's module and datamodule (None when the module brings its own loaders)."""
    cfg = job.lightning
    assert cfg.module is not None
    module = _construct(
        "lightning.module", cfg.module, cfg.module_kwargs, "lightning.module_kwargs"
    )
    datamodule = None
    if cfg.datamodule is not None:
        datamodule = _construct(
            "lightning.datamodule",
            cfg.datamodule,
            cfg.datamodule_kwargs,
            "lightning.datamodule_kwargs",
        )
    return module, datamodule


def _construct(field: str, path: str, kwargs: dict[str, Any], kwargs_field: str) -> Any:
    """An instance of the user's class ``path`` (named by ``field``); a constructor that raises
    is one line naming ``kwargs_field``, not a traceback."""
    cls = import_attribute(field, path, "expected package.module:Class")
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise ConfigError(kwargs_field, kwargs, f"{path} raised {describe(exc)}") from None


def header(job: Job, ctx: WorkerContext) -> str:
    return (
        f"convoy: {job.lightning.module} via Lightning | {job.strategy.name} x {ctx.world_size} "
        f"on {job.scaling.launcher} | {job.precision} ({PRECISIONS[job.precision]})"
    )


def last_checkpoint(job: Job) -> Path | None:
    """``<run>/checkpoints/last.ckpt`` (a file, or fsdp2's directory) when resuming is on."""
    path = Path(job.run_uri) / CHECKPOINT_DIR / LAST_CHECKPOINT
    return path if job.checkpoint.resume and path.exists() else None


def build_trainer(job: Job, ctx: WorkerContext, events: Any) -> Any:
    """A ``lightning.Trainer`` for ``job`` on this worker (the strategy per launcher)."""
    import lightning  # the lightning extra
    from lightning.pytorch.loggers import CSVLogger

    from convoy.integrations.lightning_strategies import build_layout  # the lightning extra

    layout = build_layout(job, ctx)
    run_dir = Path(job.run_uri)
    user = job.lightning.trainer_kwargs
    callbacks = [events, *_checkpoint_callbacks(job, run_dir)]
    callbacks += user_extensions("callbacks", user.get("callbacks", []), run_dir)
    loggers = [CSVLogger(str(run_dir), name=LOGS_DIR)]
    loggers += user_extensions("logger", user.get("logger", []), run_dir)
    options: dict[str, Any] = {
        "enable_progress_bar": False,  # Convoy's progress sink prints rank 0's progress
        **{k: v for k, v in user.items() if k not in EXTENSION_KWARGS},
    }
    trainer = lightning.Trainer(
        accelerator="gpu" if job.scaling.use_gpu else "cpu",
        strategy=layout.strategy,
        devices=layout.devices,
        num_nodes=layout.num_nodes,
        plugins=layout.plugins or None,
        precision=PRECISIONS[job.precision],  # type: ignore[arg-type]
        max_epochs=job.run.epochs,
        max_steps=job.run.max_steps or -1,
        log_every_n_steps=job.run.log_every_steps,
        check_val_every_n_epoch=job.run.eval_every_epochs,
        logger=loggers,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        enable_checkpointing=job.checkpoint.enabled,
        **options,
    )
    on_ray_strategy = strategy_class(job.strategy.name).lightning.ray_strategy is not None
    if job.scaling.launcher_section.runs_ray_train and on_ray_strategy:
        from ray.train.lightning import prepare_trainer  # the ray extra

        trainer = prepare_trainer(trainer)  # validates the Ray strategy and environment
    return trainer


def user_extensions(key: str, value: Any, run_dir: Path) -> list[Any]:
    """The user's ``trainer_kwargs.callbacks`` / ``logger`` entries, constructed (preflight
    checked them). A logger that takes ``save_dir`` and is given none writes into the run
    directory."""
    built = []
    for spec in class_specs(key, value):
        cls = import_attribute(spec.field, spec.path, "expected package.module:Class")
        kwargs = extension_kwargs(key, cls, spec.kwargs, str(run_dir))
        built.append(_construct(spec.field, spec.path, kwargs, f"{spec.field}.kwargs"))
    return built


def _checkpoint_callbacks(job: Job, run_dir: Path) -> list[Any]:
    """Lightning's ``ModelCheckpoint`` into the run directory: ``last.ckpt`` plus the latest
    ``checkpoint.keep_latest`` (ranked by step), every ``every_steps`` or ``every_epochs``."""
    cfg = job.checkpoint
    if not cfg.enabled:
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint  # the lightning extra

    every = (
        {"every_n_train_steps": cfg.every_steps}
        if cfg.every_steps
        else {"every_n_epochs": cfg.every_epochs}
    )
    return [
        ModelCheckpoint(
            dirpath=str(run_dir / CHECKPOINT_DIR),
            filename="epoch={epoch}-step={step}",
            auto_insert_metric_name=False,
            monitor="step",
            mode="max",
            save_top_k=cfg.keep_latest,
            save_last=True,
            **every,
        )
    ]


def has_test_loop(module: Any, datamodule: Any) -> bool:
    """The module has a ``test_step`` and test data comes from it or the datamodule."""
    from lightning.pytorch.utilities.model_helpers import is_overridden  # the lightning extra

    if not is_overridden("test_step", module):
        return False
    return is_overridden("test_dataloader", module) or (
        datamodule is not None and is_overridden("test_dataloader", datamodule)
    )


def _test(trainer: Any, module: Any, datamodule: Any) -> dict[str, float]:
    from convoy.integrations.lightning_events import metric_values  # the lightning extra

    results = trainer.test(module, datamodule=datamodule, verbose=False)
    merged: dict[str, Any] = {}
    for result in results:
        merged |= result
    return metric_values(merged)


def _final_metrics(trainer: Any) -> dict[str, float]:
    from convoy.integrations.lightning_events import metric_values  # the lightning extra

    return metric_values(trainer.callback_metrics)


def _summary(
    job: Job,
    ctx: WorkerContext,
    trainer: Any,
    events: Any,
    final: dict[str, float],
    resumed: Path | None,
) -> dict[str, Any]:
    clock = events.clock
    steady = clock.step_seconds[WARMUP_STEPS_EXCLUDED:] or clock.step_seconds
    end = time.time()
    reserved = all_gather_objects(peak_reserved_bytes(ctx.device))
    return {
        "run_name": job.run.name,
        "task": f"lightning {job.lightning.module}",
        "strategy": job.strategy.name,
        "launcher": job.scaling.launcher,
        "world_size": ctx.world_size,
        "precision": job.precision,
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "resumed_from": str(resumed) if resumed else None,
        "planned_steps": events.total_steps,
        "metrics": final,
        "engine_start_time": events.started,
        "first_step_end_time": clock.first_step_end,
        "end_time": end,
        "wall_seconds": end - events.started,
        "train_seconds": clock.train_seconds,
        "samples_per_second": clock.samples * ctx.world_size / max(clock.train_seconds, 1e-9),
        "step_seconds_median": statistics.median(steady) if steady else None,
        "step_seconds_p10": float(np.quantile(steady, 0.1)) if steady else None,
        "step_seconds_p90": float(np.quantile(steady, 0.9)) if steady else None,
        "data_wait_fraction": clock.data_wait_seconds / max(clock.train_seconds, 1e-9),
        "peak_memory_bytes_per_rank": all_gather_objects(peak_memory_bytes(ctx.device)),
        "peak_memory_reserved_bytes_per_rank": None if None in reserved else reserved,
        "lightning_log_dir": trainer.logger.log_dir if trainer.logger else None,
    }

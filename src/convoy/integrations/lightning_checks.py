"""Checks of a ``lightning:`` job, run once in the driver (``convoy.preflight``).

Each failure is one ``ConfigError`` naming the field, before any worker starts: Lightning
missing (with the extra to install), a class path that does not import or is not a
``LightningModule`` / ``LightningDataModule``, a module with no data, a strategy or option
Lightning cannot run here, ``trainer_kwargs`` that Convoy sets itself or Lightning's
``Trainer`` does not take, and ``callbacks`` / ``logger`` entries that do not import, are not
a Lightning ``Callback`` / ``Logger`` or do not take their kwargs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from convoy.config import Job
from convoy.errors import ConfigError, one_of
from convoy.imports import import_attribute, missing_extra
from convoy.storage import is_remote
from convoy.strategies import strategy_class, strategy_classes

OWNED_TRAINER_KWARGS = {
    "accelerator": "scaling.use_gpu",
    "strategy": "strategy.name",
    "devices": "scaling.num_workers",
    "num_nodes": "scaling.num_workers",
    "plugins": "scaling.launcher",
    "precision": "precision",
    "max_epochs": "run.epochs",
    "max_steps": "run.max_steps",
    "log_every_n_steps": "run.log_every_steps",
    "check_val_every_n_epoch": "run.eval_every_epochs",
    "default_root_dir": "run.storage_dir and run.name",
    "enable_checkpointing": "checkpoint.every_epochs / checkpoint.every_steps",
}
"""Trainer arguments Convoy derives from the recipe, and the field that sets each."""

EXTENSION_KWARGS = ("callbacks", "logger")
"""Trainer arguments that take objects: given as class specs, added after Convoy's own."""
SPEC_FORM = "expected 'package.module:Class' or {class: 'package.module:Class', kwargs: {...}}"


@dataclass(frozen=True)
class ClassSpec:
    """One ``callbacks`` / ``logger`` entry of ``trainer_kwargs``: a class and its kwargs."""

    field: str
    path: str
    kwargs: dict[str, Any]


def class_specs(key: str, value: Any) -> list[ClassSpec]:
    """``trainer_kwargs[key]`` (one entry or a list) as specs; a ConfigError per malformed
    entry. An entry is an import path or ``{class: path, kwargs: {...}}``."""
    items = value if isinstance(value, list) else [value]
    specs = []
    for index, item in enumerate(items):
        field = f"lightning.trainer_kwargs.{key}[{index}]"
        if isinstance(item, str):
            specs.append(ClassSpec(field, item, {}))
            continue
        path = item.get("class") if isinstance(item, dict) else None
        kwargs = item.get("kwargs", {}) if isinstance(item, dict) else None
        if (
            not isinstance(path, str)
            or not isinstance(kwargs, dict)
            or not set(item) <= {"class", "kwargs"}
        ):
            raise ConfigError(field, item, SPEC_FORM)
        specs.append(ClassSpec(field, path, kwargs))
    return specs


def extension_base(key: str) -> type:
    """The Lightning class every ``callbacks`` / ``logger`` entry must subclass."""
    from lightning.pytorch import Callback  # the lightning extra
    from lightning.pytorch.loggers import Logger

    return Callback if key == "callbacks" else Logger


def extension_kwargs(key: str, cls: type, kwargs: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """``kwargs`` for a ``callbacks`` / ``logger`` class: a logger that takes ``save_dir``
    and is given none writes into the run directory."""
    if key == "logger" and "save_dir" in inspect.signature(cls).parameters:
        return {"save_dir": run_dir, **kwargs}
    return dict(kwargs)


def check_extensions(kwargs: dict[str, Any], run_dir: str) -> None:
    """Each ``callbacks`` / ``logger`` entry imports, is a Lightning ``Callback`` /
    ``Logger``, and its constructor takes its kwargs."""
    for key in EXTENSION_KWARGS:
        for spec in class_specs(key, kwargs.get(key, [])):
            cls = load_class(spec.field, spec.path, extension_base(key))
            given = extension_kwargs(key, cls, spec.kwargs, run_dir)
            check_kwargs(spec.field + ".kwargs", cls, given)


def import_lightning(module: str | None) -> Any:
    """``lightning``, or a ConfigError on ``lightning.module`` naming the extra that installs
    it."""
    try:
        import lightning  # the lightning extra
    except ImportError:
        raise ConfigError(
            "lightning.module", module, missing_extra("a LightningModule", "lightning", "lightning")
        ) from None
    return lightning


def check_lightning(job: Job) -> None:
    """Everything about ``job.lightning`` that can be checked before workers start."""
    cfg = job.lightning
    lightning = import_lightning(cfg.module)
    assert cfg.module is not None
    module_class = load_class("lightning.module", cfg.module, lightning.LightningModule)
    check_kwargs("lightning.module_kwargs", module_class, cfg.module_kwargs)
    if cfg.datamodule is not None:
        data_class = load_class(
            "lightning.datamodule", cfg.datamodule, lightning.LightningDataModule
        )
        check_kwargs("lightning.datamodule_kwargs", data_class, cfg.datamodule_kwargs)
    elif not _overrides(module_class, lightning.LightningModule, "train_dataloader"):
        raise ConfigError(
            "lightning.datamodule",
            None,
            f"{cfg.module} defines no train_dataloader, so it needs a LightningDataModule: "
            "set lightning.datamodule to package.module:Class",
        )
    check_trainer_kwargs(cfg.trainer_kwargs, lightning.Trainer)
    check_extensions(cfg.trainer_kwargs, job.run_uri)
    check_strategy(job)
    check_run_layout(job)


def load_class(field: str, path: str, base: type) -> type:
    """The class ``path`` names; it must subclass ``base``. A missing attribute gets a
    did-you-mean from the module's classes."""
    module_name, _, attr = path.partition(":")
    try:
        value = import_attribute(field, path, f"expected package.module:{base.__name__}Class")
    except ConfigError as exc:
        if "has no attribute" not in exc.allowed:
            raise
        names = [
            n for n, v in vars(importlib.import_module(module_name)).items() if _is_sub(v, base)
        ]
        guess = difflib.get_close_matches(attr, names, n=1, cutoff=0.6)
        hint = f"; did you mean {module_name}:{guess[0]}?" if guess else ""
        raise ConfigError(field, path, exc.allowed + hint) from None
    if not _is_sub(value, base):
        kind = type(value).__name__ if not inspect.isclass(value) else f"class {value.__name__}"
        raise ConfigError(
            field, path, f"{kind} is not a {base.__module__.split('.')[0]}.{base.__name__}"
        )
    return value


def check_kwargs(field: str, cls: type, kwargs: dict[str, Any]) -> None:
    """The constructor accepts ``kwargs`` (bound, not called: building may be costly)."""
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(field, kwargs, f"{cls.__name__}({_signature(cls)}): {exc}") from None


def _signature(cls: type) -> str:
    return ", ".join(str(p) for p in inspect.signature(cls).parameters.values())


def _is_sub(value: Any, base: type) -> bool:
    return inspect.isclass(value) and issubclass(value, base) and value is not base


def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name, None) is not getattr(base, name, None)


def check_trainer_kwargs(kwargs: dict[str, Any], trainer_class: Any) -> None:
    """Refuse keys Convoy sets itself, and keys ``Trainer`` does not take."""
    for key in kwargs:
        if key in OWNED_TRAINER_KWARGS:
            raise ConfigError(
                f"lightning.trainer_kwargs.{key}",
                kwargs[key],
                f"Convoy sets {key} from {OWNED_TRAINER_KWARGS[key]}; set that instead",
            )
    accepted = [
        name for name in inspect.signature(trainer_class.__init__).parameters if name != "self"
    ]
    for key in kwargs:
        if key not in accepted:
            guess = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise ConfigError(
                f"lightning.trainer_kwargs.{key}",
                kwargs[key],
                f"{hint}lightning.Trainer takes no argument {key!r}",
            )


def check_strategy(job: Job) -> None:
    """The strategy and its options must be ones Lightning runs here."""
    strategy = job.strategy
    counterpart = strategy_class(strategy.name).lightning
    if counterpart.refused:
        raise ConfigError(
            "strategy.name", strategy.name, f"{counterpart.refused}; use {_cpu_alternatives()}"
        )
    if counterpart.needs_gpu and not job.scaling.use_gpu:
        raise ConfigError(
            "strategy.name",
            strategy.name,
            f"Lightning's {counterpart.strategy} needs a GPU (scaling.use_gpu: true); on CPU "
            f"use {_cpu_alternatives()}",
        )
    refused = {
        "comm_hook": ("none", "DDP communication hooks are not passed to Lightning"),
        "cpu_offload": (False, "CPU offload is not wired into Lightning's strategies"),
        "reduce_dtype": ("fp32", "Lightning's precision plugin decides the reduce dtype"),
        "activation_checkpointing": (
            "none",
            "a LightningModule checkpoints its own blocks (in its configure_model)",
        ),
        "tp_size": (
            1,
            "a LightningModule applies its own tensor-parallel plan (parallelize_module in "
            "its configure_model, on ModelParallelStrategy's mesh)",
        ),
    }
    if job.run.compile:
        raise ConfigError(
            "run.compile",
            True,
            "a LightningModule compiles its own blocks (torch.compile in its configure_model); "
            "a lightning: job takes run.compile: false",
        )
    for option, (default, why) in refused.items():
        value = getattr(strategy, option, default)
        if value != default:
            raise ConfigError(
                f"strategy.{option}",
                value,
                f"{why}; a lightning: job takes {option}: {default!r}",
            )


def check_run_layout(job: Job) -> None:
    """Options of the engine that a Lightning run cannot honour."""
    if is_remote(job.run.storage_dir):
        raise ConfigError(
            "run.storage_dir",
            job.run.storage_dir,
            "a lightning: job writes checkpoints and its CSV log with Lightning into a local "
            "or shared path; s3:// is not supported for it",
        )
    if job.scaling.elastic:
        raise ConfigError(
            "scaling.num_workers",
            job.scaling.worker_bounds,
            "a lightning: job runs a fixed number of workers; give one number",
        )
    if job.data_from_driver:
        raise ConfigError(
            "data.loader",
            job.data.loader,
            "a lightning: job reads its LightningDataModule's own DataLoaders; use 'torch'",
        )
    if job.checkpoint.keep_best:
        raise ConfigError(
            "checkpoint.keep_best",
            job.checkpoint.keep_best,
            "a lightning: job keeps the latest checkpoints (checkpoint.keep_latest); set 0",
        )
    if job.fault.kind != "none":
        raise ConfigError(
            "fault.kind",
            job.fault.kind,
            "fault injection runs in Convoy's engine only; " + one_of(["none"]),
        )


def _cpu_alternatives() -> str:
    """The strategies Lightning runs on CPU over several workers, each with its counterpart."""
    names = [
        f"{name!r} ({cls.lightning.strategy})"
        for name, cls in strategy_classes().items()
        if cls.requires_process_group and not cls.lightning.needs_gpu and not cls.lightning.refused
    ]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)

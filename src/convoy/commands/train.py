"""``convoy train RECIPE [-o key.path=value ...]``: validate the recipe, train, print the
summary table."""

from __future__ import annotations

import argparse
from typing import Any

import convoy
from convoy.commands.common import EXAMPLES, add_recipe_args
from convoy.commands.summary_lines import format_summary
from convoy.config import Job, load_job


def add_parser(commands: Any) -> None:
    """Add the ``train`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "train",
        help="train a recipe",
        description="Validate the recipe, start its launcher's workers and train. Outputs go "
        "to <run.storage_dir>/<run.name>/: config.yaml, metrics.jsonl, summary.json.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Say the optimizer first, train, then print the summary table."""
    job = load_job(args.recipe, args.override)
    print(optimizer_line(job), flush=True)  # before any launcher output
    result = convoy.train(job)
    print(format_summary(result.summary, str(result.run_dir)))
    return 0


def optimizer_line(job: Job) -> str:
    """What ``convoy train`` says first: the optimizer and schedule the run will use, and
    which of their fields the recipe left to their defaults."""
    # torch's: imported when the line is made, not when the CLI is built.
    from convoy.engine.schedule import peak_lr

    if job.lightning.enabled:
        return f"convoy: optimizer and schedule from {job.lightning.module}.configure_optimizers"
    cfg = job.optim
    shown: dict[str, Any] = {"lr": peak_lr(cfg, job.data.batch_size), **cfg.hyperparameters}
    if cfg.scale_lr_base_batch is not None:
        shown["lr"] = (
            f"{shown['lr']:g} ({cfg.lr:g} x {job.data.batch_size}/{cfg.scale_lr_base_batch})"
        )
    schedule: dict[str, Any] = {"warmup_steps": cfg.warmup_steps}
    if cfg.schedule == "cosine":
        schedule["min_lr_ratio"] = cfg.min_lr_ratio
    epochs = f"{job.run.epochs} epoch{'s' if job.run.epochs != 1 else ''}"
    if job.run.max_steps is not None:
        epochs += f", at most {job.run.max_steps} steps"
    fields = ["name", *shown, "schedule", *schedule]
    defaults = [key for key in fields if key not in cfg.model_fields_set]
    return (
        f"convoy: optimizer {cfg.name}({_keywords(shown)}) | schedule {cfg.schedule}"
        f"({_keywords(schedule)}) over {epochs}"
        + (f" | defaults: {', '.join(defaults)}" if defaults else "")
    )


def _keywords(values: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )

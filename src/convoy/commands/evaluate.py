"""``convoy evaluate EXPORT_DIR | RUN_DIR [--checkpoint step_N]``: the test metrics of an
export, or of a run's checkpoint consolidated in memory, beside those recorded when it was
saved. A run gives the checkpoint ``convoy export`` would take (its best where the run ranks
its checkpoints, else its latest), named with the reason in one line first."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from convoy.commands.common import add_override_arg
from convoy.commands.summary_lines import COUNT_COLUMNS


def add_parser(commands: Any) -> None:
    """Add the ``evaluate`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "evaluate",
        help="evaluate an exported model, or a run's checkpoint, on its test split",
        description="Load an export (no process group, no pickle), or a run's checkpoint "
        "consolidated on one CPU device, and compute its test metrics on the job's dataset; "
        "prints them beside the metrics recorded when it was saved.",
    )
    parser.add_argument(
        "export",
        metavar="EXPORT_OR_RUN",
        help="a directory written by convoy export, or a run directory, "
        "<run.storage_dir>/<run.name> (a path or s3:// URI): its best checkpoint where the "
        "run ranks them (checkpoint.keep_best), else its latest",
    )
    parser.add_argument(
        "--checkpoint", help="of a run: a checkpoint name like step_00000312 instead"
    )
    add_override_arg(parser, "data.path=/new/place")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print measured and recorded metrics side by side."""
    measured, recorded = evaluated(args.export, args.checkpoint, args.override)
    print(f"{'metric':<16}{'measured':>14}{'recorded':>14}")
    for key, value in measured.items():
        before = recorded.get(key)
        shown = (value, before) if before is not None else (value,)
        print(f"{key:<16}" + "".join(_evaluated(key, v) for v in shown))
    return 0


def evaluated(
    where: str, checkpoint: str | None, overrides: list[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """The measured and the recorded metrics of an export, or of the chosen checkpoint of a
    run (said in one line first: which one and why)."""
    # Heavy (the exporter loads torch.distributed's checkpoint stack): imported only here.
    from convoy.errors import ConvoyError
    from convoy.export import (
        MODEL_FILE,
        choose_checkpoint,
        evaluate_checkpoint,
        evaluate_exported,
        read_description,
    )
    from convoy.storage import is_remote

    export_dir = Path(where)
    if not is_remote(where) and (export_dir / MODEL_FILE).is_file():
        if checkpoint is not None:
            raise ConvoyError(f"--checkpoint: {where} is an export (of one checkpoint), not a run")
        measured = evaluate_exported(export_dir, overrides)
        return measured, read_description(export_dir).get("metrics", {})
    choice = choose_checkpoint(where, checkpoint)
    print(f"convoy: evaluating {choice.name}, {choice.why}", flush=True)
    measured, described = evaluate_checkpoint(where, choice.name, overrides)
    return measured, described["metrics"]


def _evaluated(key: str, value: float) -> str:
    """A count as an integer, any other metric to six decimals."""
    if key.rpartition("/")[2] in COUNT_COLUMNS:
        return f"{int(value):>14}"
    return f"{value:>14.6f}"

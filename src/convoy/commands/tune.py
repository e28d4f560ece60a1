"""``convoy tune RECIPE --space SPACE.yaml``: a hyperparameter sweep, each trial a Convoy run."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from convoy.commands.common import add_override_arg

DESCRIPTION = """\
Sweep any recipe field with Ray Tune over Ray Train: each trial is a normal Convoy run in
<run.storage_dir>/<sweep name>/<trial id>/ (config.yaml, metrics.jsonl, summary.json). The
space file maps dotted fields to one kind each: choice, grid, uniform, loguniform, randint
(high end exclusive, as Tune's). The space and every combination of its categorical values
with the ranges' ends are checked as recipes are, before Ray starts. ASHA stops weak trials
early on --metric (default: checkpoint.best_metric), with epochs as its time axis. At the
end: a ranked table, <sweep>/best.yaml (the best trial's recipe, for convoy train),
<sweep>/results.json and <sweep>/report/ (matplotlib). An interrupted sweep continues with
--name SWEEP --resume: finished trials are kept, unfinished ones resume from their checkpoints.
"""
EXAMPLES = """\
example space (recipes/sweeps/default_space.yaml):
  optim.lr: {loguniform: [1.0e-4, 3.0e-3]}
  strategy.name: {choice: [ddp, fsdp2]}
  data.batch_size: {grid: [32, 64]}

examples:
  convoy tune recipes/default.yaml --space recipes/sweeps/default_space.yaml --samples 4 \\
      -o run.epochs=4 -o scaling.cpus_per_worker=0.5 --name lr-sweep
  convoy tune recipes/default.yaml --space recipes/sweeps/default_space.yaml --name lr-sweep \\
      --resume -o run.epochs=4 -o scaling.cpus_per_worker=0.5
  convoy tune recipes/digits_mlp.yaml --space space.yaml --search optuna --metric val/acc
"""


def add_parser(commands: Any) -> None:
    """Add the ``tune`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "tune",
        help="sweep hyperparameters of a recipe (Ray Tune + ASHA over Ray Train)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", nargs="?", help="YAML recipe; the built-in defaults if omitted")
    add_override_arg(parser, "run.epochs=4", what=" for every trial")
    parser.add_argument("--space", required=True, metavar="SPACE.yaml", help="the search space")
    parser.add_argument(
        "--search",
        default="random",
        help="random (default; grid dims are crossed with the draws), grid (every combination "
        "of grid and choice dims), optuna (Ray Tune's OptunaSearch; pip install 'convoy[tune]')",
    )
    _add_scheduler_args(parser)
    parser.add_argument(
        "--name", help="the sweep's folder under run.storage_dir (default: <recipe>-sweep-<time>)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the interrupted sweep --name"
    )
    parser.add_argument(
        "--retry-errored",
        action="store_true",
        help="with --resume: run failed trials again from scratch (default: keep them failed)",
    )
    parser.set_defaults(handler=run)


def _add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    """How trials are run and stopped: the scheduler, its metric, how many at once."""
    parser.add_argument(
        "--scheduler", help="asha (default: stops weak trials early) or none (every trial runs)"
    )
    parser.add_argument(
        "--metric", help="what ASHA and the ranking use (default: checkpoint.best_metric)"
    )
    parser.add_argument("--mode", help="min or max (default: the task's way for the metric)")
    parser.add_argument(
        "--samples",
        type=int,
        help="draws for each grid combination (random) or trials (optuna); default 8, and 1 "
        "where the space draws nothing (grid dims only, or --search grid)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        metavar="K",
        help="trials at once (default: all the cluster can hold: its CPUs and GPUs // one "
        "trial's workers); lowered, and said so, when the cluster holds fewer",
    )
    parser.add_argument(
        "--grace-epochs",
        type=int,
        default=1,
        help="epochs every trial trains before ASHA may stop it (default 1)",
    )
    parser.add_argument(
        "--reduction-factor",
        type=float,
        default=2.0,
        help="ASHA's halving rate: about 1 in this many trials goes on at each rung (default 2)",
    )


def run(args: argparse.Namespace) -> int:
    """Check everything, run the sweep, print the ranked table and write the outputs."""
    # Heavy (preflight and the sweep's checks load the tasks and torchmetrics): imported only
    # when the command runs, so every other `convoy` command starts in a second.
    from convoy.preflight import resolve_tracking
    from convoy.tune.results import (
        best_row,
        collect_rows,
        footer,
        format_table,
        interrupted,
        write_best,
        write_results,
        write_sweep_report,
    )
    from convoy.tune.sweep import plan_sweep, run_sweep

    sweep = plan_sweep(
        args.recipe,
        args.override,
        args.space,
        name=args.name,
        search=args.search,
        scheduler=args.scheduler,
        metric=args.metric,
        mode=args.mode,
        samples=args.samples,
        max_concurrent=args.max_concurrent,
        grace_epochs=args.grace_epochs,
        reduction_factor=args.reduction_factor,
        resume=args.resume,
        retry_errored=args.retry_errored,
    )
    outcome = run_sweep(sweep, resume=args.resume, retry_errored=args.retry_errored)
    rows = collect_rows(sweep, outcome.trials)
    to_resume = interrupted(sweep, outcome, rows)
    print()
    print(format_table(sweep, rows))
    shown = footer(sweep, rows, outcome.wall_seconds, outcome.concurrent)
    print(f"\n{shown}; placement groups left: {outcome.placement_groups_left}")
    best = best_row(rows)
    if best is not None:
        print(
            f"best: {best.trial_id} ({sweep.metric} {best.metric:.4g}) -> {write_best(sweep, best)}"
        )
    print(f"results: {write_results(sweep, outcome, rows, to_resume)}")
    print(write_sweep_report(sweep, rows))
    if resolve_tracking(sweep.base, say=False).tracking.tensorboard:
        where = f"tensorboard --logdir {sweep.sweep_dir} (each trial's run dir has its own)"
        print(f"tensorboard: {where}")
    if to_resume:
        again = ["convoy", "tune", *sys.argv[2:]] if sys.argv[1:2] == ["tune"] else None
        hint = shlex.join(again) if again else f"convoy tune ... --name {sweep.name}"
        if "--resume" not in hint:
            hint += f" --name {sweep.name} --resume" if "--name" not in hint else " --resume"
        print(f"convoy: the sweep was interrupted; continue it with: {hint}", file=sys.stderr)
        return 1
    return 0

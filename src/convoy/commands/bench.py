"""``convoy bench allreduce | scaling | compare``: the command line of ``convoy.bench``."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from convoy.bench.common import bench_name, bench_storage, load_job_without_data
from convoy.bench.plots import check_plot_path, pyplot
from convoy.commands.common import add_recipe_args
from convoy.config import STRATEGY_NAMES

ALLREDUCE_EXAMPLES = """\
examples:
  convoy bench allreduce recipes/default.yaml -o scaling.launcher=torchrun
  convoy bench allreduce -o scaling.launcher=ray -o scaling.num_workers=4 --max-bytes 256M
  convoy bench allreduce -o scaling.use_gpu=true -o scaling.num_workers=8 --dtype bfloat16 \\
      --min-bytes 8 --max-bytes 8G --plot allreduce.png
  convoy bench allreduce -o scaling.launcher=torchrun --json > allreduce.json

Sizes are bytes with an optional binary suffix (8, 64K, 32M, 1G; K = 1024). One rank has no
bus bandwidth (factor 2(n-1)/n = 0): its busbw shows as n/a.
"""

SCALING_EXAMPLES = """\
examples:
  convoy bench scaling recipes/default.yaml --workers 1,2 --mode strong -o scaling.launcher=torchrun
  convoy bench scaling recipes/lm_tiny.yaml --workers 1,2,4 --mode weak --per-worker-batch 8
  convoy bench scaling recipes/default.yaml --workers 1,2,4,8 --mode weak --plot scaling.png

weak: the per-worker batch is fixed (the recipe's global batch / its workers, or
--per-worker-batch) and the global batch grows with N. strong: the recipe's global batch is
fixed and split over N (every N must divide it). Efficiency E = X_N / (N x X_1), X = global
samples/s (tokens/s for language modeling) over the timed steps.
"""

COMPARE_EXAMPLES = """\
examples:
  convoy bench compare recipes/default.yaml -o scaling.launcher=torchrun
  convoy bench compare recipes/lm_tiny.yaml --strategies ddp,fsdp2 --workers 4 --steps 50
  convoy bench compare recipes/lm_tiny.yaml --strategies fsdp2,fsdp2+ac,fsdp2+compile,hsdp \\
      -o scaling.launcher=torchrun --workers 4

Every strategy gets the same seed, global batch and wrap units; 'single' runs it on one
worker. Communication per step per rank (psi = parameter bytes): ddp 2 psi (n-1)/n, fsdp and
fsdp2 (full shard) 3 psi (n-1)/n, single 0.
"""


def add_parser(commands: Any) -> None:
    """Add ``bench`` and its sub-commands to the CLI."""
    bench = commands.add_parser(
        "bench",
        help="benchmark the cluster and the strategies (allreduce, scaling, compare)",
        description="Benchmarks that run through Convoy's launchers, so they measure the "
        "workers a training run gets (local, torchrun, Ray; one node or several).",
    )
    actions = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    parsers = [
        _add_allreduce_parser(actions),
        _add_scaling_parser(actions),
        _add_compare_parser(actions),
    ]
    for parser in parsers:  # raw epilogs; wrap the long descriptions
        parser.description = textwrap.fill(
            parser.description or "", width=88, break_on_hyphens=False
        )


def _add_allreduce_parser(actions: Any) -> argparse.ArgumentParser:
    allreduce = actions.add_parser(
        "allreduce",
        help="all-reduce bus bandwidth over a size sweep (nccl-tests' rows)",
        description="Time in-place torch.distributed.all_reduce (sum) at each size from "
        "--min-bytes to --max-bytes on the recipe's launcher and workers (gloo on CPU, NCCL "
        "with scaling.use_gpu). Prints size, count, type, redop, time (us, mean over ranks), "
        "algbw = size/time and busbw = algbw x 2(n-1)/n in GB/s (1e9 B/s).",
        epilog=ALLREDUCE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_args(allreduce)
    allreduce.add_argument("--min-bytes", default="8", help="smallest size (default 8)")
    allreduce.add_argument("--max-bytes", default="32M", help="largest size (default 32M)")
    allreduce.add_argument("--factor", default="2", help="size multiplier, >= 2 (default 2)")
    allreduce.add_argument("--iters", type=int, default=20, help="timed ops per size (20)")
    allreduce.add_argument("--warmup", type=int, default=5, help="warm-up ops per size (5)")
    allreduce.add_argument(
        "--dtype",
        default="float32",
        help="element type: float32 (default), float16, "
        "bfloat16, float64, int32, int64, int8, uint8",
    )
    _add_output_args(allreduce, "bench runs")
    allreduce.set_defaults(handler=cmd_allreduce)
    return allreduce


def _add_scaling_parser(actions: Any) -> argparse.ArgumentParser:
    scaling = actions.add_parser(
        "scaling",
        help="throughput and scaling efficiency of a recipe at several world sizes",
        description="Train the recipe's model for --warmup + --steps steps at each world size "
        "(no checkpoints), then report global throughput, step time (median, p10, p90 of the "
        "timed steps; a step's time is its slowest rank's) and efficiency E = X_N/(N x X_1).",
        epilog=SCALING_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_args(scaling)
    scaling.add_argument(
        "--workers", metavar="N,N,...", default="1,2,4", help="world sizes (default 1,2,4)"
    )
    scaling.add_argument(
        "--mode",
        choices=["weak", "strong"],
        default="weak",
        help="weak: per-worker batch fixed, global batch N x it (default); strong: the "
        "recipe's global batch split over N",
    )
    scaling.add_argument(
        "--per-worker-batch",
        type=int,
        help="weak mode: samples per worker per step "
        "(default: the recipe's global batch / its scaling.num_workers)",
    )
    _add_step_args(scaling)
    _add_output_args(scaling, "the runs")
    scaling.set_defaults(handler=cmd_scaling)
    return scaling


def _add_compare_parser(actions: Any) -> argparse.ArgumentParser:
    compare = actions.add_parser(
        "compare",
        help="the strategies like for like on one recipe (+ac, +compile, +tpN layouts too)",
        description="Train the recipe with each strategy for --warmup + --steps steps: same "
        "seed, global batch and wrap units. A layout may add +ac (activation checkpointing "
        "of every block), +compile (torch.compile per block) and, to fsdp2 / hsdp, +tpN "
        "(tensor parallelism over N ranks), e.g. fsdp2+ac+compile or fsdp2+tp2; hsdp "
        "without the recipe's shard_size runs as 2 replicas of its data-parallel ranks. "
        "Reports step "
        "time, throughput, peak memory per rank, communication per step, compile time, and "
        "whether the first steps' losses agree.",
        epilog=COMPARE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_args(compare)
    every = ",".join(STRATEGY_NAMES)
    compare.add_argument("--strategies", default=every, help=f"default {every}")
    compare.add_argument(
        "--workers", type=int, default=2, help="workers of the distributed strategies (2)"
    )
    _add_step_args(compare)
    compare.add_argument(
        "--loss-rtol",
        type=float,
        default=1e-4,
        help="relative tolerance of the first steps' loss agreement (default 1e-4)",
    )
    _add_output_args(compare, "the runs")
    compare.set_defaults(handler=cmd_compare)
    return compare


def _add_step_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")


def _add_output_args(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write the figure: .png, .svg or .pdf (a missing folder is created; needs "
        "convoy[plot])",
    )
    parser.add_argument(
        "--out", metavar="DIR", help=f"where {what} go (default: <run.storage_dir>/bench)"
    )


def _check_plot(args: argparse.Namespace) -> None:
    """Fail before anything launches when a plot is asked for and cannot be written: no
    matplotlib, a path that is a directory or has no image suffix, a folder that cannot be
    made (a missing folder is created)."""
    if args.plot:
        pyplot()
        check_plot_path(args.plot)


def _print(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    print(json.dumps(result, indent=2) if args.json else text)


def _plotted(args: argparse.Namespace, path: str) -> None:
    """Say where the figure went (on stderr under --json, so stdout stays one JSON document)."""
    print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)


def cmd_allreduce(args: argparse.Namespace) -> int:
    # Heavy (torch and its process groups): imported only when the command runs, so that
    # building the CLI (every `convoy` command) imports no torch.
    from convoy.bench import allreduce

    sweep = allreduce.make_sweep(
        args.min_bytes, args.max_bytes, args.factor, args.iters, args.warmup, args.dtype
    )
    _check_plot(args)
    job = load_job_without_data(args.recipe, args.override)
    # A given run.name is kept: every node of a multi-node torchrun must name the same run
    # (it is the rendezvous id).
    name = job.run.name or bench_name("allreduce")
    storage = bench_storage(job, args.out)
    job = load_job_without_data(
        args.recipe, [*args.override, f"run.storage_dir={storage}", f"run.name={name}"]
    )
    result = allreduce.run_allreduce(job, sweep)
    _print(args, result, allreduce.format_table(result))
    if args.plot:
        _plotted(args, allreduce.plot(result, args.plot))
    return 0


def cmd_scaling(args: argparse.Namespace) -> int:
    # Heavy (the runs resolve the task, which loads torchmetrics and scipy): imported only
    # when the command runs, so every other `convoy` command starts in about a second.
    from convoy.bench import scaling

    return _plan_run_report(args, scaling.make_plan, scaling.run_scaling, scaling)


def cmd_compare(args: argparse.Namespace) -> int:
    # Heavy (builds models and data, measures memory): imported only when the command runs.
    from convoy.bench import compare

    return _plan_run_report(args, compare.make_plan, compare.run_compare, compare)


def _plan_run_report(args: argparse.Namespace, make_plan: Any, run_plan: Any, module: Any) -> int:
    """Check everything (plot path, every job), run, print the report, draw the plot."""
    _check_plot(args)
    result = run_plan(make_plan(args))
    _print(args, result, module.format_report(result))
    if args.plot:
        _plotted(args, module.plot(result, args.plot))
    return 0

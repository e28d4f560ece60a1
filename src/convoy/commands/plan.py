"""``convoy plan RECIPE``: memory per rank for each strategy and world size, and ``--check``
against torch's memory trackers (see ``convoy.plan`` and ``convoy.plan.check``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from convoy.commands.common import add_override_arg
from convoy.config import STRATEGY_NAMES, load_job

EXAMPLES = """\
examples:
  convoy plan recipes/lm_tiny.yaml
  convoy plan recipes/lm_tiny.yaml -o model.name=gpt_1b -o data.seq_len=2048 \\
      -o data.batch_size=64 -o precision=bf16 --world-sizes 1,2,4,8 --gpu-memory 80GiB
  convoy plan recipes/default.yaml --strategies single,fsdp2 --check
  convoy plan recipes/lm_tiny.yaml --strategies fsdp2,hsdp --tp-sizes 1,2 --world-sizes 4
"""


def add_parser(commands: Any) -> None:
    """Add ``plan`` to the CLI's sub-commands."""
    parser = commands.add_parser(
        "plan",
        help="memory per rank for each strategy and world size; --check against trackers",
        description="Plan the memory one rank needs (parameters, gradients, optimizer state, "
        "activations, backward and optimizer-step transients, DDP buckets / FSDP working set) "
        "for each strategy and world size, in the driver, without Ray or workers. The model "
        "is built on the meta device and run under FakeTensorMode, so any size plans on CPU.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", nargs="?", help="YAML recipe; the built-in defaults if omitted")
    add_override_arg(parser, "model.name=gpt_1b")
    parser.add_argument(
        "--world-sizes", default="1,2,4,8", help="comma-separated world sizes (default 1,2,4,8)"
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        help="memory per device, e.g. 80GiB, 80GB, 24G, 81920MiB or bytes: say which layouts fit",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGY_NAMES),
        help=f"comma-separated strategies to plan (default: all, {','.join(STRATEGY_NAMES)})",
    )
    parser.add_argument(
        "--tp-sizes",
        default=None,
        help="comma-separated tensor-parallel sizes to plan for the strategies that take "
        "strategy.tp_size (default: the recipe's)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also run two training steps under torch's memory trackers (fake process group, "
        "FakeTensorMode) and print planned vs tracked",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Parse every flag first (a bad one is a one-line error, exit 2), then plan."""
    # Heavy (the planner builds the model and its data: FSDP, the tasks, torchmetrics):
    # imported when the command runs, so every other `convoy` command starts in a second.
    from convoy.plan import (
        Planner,
        format_plan,
        parse_memory,
        parse_strategies,
        parse_world_sizes,
        plan_job,
        plan_to_dict,
        quiet_warnings,
    )

    world_sizes = parse_world_sizes(args.world_sizes)
    tp_sizes: list[int | None] = (
        [None] if args.tp_sizes is None else [*parse_world_sizes(args.tp_sizes, "--tp-sizes")]
    )
    strategies = parse_strategies(args.strategies)
    budget = None if args.gpu_memory is None else parse_memory(args.gpu_memory)
    job = load_job(args.recipe, args.override)
    with quiet_warnings():
        planner = Planner(job)
        plan = plan_job(job, strategies, world_sizes, budget, planner, tp_sizes)
        rows = None
        if args.check:
            # Heavy (runs the tasks under torch's trackers): imported only for --check.
            from convoy.plan.check import check_layouts

            sizes = [layout.world_size for layout in plan.layouts]
            rows = check_layouts(job, strategies, sorted(set(sizes)), planner, tp_sizes)
    if args.json:
        from convoy.plan.check import check_to_dict  # heavy: see check_layouts above

        data = plan_to_dict(plan)
        if rows is not None:
            data["check"] = check_to_dict(rows)
        print(json.dumps(data, indent=2))
        return 0
    print(format_plan(plan))
    if rows is not None:
        from convoy.plan.check import format_check  # heavy: see check_layouts above

        print()
        print(
            "check: planned vs tracked (rank 0, two steps under torch.distributed._tools trackers)"
        )
        print(format_check(rows))
    return 0

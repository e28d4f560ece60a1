"""``convoy config show RECIPE [-o key.path=value ...]``: the resolved, validated config."""

from __future__ import annotations

import argparse
from typing import Any

from convoy.commands.common import add_recipe_args
from convoy.config import job_to_yaml, load_job


def add_parser(commands: Any) -> None:
    """Add ``config`` and its actions to ``convoy``'s sub-parsers."""
    config = commands.add_parser("config", help="inspect configs", description="Inspect configs.")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show_parser = actions.add_parser(
        "show",
        help="print the resolved, validated config",
        description="Load a recipe, apply overrides, validate everything that can be checked "
        "before a worker starts, and print the resolved config as YAML.",
    )
    add_recipe_args(show_parser)
    show_parser.set_defaults(handler=show)


def show(args: argparse.Namespace) -> int:
    """Print the recipe as preflight resolved it."""
    # Heavy (preflight loads the tasks and torchmetrics): imported only when the command runs.
    from convoy.preflight import preflight

    print(job_to_yaml(preflight(load_job(args.recipe, args.override))), end="")
    return 0

"""Command-line glue for the commands that live beside their feature: ``bench``, ``plan``,
``report``.

Each module here has ``add_parser(commands)``, which adds its sub-command and sets
``handler`` (``args -> exit code``) with ``parser.set_defaults``. ``convoy.cli`` registers
them and dispatches on ``args.handler``; heavy imports stay inside the handlers so that
``convoy --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

COMMAND_MODULES = ("bench", "plan", "report", "tune")


def add_parsers(commands: Any) -> None:
    """Add every command module's sub-command (a module not written yet is skipped)."""
    import importlib

    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"convoy.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"convoy.commands.{name}":
                raise
            continue
        module.add_parser(commands)


def add_override_arg(parser: argparse.ArgumentParser, example: str, what: str = "") -> None:
    """The ``-o/--override KEY=VALUE`` option every recipe-taking command has."""
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config field{what} by its dotted path, e.g. -o {example} "
        "(values are parsed as YAML; repeat for several)",
    )

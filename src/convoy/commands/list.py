"""``convoy list``: the names each registry accepts."""

from __future__ import annotations

import argparse
from typing import Any

from convoy.config import STRATEGY_NAMES
from convoy.launchers import LAUNCHER_NAMES


def add_parser(commands: Any) -> None:
    """Add the ``list`` sub-command to ``convoy``'s sub-parsers."""
    parser = commands.add_parser(
        "list",
        help="list tasks, models, datasets, strategies and launchers",
        description="List the names each registry accepts.",
    )
    parser.set_defaults(handler=run)


def run(_: argparse.Namespace) -> int:
    """Print one line per registry."""
    # Heavy (torch; the built-in tasks load torchmetrics): imported only when the command
    # runs, so that building the CLI (every `convoy` command) imports no torch.
    from convoy.data.registry import DATASETS
    from convoy.models.registry import MODELS
    from convoy.tasks import TASKS

    print("tasks:      " + ", ".join(TASKS) + "  (or package.module:Class)")
    print("models:     " + ", ".join(MODELS) + "  (or package.module:factory)")
    print("datasets:   " + ", ".join(DATASETS) + "  (or package.module:function)")
    print("strategies: " + ", ".join(STRATEGY_NAMES))
    print("launchers:  " + ", ".join(LAUNCHER_NAMES))
    return 0

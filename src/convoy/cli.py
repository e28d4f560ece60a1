"""``convoy``: the one command-line entry point.

    convoy train RECIPE.yaml [-o key.path=value ...]
    convoy config show RECIPE.yaml [-o key.path=value ...]
    convoy export RUN_DIR [--checkpoint step_N] [--format safetensors|hf]
    convoy evaluate EXPORT_DIR
    convoy list
    convoy data prepare-imagenet|convert|synth-telematics|inspect ...
    convoy k8s render|validate|submit|status|logs|delete|drain-node|gc ...
    convoy bench allreduce|scaling|compare ...
    convoy plan RECIPE.yaml
    convoy report RUN [RUN ...]
    convoy tune RECIPE.yaml --space SPACE.yaml

This module only builds the parser from the command modules in :mod:`convoy.commands` (each
adds its sub-command and the ``handler`` that runs it) and dispatches. Errors caused by input
(a bad config, a missing dataset, an impossible resource request) are printed as one paragraph
without a traceback, with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from convoy.commands import (
    bench,
    config,
    data,
    evaluate,
    export,
    k8s,
    plan,
    report,
    train,
    tune,
)
from convoy.commands import list as list_command
from convoy.commands.common import EXAMPLES
from convoy.engine.stop import STOPPED_EXIT_CODE, StopRequested
from convoy.errors import ConvoyError

# In the order `convoy --help` lists them.
COMMANDS = (train, config, export, evaluate, list_command, data, k8s, bench, plan, report, tune)


def build_parser() -> argparse.ArgumentParser:
    """``convoy``'s parser: one sub-command per module of ``COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="convoy",
        description="Distributed PyTorch training on Ray: one recipe, five strategies "
        "(single, ddp, fsdp, fsdp2, hsdp), three launchers (local, torchrun, ray).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments), run the command, return its exit
    code: 2 for an input error, ``STOPPED_EXIT_CODE`` for a run stopped on request."""
    args = build_parser().parse_args(argv)
    # As `python -m` does: the user's own modules (model.name / data.name / task.name given as
    # package.module:attr) import from the directory convoy is run in. Ray's workers and
    # torchrun's `python -m` workers put the same directory on their path.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return args.handler(args)
    except StopRequested as exc:
        command = shlex.join(["convoy", *(sys.argv[1:] if argv is None else argv)])
        again = "to resume" if exc.saved else "to start again"
        shown = "" if exc.shown else f"convoy: {exc}\n"
        print(f"{shown}convoy: {again}: {command}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    except ConvoyError as exc:
        print(f"convoy: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]

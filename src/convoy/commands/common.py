"""Arguments and texts that several commands share."""

from __future__ import annotations

import argparse

EXAMPLES = """\
examples:
  convoy train recipes/default.yaml
  convoy train recipes/default.yaml -o strategy.name=fsdp2 -o scaling.num_workers=2
  convoy train recipes/digits_mlp.yaml -o optim.lr=3e-3 -o run.epochs=5
  convoy train recipes/lm_tiny.yaml -o scaling.launcher=torchrun
  convoy config show recipes/default.yaml -o scaling.launcher=torchrun
  convoy data convert ~/data/cifar-10-python.tar.gz ~/data/cifar10-parquet
"""


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


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """The optional ``RECIPE`` argument and ``-o/--override`` of the commands that train or
    inspect a recipe."""
    parser.add_argument("recipe", nargs="?", help="YAML recipe; the built-in defaults if omitted")
    add_override_arg(parser, "optim.lr=3e-4")

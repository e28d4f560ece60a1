"""``convoy.cli`` is a dispatcher: every command lives in ``convoy.commands``, one module each,
registers its own parser and sets the handler of every action, and no command module reaches
back up into ``convoy.cli``."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import convoy.cli
import convoy.commands
from convoy.cli import COMMANDS, build_parser

COMMANDS_DIR = Path(convoy.commands.__file__).parent
# Modules of convoy.commands that hold what several commands share, not a command.
SHARED = {"__init__", "common", "summary_lines"}


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple]:
    """Every parser that has no sub-commands, with the words that reach it."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
    for action in subparsers:
        for name, child in action.choices.items():
            yield from _leaves(child, (*path, name))


def _imported_modules(source: str) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, at any depth of the code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_command_module_is_registered_under_its_name() -> None:
    modules = {path.stem for path in COMMANDS_DIR.glob("*.py")} - SHARED
    assert {command.__name__.rpartition(".")[2] for command in COMMANDS} == modules
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(subparsers.choices or ()) == [c.__name__.rpartition(".")[2] for c in COMMANDS]


def test_every_action_has_a_handler() -> None:
    leaves = list(_leaves(build_parser()))
    assert len(leaves) > len(COMMANDS)  # config, data, k8s and bench have actions
    for path, parser in leaves:
        handler = parser.get_default("handler")
        assert callable(handler), f"convoy {' '.join(path)} sets no handler"


def test_no_command_module_imports_the_cli() -> None:
    for path in COMMANDS_DIR.glob("*.py"):
        imported = _imported_modules(path.read_text())
        assert "convoy.cli" not in imported, f"{path.name} imports convoy.cli (an arrow up)"
    # The scan sees an import inside a function too.
    assert "convoy.cli" in _imported_modules("def f():\n    from convoy.cli import main\n")


def test_the_cli_only_builds_the_parser_and_dispatches() -> None:
    tree = ast.parse(Path(convoy.cli.__file__).read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    assert functions == ["build_parser", "main"]


# What a command's own work needs, never the parser: loading any of these costs every
# `convoy` command (`--help`, `config show`, `k8s render`) seconds of start-up.
HEAVY_FOR_A_PARSER = (
    "torch",  # 1.2-1.5 CPU-s: `convoy --help`, `convoy k8s status|logs|gc` need none of it
    "torchmetrics",  # with scipy and matplotlib, through the tasks
    "torch.distributed.checkpoint",  # with DTensor and sympy
    "torch.distributed.fsdp",
    "convoy.tasks",
    "convoy.plan.planner",
    "convoy.tune.sweep",
    "pyarrow",
    "ray",
)


def test_building_the_parser_loads_no_command_s_heavy_modules() -> None:
    """Nor does the module of ``convoy k8s drain-node``, a Ray worker pod's preStop hook that
    runs while the pod's training saves."""
    code = (
        "import sys\n"
        "from convoy.cli import build_parser\n"
        "build_parser()\n"
        "import convoy.launchers.ray_preemption\n"
        f"print(','.join(m for m in {HEAVY_FOR_A_PARSER!r} if m in sys.modules))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "", loaded.stdout

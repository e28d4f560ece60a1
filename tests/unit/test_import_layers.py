"""The import contracts in pyproject.toml (``[tool.importlinter]``) hold, and can fail.

``lint-imports`` runs in a subprocess: grimp finds ``convoy`` on the import path, so the check
of a copied package must not see the one this process imported.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "pyproject.toml"


def lint_imports(source_root: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts on the ``convoy`` under
    ``source_root``; only ``contracts`` (their ids) where given."""
    command = [
        sys.executable,
        "-c",
        "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())",
        str(CONFIG),
        "--no-cache",
        "--no-logo",
        *(option for contract in contracts for option in ("--contract", contract)),
    ]
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run(
        command, env=env, cwd=source_root, capture_output=True, text=True, timeout=120
    )


def contract_names() -> list[str]:
    """The names of the contracts in pyproject.toml, in order."""
    section = CONFIG.read_text().split("\n[tool.importlinter]\n", 1)[1]
    section = re.split(r"^\[tool\.(?!importlinter)", section, flags=re.MULTILINE)[0]
    return re.findall(r'^name = "(.+)"$', section, re.MULTILINE)


@pytest.fixture(scope="module")
def report() -> str:
    """What ``lint-imports`` says of the package: one line per contract, KEPT or BROKEN."""
    result = lint_imports(REPO / "src")
    assert "Contracts:" in result.stdout, result.stdout + result.stderr
    return result.stdout


def test_every_contract_is_checked(report: str) -> None:
    """Each contract in pyproject.toml gets its line (a typo in one would stop them all)."""
    names = contract_names()
    assert len(names) >= 2 and "Layers: each package imports only from the layers below it" in names
    for name in names:
        assert f"{name} KEPT" in report or f"{name} BROKEN" in report, name


@pytest.mark.parametrize("name", contract_names())
def test_the_package_keeps_the_contract(report: str, name: str) -> None:
    assert f"{name} KEPT" in report, report


def test_a_forbidden_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    """The check can fail: ``convoy.errors``, the lowest layer, importing the CLI at the top is
    named, and the same copy without that import does not name it."""
    shutil.copytree(
        REPO / "src" / "convoy", tmp_path / "convoy", ignore=shutil.ignore_patterns("__pycache__")
    )
    violation = "convoy.errors is not allowed to import convoy.cli"
    before = lint_imports(tmp_path, "layers")
    assert violation not in before.stdout, before.stdout + before.stderr

    errors = tmp_path / "convoy" / "errors.py"
    errors.write_text(errors.read_text() + "\nimport convoy.cli  # noqa: E402, F401\n")
    after = lint_imports(tmp_path, "layers")
    assert after.returncode != 0
    assert "Layers: each package imports only from the layers below it BROKEN" in after.stdout
    assert violation in after.stdout, after.stdout + after.stderr


def test_a_circle_inside_a_package_breaks_the_acyclic_contract(tmp_path: Path) -> None:
    """``convoy.data.base`` importing ``convoy.data.loaders`` back closes a circle that the
    layers contract cannot see (both are in ``data``); the acyclic contract names it."""
    shutil.copytree(
        REPO / "src" / "convoy", tmp_path / "convoy", ignore=shutil.ignore_patterns("__pycache__")
    )
    circle = "No cycles are allowed in convoy.data."
    assert circle not in lint_imports(tmp_path, "acyclic").stdout

    base = tmp_path / "convoy" / "data" / "base.py"
    base.write_text(base.read_text() + "\nimport convoy.data.loaders  # noqa: E402, F401\n")
    after = lint_imports(tmp_path, "acyclic")
    assert after.returncode != 0
    assert circle in after.stdout, after.stdout + after.stderr

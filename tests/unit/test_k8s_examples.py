"""The manifests committed under examples/k8s/ are what ``convoy k8s render`` writes today:
each is rendered again with the command its README gives and compared."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from convoy.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "k8s"


def render_commands() -> list[tuple[list[str], str]]:
    """(arguments after ``convoy``, output file) of each render line in the README."""
    commands = []
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        if line.startswith("convoy k8s render "):
            words = shlex.split(line)
            out = words.index(">")
            commands.append((words[1:out], words[out + 1]))
    return commands


def test_the_readme_renders_every_committed_example():
    rendered = sorted(Path(out).name for _, out in render_commands())
    committed = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert rendered == committed
    kinds = {(Path(out).name.split(".")[0], "--kind" in args) for args, out in render_commands()}
    assert kinds == {
        ("default", False),
        ("default", True),
        ("cifar10_vit", False),
        ("cifar10_vit", True),
    }


@pytest.mark.parametrize(
    ("args", "out"), render_commands(), ids=lambda v: Path(v).name if isinstance(v, str) else ""
)
def test_committed_example_matches_a_fresh_render(args, out, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(args) == 0
    fresh = capsys.readouterr().out
    committed = (REPO / out).read_text()
    assert fresh == committed, (
        f"{out} is out of date; regenerate it from the repository root with the commands in "
        "examples/k8s/README.md"
    )

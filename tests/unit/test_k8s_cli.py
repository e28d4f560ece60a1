"""The ``convoy k8s`` command surface: pinned, and every action has help worth reading."""

from __future__ import annotations

import pytest

from convoy.cli import build_parser, main

ACTIONS = ["delete", "gc", "logs", "render", "status", "submit", "validate"]


def _subparsers(parser):
    return next(a for a in parser._actions if a.dest and a.dest.endswith("command"))


def test_k8s_actions_and_options_are_pinned():
    k8s = _subparsers(build_parser()).choices["k8s"]
    actions = _subparsers(k8s).choices
    assert sorted(actions) == ACTIONS
    options = {
        name: sorted(o for a in p._actions for o in a.option_strings) for name, p in actions.items()
    }
    cluster = ["--context", "--kubeconfig"]
    assert options["render"] == sorted(["-h", "--help", "-o", "--override", "--kind", "--out"])
    assert options["submit"] == sorted(
        ["-h", "--help", "-o", "--override", "--kind", "--dry-run", "--watch", *cluster]
    )
    assert options["status"] == sorted(
        ["-h", "--help", "--kind", "-n", "--namespace", "--watch", "--timeout", *cluster]
    )
    assert options["gc"] == sorted(
        ["-h", "--help", "-n", "--namespace", "--dry-run", "--grace", *cluster]
    )


@pytest.mark.parametrize("action", [[], *([a] for a in ACTIONS)])
def test_every_k8s_action_has_help(action, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["k8s", *action, "--help"])
    assert exit_info.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 4

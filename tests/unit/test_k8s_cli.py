"""The ``convoy k8s`` command surface: pinned, and every action has help worth reading."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from convoy.cli import build_parser, main

ACTIONS = ["delete", "drain-node", "gc", "logs", "render", "status", "submit", "validate"]


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


# One-line errors, never a traceback (exit 2, "convoy: error: ...").

REPO = Path(__file__).resolve().parents[2]
IMAGE = ["-o", "k8s.image=registry.example.com/convoy:0.1.0", "-o", "k8s.pvc=convoy-runs"]


def _error(argv, capsys, monkeypatch=None) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("convoy: error: ")
    return err


def _rendered(tmp_path, capsys, *extra: str) -> Path:
    out = tmp_path / "rayjob.yaml"
    assert main(["k8s", "render", str(REPO / "recipes/default.yaml"), *IMAGE, *extra,
                 "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    return out


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it (No such file or directory)"),
        ("a: [unclosed\n", "not valid YAML at line 2"),
        ("", "no manifests"),
        ("# only a comment\n", "no manifests"),
    ],
)
def test_validate_reads_files_with_one_line_errors(tmp_path, capsys, content, says):
    path = tmp_path / "m.yaml"
    if content is not None:
        path.write_text(content)
    err = _error(["k8s", "validate", str(path)], capsys)
    assert says in err
    assert len(err.splitlines()) == 1


def test_validate_a_recipe_says_render_it(capsys):
    err = _error(["k8s", "validate", str(REPO / "recipes/default.yaml")], capsys)
    assert "this looks like a recipe, not a manifest; use convoy k8s render RECIPE" in err
    assert "None" not in err


def test_validate_reads_stdin(tmp_path, capsys, monkeypatch):
    text = _rendered(tmp_path, capsys).read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["k8s", "validate", "-"]) == 0
    assert capsys.readouterr().out == "-: 2 manifest(s) valid\n"


def test_render_out_to_a_missing_directory(tmp_path, capsys):
    out = tmp_path / "missing" / "x.yaml"
    err = _error(
        ["k8s", "render", str(REPO / "recipes/default.yaml"), *IMAGE, "--out", str(out)], capsys,
    )  # fmt: skip
    assert f"--out {out}: cannot write it" in err
    assert not out.parent.exists()


def test_overrides_apply_only_to_a_recipe(tmp_path, capsys):
    path = _rendered(tmp_path, capsys)
    err = _error(["k8s", "submit", str(path), "-o", "k8s.image=x:1"], capsys)
    assert "-o/--override applies only to a recipe" in err
    assert len(err.splitlines()) == 1


def test_submit_validates_before_it_connects(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    path = _rendered(tmp_path, capsys)
    path.write_text(path.read_text().replace("backoffLimit:", "backofLimit:"))
    err = _error(["k8s", "submit", str(path)], capsys)
    assert "backofLimit: unknown field (did you mean 'backoffLimit'?)" in err
    assert "no Kubernetes cluster" not in err


def test_a_missing_or_malformed_kubeconfig_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("kubernetes")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")
    err = _error(["k8s", "status", "x"], capsys)
    assert f"no file at KUBECONFIG={tmp_path / 'missing'}" in err
    assert ".;" not in err
    broken = tmp_path / "config"
    broken.write_text("apiVersion: v1\nclusters: [\n")
    monkeypatch.setenv("KUBECONFIG", str(broken))
    err = _error(["k8s", "status", "x"], capsys)
    assert f"kubeconfig KUBECONFIG={broken}: not valid YAML" in err
    assert len(err.splitlines()) == 1


def test_an_insecure_kubeconfig_silences_urllib3s_warning(tmp_path):
    pytest.importorskip("kubernetes")
    import warnings

    import urllib3

    from convoy.k8s.client import KubeApi

    config = tmp_path / "config"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KubeApi.connect(str(config))
        warnings.warn("x", urllib3.exceptions.InsecureRequestWarning, stacklevel=1)  # ignored
        with pytest.raises(UserWarning):
            warnings.warn("other", UserWarning, stacklevel=1)

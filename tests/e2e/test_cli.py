"""The command line: help worth reading, config show, and errors without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convoy.cli import build_parser, main

pytestmark = pytest.mark.e2e
DEFAULT = str(Path(__file__).resolve().parents[2] / "recipes" / "default.yaml")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convoy", *args], capture_output=True, text=True, timeout=120
    )


def test_command_set_is_pinned() -> None:
    """The CLI surface grows only on purpose."""
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(subparsers.choices) == [
        "bench",
        "config",
        "data",
        "evaluate",
        "export",
        "k8s",
        "list",
        "plan",
        "report",
        "train",
        "tune",
    ]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["train"],
        ["config"],
        ["config", "show"],
        ["list"],
        ["export"],
        ["evaluate"],
        ["bench"],
        ["bench", "allreduce"],
        ["bench", "scaling"],
        ["bench", "compare"],
        ["plan"],
        ["report"],
        ["tune"],
    ],
)
def test_every_command_has_help(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: convoy")
    assert len(text.splitlines()) > 4


def test_train_help_shows_overrides_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "-o KEY=VALUE" in text and "optim.lr=3e-4" in text and "examples:" in text


def test_config_show_applies_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "show", DEFAULT, "-o", "optim.lr=3e-4", "-o", "strategy.name=fsdp2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "lr: 0.0003" in out
    assert "name: fsdp2" in out and "reshard_after_forward: true" in out


def test_list_names_every_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in (
        "language_modeling",
        "vit_course",
        "gpt_tiny",
        "digits",
        "text",
        "fsdp2",
        "torchrun",
    ):
        assert name in out


BAD_INPUT = [
    ("strategy.name=zero3", "strategy.name: got 'zero3'; allowed:"),
    ("data.batch_size=33", "data.batch_size: got 33; the global batch must be divisible"),
    ("precision=fp16", "precision: got 'fp16'; fp16 with a grad scaler needs a GPU"),
]


def assert_one_line_error(code: int, err: str, expected: str) -> None:
    assert code == 2
    assert err.startswith("convoy: error: " + expected)
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("override", "expected"), BAD_INPUT)
def test_bad_input_is_one_paragraph_without_traceback(
    override: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``main`` in this process: the CLI's error path is what is tested, not its start."""
    code = main(["train", DEFAULT, "-o", override])
    out, err = capsys.readouterr()
    assert_one_line_error(code, err, expected)
    assert out == ""  # nothing started


def test_python_m_convoy_prints_bad_input_alone_and_exits_2() -> None:
    """The installed entry (``python -m convoy``) in a process of its own: the one line is all
    of stderr (no warning of an import above it), the exit code is the process's."""
    override, expected = BAD_INPUT[0]
    result = run_cli("train", DEFAULT, "-o", override)
    assert_one_line_error(result.returncode, result.stderr, expected)
    assert result.stdout == ""  # nothing started


def test_a_run_directory_that_is_a_file_is_one_line_and_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "exp1"
    blocker.write_text("not a run")
    code = main(
        [
            "train",
            DEFAULT,
            *("-o", "scaling.launcher=local", "-o", "scaling.num_workers=1"),
            *("-o", f"run.storage_dir={tmp_path}", "-o", "run.name=exp1"),
        ]
    )
    assert_one_line_error(
        code,
        capsys.readouterr().err,
        f"run.name: got 'exp1'; the run's directory {blocker} is a file, not a folder; choose "
        "another run.name or move that file away",
    )
    assert blocker.read_text() == "not a run"
    assert [p.name for p in tmp_path.iterdir()] == ["exp1"]  # nothing written beside it


def test_convoy_imports_and_trains_without_ray(tmp_path: Path) -> None:
    """Ray is optional: block it and run the local launcher end to end."""
    script = (
        "import sys; sys.modules['ray'] = None\n"
        "import convoy\n"
        "job = convoy.load_job(None, ['model.name=mlp', 'strategy.name=single', "
        "'scaling.launcher=local', 'scaling.num_workers=1', 'run.epochs=1', "
        f"'run.progress=off', 'run.storage_dir={tmp_path}'])\n"
        "result = convoy.train(job)\n"
        "assert 'ray' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print(result.summary['metrics']['test/samples'])\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "359"


def test_ray_launcher_without_ray_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray made unimportable in this process (as a missing package looks to an import)."""
    monkeypatch.setitem(sys.modules, "ray", None)
    code = main(["train", "-o", "model.name=mlp", "-o", f"run.storage_dir={tmp_path}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "convoy: error: scaling.launcher: got 'ray'; the ray launcher needs ray (the 'ray' "
        "extra): pip install 'convoy[ray]' (in a checkout: make run), or use 'local' / 'torchrun'"
    )

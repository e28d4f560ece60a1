"""A feature whose extra is not installed says so in one line, with the exact install line,
before any worker starts (``convoy.imports.missing_extra``). ``make run`` installs only the
core and Ray, so the default job must need nothing else. A missing package is simulated by
``sys.modules[name] = None``, which makes its import raise ``ImportError``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest

from convoy.cli import main
from convoy.config import load_job
from convoy.imports import installed, missing_extra
from convoy.preflight import resolve_tracking

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "digits_mlp.yaml")
SPACE = str(ROOT / "recipes" / "sweeps" / "default_space.yaml")


def error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``convoy ARGV`` prints on stderr; it must fail with exit code 2 and one line."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_the_line_names_the_package_the_extra_and_both_install_commands() -> None:
    assert missing_extra("convoy report", "matplotlib", "plot") == (
        "convoy report needs matplotlib (the 'plot' extra): pip install 'convoy[plot]' "
        "(in a checkout: make dev)"
    )
    # make run installs Ray; every other extra comes with make dev (and make test).
    assert missing_extra("the ray launcher", "ray", "ray").endswith(
        "pip install 'convoy[ray]' (in a checkout: make run)"
    )


def test_installed_finds_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert installed("json") and installed("convoy.imports")
    assert not installed("convoy_no_such_package")
    assert not installed("convoy_no_such_package.sub")  # a missing parent is no error
    monkeypatch.setitem(sys.modules, "json", None)
    assert not installed("json")


def test_default_tensorboard_is_off_quietly_where_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    job = load_job(RECIPE)
    assert job.tracking.tensorboard  # the default
    resolved = resolve_tracking(job)
    assert not resolved.tracking.tensorboard
    assert resolved.model_copy(update={"tracking": job.tracking}) == job  # nothing else moved
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("override", "package", "line"),
    [
        (
            "tracking.tensorboard=true",
            "tensorboard",
            "convoy: tracking.tensorboard is on but the sink is off: the TensorBoard sink needs "
            "tensorboard (the 'tracking' extra): pip install 'convoy[tracking]' (in a checkout: "
            "make dev), or set tracking.tensorboard: false",
        ),
        (
            "tracking.mlflow.enabled=true",
            "mlflow",
            "convoy: tracking.mlflow.enabled is on but the sink is off: the MLflow sink needs "
            "mlflow (the 'tracking' extra): pip install 'convoy[tracking]' (in a checkout: "
            "make dev), or set tracking.mlflow.enabled: false",
        ),
    ],
)
def test_a_sink_the_recipe_turns_on_is_said_once_before_workers_start(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    override: str,
    package: str,
    line: str,
) -> None:
    monkeypatch.setitem(sys.modules, package, None)
    switch: object = resolve_tracking(load_job(RECIPE, [override]))
    for part in override.partition("=")[0].split("."):
        switch = getattr(switch, part)
    assert switch is False
    assert capsys.readouterr().err.strip().splitlines() == [line]
    resolve_tracking(load_job(RECIPE, [override]), say=False)  # a sweep's trials stay quiet
    assert capsys.readouterr().err == ""


def test_installed_sinks_leave_the_job_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("convoy.preflight.installed", lambda module: True)
    job = load_job(RECIPE, ["tracking.mlflow.enabled=true"])
    assert resolve_tracking(job) is job


def test_tune_optuna_without_optuna(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)
    argv = ["tune", RECIPE, "--space", SPACE, "--search", "optuna", "--samples", "1"]
    assert error_line([*argv, "-o", f"run.storage_dir={tmp_path}"], capsys) == (
        "convoy: error: --search optuna needs optuna (the 'tune' extra): "
        "pip install 'convoy[tune]' (in a checkout: make dev)"
    )
    assert not any(tmp_path.iterdir())  # nothing started


@pytest.mark.parametrize("benchmark", [["allreduce"], ["scaling", RECIPE], ["compare", RECIPE]])
def test_bench_plot_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    benchmark: list[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["bench", *benchmark, "--plot", str(tmp_path / "plot.png")]
    assert error_line(argv, capsys) == (
        "convoy: error: --plot needs matplotlib (the 'plot' extra): "
        "pip install 'convoy[plot]' (in a checkout: make dev)"
    )


def test_k8s_without_its_client(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    assert error_line(["k8s", "status", "some-run"], capsys) == (
        "convoy: error: convoy k8s needs kubernetes (the 'k8s' extra): "
        "pip install 'convoy[k8s]' (in a checkout: make dev)"
    )


def test_k8s_names_cel_python_by_its_pip_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from convoy.k8s import K8sError, require

    monkeypatch.setitem(sys.modules, "celpy", None)
    with pytest.raises(K8sError) as error:
        require("celpy")
    assert str(error.value) == missing_extra("convoy k8s", "cel-python", "k8s")


def test_sensors_without_sktime(monkeypatch: pytest.MonkeyPatch) -> None:
    from convoy.data.sensors import load_basicmotions
    from convoy.errors import ConvoyError

    monkeypatch.setitem(sys.modules, "sktime", None)
    monkeypatch.setitem(sys.modules, "sktime.datasets", None)
    cfg = load_job(str(ROOT / "recipes" / "sensor_basicmotions.yaml")).data
    with pytest.raises(ConvoyError) as error:
        load_basicmotions(cfg)
    assert str(error.value) == missing_extra("data.name 'basicmotions'", "sktime", "sensors")


def test_sweep_report_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from convoy.tune.results import write_sweep_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert write_sweep_report(cast(Any, None), []) == (
        "report: skipped; the sweep report needs matplotlib (the 'plot' extra): "
        "pip install 'convoy[plot]' (in a checkout: make dev)"
    )

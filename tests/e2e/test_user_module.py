"""The README's user module (examples/tumor_screening.py): the user's own model, data and task
train under torchrun and Ray, rank checkpoints by the task's metric, export and evaluate."""

from __future__ import annotations

from pathlib import Path

import pytest

import convoy
from convoy.checkpoint import committed_checkpoints, read_meta
from convoy.config import load_job
from convoy.export import evaluate_exported, export_checkpoint
from convoy.launchers import RunResult
from convoy.outputs import CONFIG_FILE

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "user_module.yaml"


def user_job(storage: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_job(
        RECIPE, [f"run.storage_dir={storage}", "run.progress=plain", "run.epochs=10", *overrides]
    )


def assert_screens_well(result: RunResult) -> None:
    metrics = result.summary["metrics"]
    assert result.summary["world_size"] == 2
    assert result.summary["task"] == "examples.tumor_screening:WeightedBinary"
    # The user's torchmetrics, reduced over both ranks: 142 held-out patients, each once.
    assert metrics["test/samples"] == 142
    assert metrics["test/acc"] >= 0.9
    assert metrics["test/auroc"] >= 0.95
    assert {"val/recall", "val/auroc", "train/acc"} <= set(metrics)


def test_user_module_under_torchrun(tmp_path: Path) -> None:
    result = convoy.train(user_job(tmp_path, "scaling.launcher=torchrun"))
    assert_screens_well(result)
    # Export and evaluate in one process reproduce the recorded test metrics of the user task.
    run = result.run_dir
    latest = committed_checkpoints(run)[-1]
    recorded = read_meta(run, latest)["metrics"]
    measured = evaluate_exported(export_checkpoint(run, tmp_path / "export", latest))
    for key in ("test/loss", "test/acc", "test/auroc"):
        assert measured[key] == pytest.approx(recorded[key], rel=1e-5)


@pytest.mark.ray
def test_user_module_under_ray(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    job = user_job(tmp_path, "scaling.launcher=ray", "scaling.cpus_per_worker=0.5")
    result = convoy.train(job)
    assert_screens_well(result)
    # best_mode auto resolved in the driver from the user's task: higher AUROC is better.
    recorded = load_job(result.run_dir / CONFIG_FILE)
    assert (recorded.checkpoint.best_metric, recorded.checkpoint.best_mode) == ("val/auroc", "max")

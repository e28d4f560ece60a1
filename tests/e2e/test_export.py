"""Export round trip: safetensors from a (sharded) checkpoint reproduce the recorded metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convoy.cli import main
from convoy.config import load_job
from convoy.export import MODEL_FILE, WEIGHTS_FILE, evaluate_exported, load_exported
from convoy.testing import run_on_gloo, train_on_rank

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"


def test_fsdp2_checkpoint_exports_and_reproduces_test_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load_job(
        RECIPE,
        [
            "strategy.name=fsdp2",
            "scaling.launcher=torchrun",
            "scaling.num_workers=2",
            "run.epochs=3",
            "run.name=exp",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
        ],
    )
    summary = run_on_gloo(train_on_rank, 2, job)[0]
    out = tmp_path / "exported"
    assert main(["export", str(job.run_dir), "--format", "safetensors", "--out", str(out)]) == 0
    assert (out / WEIGHTS_FILE).is_file()
    recorded = json.loads((out / MODEL_FILE).read_text())["metrics"]
    assert recorded["test/acc"] == summary["metrics"]["test/acc"]

    model, _ = load_exported(out)  # plain module, one device, no process group
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    measured = evaluate_exported(out)
    assert measured["test/acc"] == recorded["test/acc"]
    assert measured["test/samples"] == 359
    assert measured["test/loss"] == pytest.approx(recorded["test/loss"], rel=1e-6)

    capsys.readouterr()
    assert main(["evaluate", str(out)]) == 0
    assert "test/acc" in capsys.readouterr().out


def test_export_of_a_run_without_checkpoints_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / "nothing-here")]) == 2
    assert "has no committed checkpoints" in capsys.readouterr().err

"""Hang detection: a rank that stops making progress is named, and the retry completes."""

from __future__ import annotations

from pathlib import Path

import pytest

import convoy
from convoy.config import load_job

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"


def test_hang_on_rank_1_is_reported_and_the_restart_finishes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    job = load_job(
        RECIPE,
        [
            "scaling.launcher=torchrun",
            "scaling.num_workers=2",
            "scaling.max_failures=1",
            "run.epochs=2",
            "run.hang_timeout_s=5",
            "run.progress=off",
            "checkpoint.every_steps=20",
            "fault.kind=hang",
            "fault.rank=1",
            "fault.at_step=30",
            f"run.storage_dir={tmp_path}",
            "run.name=hang",
        ],
    )
    result = convoy.train(job)
    out = capfd.readouterr().out
    assert "convoy: hang detected: rank(s) 1 made no progress for" in out
    assert "rank 1 last finished step 30" in out
    assert "rank 0 (in step 31)" in out
    assert (job.run_dir / ".attempts").read_text() == "2"
    assert result.summary["resumed_from"].endswith("step_00000020")
    assert result.summary["steps"] == 78

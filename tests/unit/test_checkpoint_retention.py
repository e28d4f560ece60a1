"""Checkpoint retention: keep the latest K plus the best K by a recorded metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convoy.checkpoint import (
    BestPolicy,
    CheckpointManager,
    checkpoint_root,
    committed_checkpoints,
    read_meta,
)
from convoy.config import load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.outputs import read_metrics
from convoy.storage import RunStorage


def fake_checkpoint(run_dir: Path, step: int, metrics: dict[str, float]) -> Path:
    path = checkpoint_root(run_dir) / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "metrics": metrics}))
    return path


@pytest.mark.parametrize(("mode", "expected"), [("min", [3, 1]), ("max", [2, 4])])
def test_best_policy_ranks_by_the_recorded_metric(
    tmp_path: Path, mode: str, expected: list[int]
) -> None:
    losses = {1: 0.5, 2: 0.9, 3: 0.2, 4: 0.7}
    for step, loss in losses.items():
        fake_checkpoint(tmp_path, step, {"val/loss": loss})
    fake_checkpoint(tmp_path, 5, {})  # a mid-epoch save with no val metrics is never "best"
    metas = {name: read_meta(tmp_path, name) for name in committed_checkpoints(tmp_path)}
    chosen = BestPolicy(2, "val/loss", mode).select(metas)
    assert [int(name[5:]) for name in chosen] == expected


def test_prune_keeps_latest_and_best(tmp_path: Path) -> None:
    for step, acc in {1: 0.9, 2: 0.5, 3: 0.95, 4: 0.6, 5: 0.7}.items():
        fake_checkpoint(tmp_path, step, {"val/acc": acc})
    manager = CheckpointManager(
        RunStorage.at(tmp_path), WorkerContext(), 1, BestPolicy(2, "val/acc", "max")
    )
    manager._prune()
    assert committed_checkpoints(tmp_path) == [
        "step_00000001",
        "step_00000003",
        "step_00000005",
    ]


def test_a_real_run_keeps_latest_and_best(tmp_path: Path) -> None:
    job = load_job(
        None,
        [
            "model.name=mlp",
            "strategy.name=single",
            "scaling.launcher=local",
            "scaling.num_workers=1",
            "run.epochs=5",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
            "run.name=best",
            "checkpoint.every_epochs=1",
            "checkpoint.keep_latest=1",
            "checkpoint.keep_best=1",
            "checkpoint.best_metric=val/loss",
        ],
    )
    train(job, WorkerContext())
    epochs = [r for r in read_metrics(job.run_dir) if r["kind"] == "epoch"]
    best_step = min(epochs, key=lambda r: r["val/loss"])["step"]
    expected = sorted({f"step_{best_step:08d}", "step_00000095"})  # best + final (5 x 19 steps)
    assert committed_checkpoints(job.run_dir) == expected

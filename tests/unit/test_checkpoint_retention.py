"""Checkpoint retention: keep the latest K plus the best K by a recorded metric; export takes
the best of them, ranked as retention ranks them (or the latest, where the run does not rank)."""

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
from convoy.export import CheckpointChoice, choose_checkpoint
from convoy.outputs import read_metrics
from convoy.storage import RunStorage


def fake_checkpoint(
    run_dir: Path, step: int, metrics: dict[str, float], job: list[str] | None = None
) -> Path:
    """A committed checkpoint's ``meta.json`` and nothing else; ``job``: the overrides of the
    job it records, when it records one."""
    path = checkpoint_root(run_dir) / f"step_{step:08d}"
    path.mkdir(parents=True)
    meta = {"step": step, "metrics": metrics}
    if job is not None:
        meta["job"] = load_job(None, job).model_dump(mode="json")
    (path / "meta.json").write_text(json.dumps(meta))
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


RANKED = [
    "checkpoint.every_epochs=1",
    "checkpoint.keep_latest=1",
    "checkpoint.keep_best=1",
    "checkpoint.best_metric=val/acc",
]


@pytest.mark.parametrize(
    ("accuracies", "job", "chosen", "why"),
    [
        (
            [0.5, 0.9, 0.7],
            RANKED,
            2,
            "the best of 3 by val/acc (0.9, highest); latest is step_00000003",
        ),
        (
            [0.5, 0.7, 0.9],
            [*RANKED, "checkpoint.best_mode=min"],
            1,
            "the best of 3 by val/acc (0.5, lowest); latest is step_00000003",
        ),
        ([0.5, 0.9], RANKED, 2, "the best of 2 by val/acc (0.9, highest); also the latest"),
        ([0.9], RANKED, 1, "the only one kept, best by val/acc (0.9, highest) and latest"),
        (
            [None, None],
            RANKED,
            2,
            "the latest of 2; none records val/acc, by which the run ranks them",
        ),
        (
            [0.5, 0.9, 0.7],
            ["checkpoint.every_epochs=1"],
            3,
            "the latest of 3; the run does not rank its checkpoints (checkpoint.keep_best: 0)",
        ),
    ],
)
def test_export_takes_the_best_by_the_runs_ranking_and_says_why(
    tmp_path: Path, accuracies: list[float | None], job: list[str], chosen: int, why: str
) -> None:
    """The ranking is the latest checkpoint's job's (``best_mode: auto`` is the task's: max
    for accuracy); a checkpoint without the metric (saved before any evaluation) never ranks."""
    for step, acc in enumerate(accuracies, start=1):
        fake_checkpoint(tmp_path, step, {} if acc is None else {"val/acc": acc}, job)
    assert choose_checkpoint(tmp_path) == CheckpointChoice(f"step_{chosen:08d}", why)

"""A LightningModule written as Lightning's docs write them (examples/lightning_classifier.py)
trains unchanged under torchrun and Ray, with ddp and fsdp2 on 2 CPU workers: what the module
logs with ``self.log`` reaches metrics.jsonl, equal to what Lightning's own CSVLogger wrote;
running the same run again continues from its last checkpoint."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import convoy
from convoy.config import load_job
from convoy.launchers import RunResult
from convoy.outputs import read_metrics

pytest.importorskip("lightning")
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "lightning_digits.yaml"
LOGGED = {"train_loss", "val_loss", "val_acc"}
STEPS_PER_EPOCH = 17  # 1,079 training digits in batches of 32 per rank, over 2 ranks


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``convoy train`` run from the repository: its ``examples`` package imports in the
    driver and, through the working directory, in torchrun's and Ray's workers."""
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.chdir(REPO)


def train(storage: Path, *overrides: str) -> RunResult:
    job = load_job(
        RECIPE,
        [f"run.storage_dir={storage}", "run.name=digits", "run.progress=off", *overrides],
    )
    return convoy.train(job)


def epoch_records(run: Path) -> list[dict[str, float]]:
    return [r for r in read_metrics(run) if r["kind"] == "epoch"]


def lightning_csv(run: Path, version: int) -> dict[int, dict[str, float]]:
    """Lightning's CSVLogger rows, merged per 1-based epoch (it writes val and train apart)."""
    path = run / "lightning_logs" / f"version_{version}" / "metrics.csv"
    merged: dict[int, dict[str, float]] = {}
    with path.open() as handle:
        for row in csv.DictReader(handle):
            values = {k: float(v) for k, v in row.items() if v and k not in ("epoch", "step")}
            merged.setdefault(int(row["epoch"]) + 1, {}).update(values)
    return merged


def assert_matches_lightning(run: Path, version: int, epochs: list[int]) -> None:
    """Every epoch Convoy recorded holds the module's metrics, equal to Lightning's log."""
    logged = lightning_csv(run, version)
    records = {r["epoch"]: r for r in epoch_records(run) if r["epoch"] in epochs}
    assert sorted(records) == epochs
    for epoch in epochs:
        assert set(records[epoch]) >= LOGGED
        for name in LOGGED:
            assert records[epoch][name] == pytest.approx(logged[epoch][name], rel=1e-6)
        assert records[epoch]["step"] == epoch * STEPS_PER_EPOCH


def assert_trained(result: RunResult, strategy: str, launcher: str) -> None:
    summary = result.summary
    assert (summary["strategy"], summary["launcher"], summary["world_size"]) == (
        strategy,
        launcher,
        2,
    )
    steps = [r for r in read_metrics(result.run_dir) if r["kind"] == "step"]
    assert steps and all(len(r["rank_step_seconds"]) == 2 for r in steps)
    tests = [r for r in read_metrics(result.run_dir) if r["kind"] == "test"]
    assert set(tests[-1]) == {"kind", "step", "time", "test_loss", "test_acc"}
    records = epoch_records(result.run_dir)
    assert records[-1]["val_loss"] < records[0]["val_loss"]  # it learns


# Stops after epoch 2 of 3: no epoch improves val_loss by 10, and one such epoch is enough.
EARLY_STOPPING = (
    "lightning.trainer_kwargs.callbacks=[{class: 'lightning.pytorch.callbacks:EarlyStopping', "
    "kwargs: {monitor: val_loss, min_delta: 10.0, patience: 1}}]"
)
USER_LOGGER = (
    "lightning.trainer_kwargs.logger=[{class: 'lightning.pytorch.loggers:CSVLogger', "
    "kwargs: {name: user_logs}}]"
)


def test_ddp_under_torchrun_with_the_users_callback_and_logger(tmp_path: Path) -> None:
    result = train(
        tmp_path, "scaling.launcher=torchrun", "run.epochs=3", EARLY_STOPPING, USER_LOGGER
    )
    assert_trained(result, "ddp", "torchrun")
    assert_matches_lightning(result.run_dir, 0, [1, 2])
    assert result.summary["steps"] == 2 * STEPS_PER_EPOCH  # the user's EarlyStopping stopped it
    assert (result.run_dir / "user_logs" / "version_0" / "metrics.csv").is_file()
    assert (result.run_dir / "checkpoints" / "last.ckpt").is_file()
    # The test metrics reach TensorBoard under the names the module logged them with.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(result.run_dir / "tensorboard"))
    board.Reload()
    assert {"test_loss", "test_acc"} <= set(board.Tags()["scalars"])


NOISE = ("litlogger", "LeafSpec", "exists and is not empty", "Detected an existing checkpoint")


def test_fsdp2_under_torchrun_resumes_from_its_last_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    first = train(tmp_path, "scaling.launcher=torchrun", "strategy.name=fsdp2", "run.epochs=1")
    last = first.run_dir / "checkpoints" / "last.ckpt"
    # FSDP2 saves a distributed checkpoint: one shard file per rank.
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert first.summary["resumed_from"] is None
    second = train(tmp_path, "scaling.launcher=torchrun", "strategy.name=fsdp2", "run.epochs=2")
    assert second.summary["resumed_from"] == str(last)
    # Epoch 1 was trained once (by the first run), epoch 2 by the second, from step 17 on.
    assert [r["epoch"] for r in epoch_records(second.run_dir)] == [1, 2]
    assert_matches_lightning(second.run_dir, 0, [1])
    assert_matches_lightning(second.run_dir, 1, [2])
    assert second.summary["steps"] == 2 * STEPS_PER_EPOCH
    assert_trained(second, "fsdp2", "torchrun")
    log = "".join(capfd.readouterr())
    assert "Trainable params" in log  # Lightning's own lines still print
    assert [line for line in log.splitlines() if any(n in line for n in NOISE)] == []


@pytest.mark.ray
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_under_ray(tmp_path: Path, ray_session, strategy: str) -> None:  # type: ignore[no-untyped-def]
    result = train(
        tmp_path,
        "scaling.launcher=ray",
        "scaling.cpus_per_worker=0.5",
        f"strategy.name={strategy}",
        "run.epochs=2",
    )
    assert_trained(result, strategy, "ray")
    assert_matches_lightning(result.run_dir, 0, [1, 2])
    # ddp saves one file; fsdp2 (ModelParallelStrategy) a directory of per-rank shards.
    last = result.run_dir / "checkpoints" / "last.ckpt"
    assert last.is_dir() == (strategy == "fsdp2") and last.exists()

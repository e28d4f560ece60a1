"""A real short run with TensorBoard and MLflow on: three records of one run that agree.

The default recipe trains two epochs in-process (local launcher); ``metrics.jsonl``, the
TensorBoard event files and the MLflow run (SQLite store in the storage dir) must hold the
same steps, epochs and values. A second run of the same name resumes and continues the same
MLflow run, and ``convoy export`` logs its files into it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.cli import main
from convoy.integrations.mlflow import read_run_record
from convoy.outputs import read_metrics

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
EPOCH_METRICS = ("train/loss", "train/acc", "val/loss", "val/acc")


def train(storage: Path, *overrides: str) -> None:
    args = [
        "scaling.launcher=local",
        "scaling.num_workers=1",
        "run.epochs=2",
        "run.log_every_steps=5",
        "tracking.mlflow.enabled=true",
        f"run.storage_dir={storage}",
        "run.name=tracked",
        "run.progress=off",
        *overrides,
    ]
    assert main(["train", str(RECIPE), *[f"-o{a}" for a in args]]) == 0


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The storage dir of one finished two-epoch run named ``tracked``."""
    folder = tmp_path_factory.mktemp("tracking")
    train(folder)
    return folder


def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_client(run: Path):  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    record = read_run_record(run)
    assert record is not None
    return MlflowClient(record["tracking_uri"]), record["run_id"]


def mlflow_history(client, run_id: str, key: str) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def approx(points: list[tuple[int, float]]) -> list[tuple[int, object]]:
    # TensorBoard keeps float32: compare with a float tolerance, steps exactly.
    return [(step, pytest.approx(value, rel=1e-6)) for step, value in points]


def test_metrics_file_tensorboard_and_mlflow_agree(storage: Path) -> None:
    run = storage / "tracked"
    records = read_metrics(run)
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    (test,) = [r for r in records if r["kind"] == "test"]
    assert [r["epoch"] for r in epochs] == [1, 2]
    board = tensorboard_scalars(run)
    client, run_id = mlflow_client(run)
    expected = {
        "epoch": [(r["step"], r["epoch"]) for r in epochs],
        "step/loss": [(r["step"], r["train/loss"]) for r in steps],
        "step/lr": [(r["step"], r["lr"]) for r in steps],
        "ranks/step_seconds/rank0": [(r["step"], r["rank_step_seconds"][0]) for r in steps],
        "test/acc": [(test["step"], test["test/acc"])],
        **{key: [(r["step"], r[key]) for r in epochs] for key in EPOCH_METRICS},
    }
    for key, points in expected.items():
        assert board[key] == approx(points), key
        assert mlflow_history(client, run_id, key) == approx(points), key
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["run.epochs"] == "2"
    assert mlflow_run.data.tags["convoy.launcher"] == "local"
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", "summary.json"}


def test_resumed_run_and_its_export_land_in_the_same_mlflow_run(
    storage: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = storage / "tracked"
    client, run_id = mlflow_client(run)
    train(storage, "run.epochs=3")  # resumes from the end of epoch 2
    assert mlflow_client(run)[1] == run_id
    assert [step for step, _ in mlflow_history(client, run_id, "epoch")] == [39, 78, 117]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert [step for step, _ in tensorboard_scalars(run)["epoch"]] == [39, 78, 117]
    assert client.get_run(run_id).data.tags["resumed.run.epochs"] == "3"

    capsys.readouterr()
    assert main(["export", str(run)]) == 0
    assert f"logged the export to MLflow run {run_id}" in capsys.readouterr().out
    (exported,) = client.list_artifacts(run_id, "export")
    files = {Path(a.path).name for a in client.list_artifacts(run_id, exported.path)}
    assert {"model.safetensors", "model.json"} <= files

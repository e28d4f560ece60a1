"""TensorBoard and MLflow sinks fed events directly, read back with the libraries' own readers.

No training: a fixed event stream goes into each sink (built by its module's ``build``, as
``build_sinks`` builds it), then TensorBoard's ``EventAccumulator`` and MLflow's
``MlflowClient`` read what was written. Unreachable servers and missing libraries must turn a
sink off with one line while ``metrics.jsonl`` keeps every record.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from convoy.config import Job, load_job
from convoy.distributed import WorkerContext, free_port
from convoy.engine.events import (
    EndEvent,
    EpochEvent,
    EvalEvent,
    Event,
    EventBus,
    RankStats,
    Sink,
    StartEvent,
    StepEvent,
    StragglerEvent,
)
from convoy.engine.sinks import SinkUnavailable, build_sinks
from convoy.integrations import mlflow as mlflow_sink
from convoy.integrations import tensorboard as tensorboard_sink
from convoy.outputs import RunOutputs, read_metrics, write_config
from convoy.storage import RunStorage

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
WORLD = 2


def tracking_job(storage_dir: str | Path, *overrides: str) -> Job:
    return load_job(
        RECIPE,
        [
            "scaling.launcher=torchrun",
            f"scaling.num_workers={WORLD}",
            f"run.storage_dir={storage_dir}",
            "run.name=unit",
            "run.progress=off",
            *overrides,
        ],
    )


def step_event(step: int, epoch: int) -> StepEvent:
    ranks = RankStats(
        step_seconds=[0.01 * step, 0.02 * step],
        data_wait_seconds=[0.001, 0.002],
        local_seconds=[0.004, 0.009],
        memory_bytes=[1000 + step, 2000 + step],
    )
    return StepEvent(step, epoch, 2.5 - 0.1 * step, 1e-3 * step, ranks, 100.0 * step, tflops=0.5)


def epoch_event(epoch: int, step: int) -> EpochEvent:
    metrics = {"train/loss": 2.0 / epoch, "val/loss": 2.2 / epoch, "val/acc": 0.3 * epoch}
    return EpochEvent(epoch, 2, step, metrics, seconds=1.5)


def run_events(job: Job, first_step: int = 1) -> list[Event]:
    """Two epochs of two logged steps each (from ``first_step``), a straggler, test, end."""
    s = first_step
    return [
        StartEvent(job.model_dump(mode="json"), job.run_uri, WORLD, s + 3, "header"),
        step_event(s, 1),
        step_event(s + 1, 1),
        StragglerEvent(s + 1, rank=1, seconds=0.009, median_seconds=0.004, data_wait_seconds=0.002),
        epoch_event(1, s + 1),
        EvalEvent("val", s + 1, 1, {"val/loss": 2.2, "val/acc": 0.3}),
        step_event(s + 2, 2),
        step_event(s + 3, 2),
        epoch_event(2, s + 3),
        EvalEvent("test", s + 3, 2, {"test/loss": 1.25, "test/acc": 0.75, "train/loss": 1.0}),
        EndEvent({"steps": s + 3, "metrics": {"test/acc": 0.75}}),
    ]


def feed(sink: Sink, events: list[Event]) -> None:
    bus = EventBus([sink])
    for event in events:
        bus.emit(event)
    bus.close()
    assert bus.sinks == []


def accumulator(folder: Path):  # type: ignore[no-untyped-def]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag: str) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    return [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(tag)]


# TensorBoard


def test_tensorboard_records_steps_ranks_epochs_test_stragglers_and_recipe(tmp_path: Path) -> None:
    job = tracking_job(tmp_path)
    feed(tensorboard_sink.build(job, WorkerContext()), run_events(job))
    acc = accumulator(job.run_dir / "tensorboard")
    assert scalars(acc, "step/loss") == [(s, 2.5 - 0.1 * s) for s in (1, 2, 3, 4)]
    assert scalars(acc, "step/lr") == [(s, 1e-3 * s) for s in (1, 2, 3, 4)]
    assert scalars(acc, "throughput/samples_per_second")[-1] == (4, 400.0)
    assert scalars(acc, "ranks/step_seconds/rank1") == [(s, 0.02 * s) for s in (1, 2, 3, 4)]
    assert scalars(acc, "ranks/memory_bytes/rank0")[0] == (1, 1001.0)
    assert scalars(acc, "ranks/local_seconds/rank1")[0] == (1, 0.009)
    assert scalars(acc, "train/loss") == [(2, 2.0), (4, 1.0)]
    assert scalars(acc, "val/acc") == [(2, 0.3), (4, 0.6)]
    assert scalars(acc, "epoch") == [(2, 1.0), (4, 2.0)]
    assert scalars(acc, "test/acc") == [(4, 0.75)]
    assert scalars(acc, "stragglers/rank1/slower_by") == [(2, 0.009 / 0.004 - 1)]
    assert "throughput/mfu" not in acc.Tags()["scalars"]  # None on CPU: not plotted as 0
    text = acc.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "vit_tiny" in text and "num_workers: 2" in text


def test_tensorboard_second_attempt_adds_an_event_file(tmp_path: Path) -> None:
    job = tracking_job(tmp_path)
    feed(tensorboard_sink.build(job, WorkerContext()), run_events(job))
    feed(tensorboard_sink.build(job, WorkerContext()), run_events(job, first_step=5))
    folder = job.run_dir / "tensorboard"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    steps = [step for step, _ in scalars(accumulator(folder), "step/loss")]
    assert steps == list(range(1, 9))


def test_tensorboard_on_s3_uploads_its_event_file(tmp_path: Path, s3) -> None:  # type: ignore[no-untyped-def]
    job = tracking_job("s3://convoy/tracking")
    sink = tensorboard_sink.build(job, WorkerContext())
    feed(sink, run_events(job))
    local = tmp_path / "downloaded"
    RunStorage.at(job.run_uri).download("tensorboard", local)
    assert scalars(accumulator(local), "test/acc") == [(4, 0.75)]
    assert isinstance(sink, tensorboard_sink.TensorBoardSink) and sink.upload is not None
    assert not sink.upload.staging.exists()  # the staging folder is removed after upload


# MLflow


def mlflow_run(job: Job):  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    record = mlflow_sink.read_run_record(job.run_uri)
    assert record is not None
    client = MlflowClient(record["tracking_uri"])
    return client, client.get_run(record["run_id"])


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    metrics = client.get_metric_history(run_id, key)
    return [
        (m.step, pytest.approx(m.value, rel=1e-6)) for m in sorted(metrics, key=lambda m: m.step)
    ]


def test_mlflow_records_params_metrics_tags_and_artifacts(tmp_path: Path) -> None:
    job = tracking_job(tmp_path, "tracking.mlflow.enabled=true", "model.kwargs.note=" + "x" * 7000)
    write_config(job)
    feed(mlflow_sink.build(job, WorkerContext(world_size=WORLD)), run_events(job))
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "mlruns").is_dir()
    client, run = mlflow_run(job)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit"
    params = run.data.params
    assert params["optim.lr"] == "0.001" and params["strategy.name"] == "ddp"
    assert params["model.kwargs.hidden"] == "96"
    assert len(params["model.kwargs.note"]) == 6000  # MLflow's limit, truncated by the sink
    tags = run.data.tags
    assert tags["convoy.world_size"] == str(WORLD) and tags["convoy.launcher"] == "torchrun"
    assert tags["convoy.run_dir"] == job.run_uri
    run_id = run.info.run_id
    assert history(client, run_id, "step/loss") == [(s, 2.5 - 0.1 * s) for s in (1, 2, 3, 4)]
    assert history(client, run_id, "ranks/data_wait_seconds/rank1")[0] == (1, 0.002)
    assert history(client, run_id, "val/loss") == [(2, 2.2), (4, 1.1)]
    assert history(client, run_id, "test/acc") == [(4, 0.75)]
    assert history(client, run_id, "stragglers/rank1/slower_by") == [(2, 0.009 / 0.004 - 1)]
    assert "test/loss" in run.data.metrics and "throughput/mfu" not in run.data.metrics
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "summary.json"}


def test_test_metrics_reach_both_sinks_whatever_they_are_named(tmp_path: Path) -> None:
    """A LightningModule names its test metrics as it logged them (``test_acc``), not
    ``test/acc``; both sinks record them, and only them, at the final step."""
    job = tracking_job(tmp_path, "tracking.mlflow.enabled=true")
    events: list[Event] = [
        StartEvent(job.model_dump(mode="json"), job.run_uri, WORLD, 4, "header"),
        EvalEvent("test", 4, 2, {"test_loss": 1.35, "test_acc": 0.836}),
        EndEvent({"steps": 4, "metrics": {"test_acc": 0.836}}),
    ]
    feed(tensorboard_sink.build(job, WorkerContext()), events)
    acc = accumulator(job.run_dir / "tensorboard")
    assert scalars(acc, "test_acc") == [(4, 0.836)]
    assert scalars(acc, "test_loss") == [(4, 1.35)]
    feed(mlflow_sink.build(job, WorkerContext(world_size=WORLD)), events)
    client, run = mlflow_run(job)
    assert history(client, run.info.run_id, "test_acc") == [(4, 0.836)]
    assert set(run.data.metrics) == {"test_loss", "test_acc"}


def test_mlflow_second_attempt_continues_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tracking_job(tmp_path, "tracking.mlflow.enabled=true")
    first = mlflow_sink.build(job, WorkerContext(world_size=WORLD))
    events = run_events(job)
    feed(first, events[:4])  # the first attempt fails after two steps: closed, not ended
    _, failed = mlflow_run(job)
    assert failed.info.status == "FAILED"
    longer = tracking_job(tmp_path, "tracking.mlflow.enabled=true", "run.epochs=9")
    feed(mlflow_sink.build(longer, WorkerContext(world_size=WORLD)), run_events(longer, 3))
    client, run = mlflow_run(job)
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert [s for s, _ in history(client, run.info.run_id, "step/loss")] == [1, 2, 3, 4, 5, 6]
    assert run.data.params["run.epochs"] == "50"  # params are fixed once logged
    assert run.data.tags["resumed.run.epochs"] == "9"
    assert "resumed.<key>: run.epochs" in capsys.readouterr().err


def closed_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_unreachable_tracking_server_turns_the_sink_off_and_metrics_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = closed_uri()
    job = tracking_job(
        tmp_path,
        "tracking.mlflow.enabled=true",
        f"tracking.mlflow.tracking_uri={uri}",
        "tracking.tensorboard=false",
    )
    outputs = RunOutputs(RunStorage.at(job.run_uri), enabled=True)
    bus = build_sinks(job, WorkerContext(), outputs, (), total_steps=4)
    assert [sink.name for sink in bus.sinks] == ["metrics.jsonl", "progress"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert uri in err[0] and "unreachable" in err[0] and "refused" in err[0]
    for event in run_events(job)[1:]:
        bus.emit(event)
    bus.close()
    kinds = [record["kind"] for record in read_metrics(job.run_uri)]
    assert kinds == ["step", "step", "straggler", "epoch", "step", "step", "epoch", "test"]
    assert mlflow_sink.read_run_record(job.run_uri) is None


def test_server_lost_mid_run_switches_the_sink_off_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    job = tracking_job(tmp_path, "tracking.mlflow.enabled=true")
    outputs = RunOutputs(RunStorage.at(job.run_uri), enabled=True)
    sink = mlflow_sink.build(job, WorkerContext())
    assert isinstance(sink, mlflow_sink.MlflowSink)
    bus = EventBus([sink])
    events = run_events(job)
    bus.emit(events[0])
    sink.uri = closed_uri()
    sink.client = MlflowClient(sink.uri)  # the server goes away
    bus.emit(events[1])
    bus.emit(events[2])
    assert bus.sinks == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the mlflow sink is off for the rest of the run" in err[0]
    assert f"TrackingServerError: {sink.uri}: Connection refused" in err[0]
    assert outputs.storage.exists("mlflow_run.json")


@pytest.mark.parametrize(
    ("module", "switch", "blocked"),
    [
        ("tensorboard", "tracking.tensorboard=true", "torch.utils.tensorboard"),
        ("mlflow", "tracking.mlflow.enabled=true", "mlflow.tracking"),
    ],
)
def test_missing_library_is_said_once_and_metrics_go_on(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    switch: str,
    blocked: str,
) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # makes the import raise ImportError
    other = "tracking.tensorboard=false" if module == "mlflow" else "tracking.mlflow.enabled=false"
    job = tracking_job(tmp_path, switch, other)
    outputs = RunOutputs(RunStorage.at(job.run_uri), enabled=True)
    bus = build_sinks(job, WorkerContext(), outputs, (), total_steps=4)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'convoy[tracking]'" in err[0]
    assert [sink.name for sink in bus.sinks] == ["metrics.jsonl", "progress"]
    bus.emit(step_event(1, 1))
    bus.close()
    assert [record["step"] for record in read_metrics(job.run_uri)] == [1]


def test_remote_storage_without_a_tracking_uri_is_refused_with_the_reason() -> None:
    job = tracking_job("s3://bucket/runs", "tracking.mlflow.enabled=true")
    with pytest.raises(SinkUnavailable, match=r"set tracking\.mlflow\.tracking_uri"):
        mlflow_sink.tracking_uri(job)

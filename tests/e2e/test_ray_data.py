"""The ray_data loader on an embedded 2-CPU Ray: exact sharding, parity with the torch
loader, and the CPU budget that keeps Ray Data from starving."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import convoy
from convoy.config import Job, job_from_dict, load_job
from convoy.data.convert import convert_dataset
from convoy.data.samplers import GlobalBatchSampler
from convoy.export import evaluate_exported, export_checkpoint
from task_data_helpers import GPT_TINY_OVERRIDES, write_text_shards

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"
TRAIN_ROWS = 1258  # digits: 1797 - 359 test - 180 val


def digits_job(tmp_path: Path, *extra: str) -> Job:
    return load_job(
        RECIPE,
        [
            "scaling.launcher=ray",
            "scaling.num_workers=2",
            "data.loader=ray_data",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
            *extra,
        ],
    )


RESUME_STEP = 5


def audit_loop(config: dict[str, Any]) -> None:
    """A Ray Train worker that walks Convoy's ray_data batches and records the rows it got."""
    import ray.train

    from convoy.data.ray_data_worker import ray_worker_data

    job = job_from_dict(config["job"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    data = ray_worker_data(job, config["ray_data"], rank, world)
    record: dict[str, Any] = {"micro_batches": len(data.train), "epochs": [], "eval": {}}
    sums: list[list[float]] = []
    for epoch, skip in ((0, 0), (1, 0), (1, RESUME_STEP)):  # the last: a resume at step 5
        data.train.seen = []  # type: ignore[attr-defined]
        data.train.start_epoch(epoch, skip)
        sums.append([float(x.double().sum()) for x, _ in data.train])
        assert len(sums[-1]) == len(data.train) - skip
        record["epochs"].append(data.train.seen)  # type: ignore[attr-defined]
    record["resumed_inputs_equal"] = sums[2] == sums[1][RESUME_STEP:]
    for split, batches in (("val", data.val), ("test", data.test)):
        batches.seen = []  # type: ignore[attr-defined]
        sizes = [len(labels) for _, labels in batches]
        record["eval"][split] = {
            "seen": batches.seen,
            "batches": len(sizes),
            "real": batches.num_real,
        }  # type: ignore[attr-defined]
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))


def test_every_sample_once_per_epoch_and_every_eval_row_once(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    import ray.cloudpickle
    from ray.train import DataConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from convoy.data.ray_data import build_ray_data

    # Workers cannot import this test module: ship audit_loop by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    job = digits_job(tmp_path, "data.eval_batch_size=64")
    plan = build_ray_data(job, world_size=2)
    TorchTrainer(
        audit_loop,
        train_loop_config={
            "job": job.model_dump(mode="json"),
            "ray_data": plan.worker_info(),
            "out": str(tmp_path),
        },
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        datasets=plan.datasets,
        dataset_config=DataConfig(datasets_to_split=[]),
    ).fit()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    # Training: chunks of 39 rows dealt to the ranks (629 rows each), 39 micro-batches of 16.
    assert [r["micro_batches"] for r in ranks] == [39, 39]
    for epoch in range(2):
        seen = ranks[0]["epochs"][epoch] + ranks[1]["epochs"][epoch]
        assert len(seen) == 2 * 39 * 16 == len(set(seen))  # nobody sees a row twice
        assert set(seen) <= set(range(TRAIN_ROWS))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # reshuffled every epoch
    # A resume at step 5 of epoch 1 continues with exactly the rows not yet trained, in the
    # uninterrupted order, with the same inputs: once per epoch across the resume.
    for rank in ranks:
        assert rank["epochs"][2] == rank["epochs"][1][RESUME_STEP * 16 :]
        assert rank["resumed_inputs_equal"]

    # Evaluation: contiguous chunks, every row exactly once, the same batch count per rank.
    for split, size in (("val", 180), ("test", 359)):
        seen = ranks[0]["eval"][split]["seen"] + ranks[1]["eval"][split]["seen"]
        assert sorted(seen) == list(range(size))
        assert [r["eval"][split]["real"] for r in ranks] == [(size + 1) // 2, size // 2]
        assert ranks[0]["eval"][split]["batches"] == ranks[1]["eval"][split]["batches"]

    # The torch loader's rule on the same split: the same number of samples per epoch.
    sampler = GlobalBatchSampler(range(TRAIN_ROWS), 32, num_replicas=2, rank=0)
    assert sampler.steps_per_epoch * 32 == 2 * 39 * 16


# Ray Data's notes and progress, which stay in its own log (ray-data.log in Ray's logs).
RAY_DATA_NOTES = ("Running Dataset", "MapBatches(", "execution finished", "streaming_executor")


def test_ray_data_reaches_the_torch_bar_and_evaluates_exactly(
    tmp_path: Path, ray_session, capfd: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """digits_mlp (4 of its 8 epochs: the torch loader reaches 96-98% by then) through Ray
    Data on 2 CPUs: it completes, reaches the bar the torch loader reaches, and its 2-rank test
    metrics equal a single-process evaluation of the same weights on the 359-sample (odd) test
    split. Ray Data's notes and progress bars (a pipeline per epoch and evaluation on every
    rank) stay off the terminal, between the run's own lines."""
    job = digits_job(tmp_path, "run.name=ray-data", "run.epochs=4")
    result = convoy.train(job)
    terminal = "".join(capfd.readouterr())
    assert "world_rank=1" in terminal  # what is shown of the run is there
    assert [line for line in terminal.splitlines() if any(n in line for n in RAY_DATA_NOTES)] == []
    metrics = result.summary["metrics"]
    assert metrics["test/acc"] >= 0.93
    assert metrics["test/samples"] == 359
    exported = export_checkpoint(result.run_dir, tmp_path / "export")
    single = evaluate_exported(exported)
    assert single["test/acc"] == metrics["test/acc"]
    assert single["test/samples"] == 359
    assert single["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-6)
    assert single["test/f1"] == pytest.approx(metrics["test/f1"], abs=1e-7)


def test_encoded_images_decode_in_ray_data(imagefolder: Path, tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    """File rows (imagefolder) and byte rows (parquet) decode in Ray Data tasks; a corrupt
    file is skipped and reported under on_bad_record: skip."""
    (imagefolder / "train" / "light" / "zz_corrupt.png").write_bytes(b"not a png")
    parquet = tmp_path / "parquet"
    convert_dataset(imagefolder, parquet, shard_mb=0.001)
    common = ["model.name=mlp", "data.batch_size=4", "data.image_size=8", "run.epochs=1"]
    folder = convoy.train(
        digits_job(
            tmp_path,
            *common,
            "data.name=imagefolder",
            f"data.path={imagefolder}",
            "data.on_bad_record=skip",
            "data.ray_data.compute=actors",
            "run.name=folder",
        )
    ).summary
    assert folder["skipped_records"] == [
        f"{imagefolder / 'train' / 'light' / 'zz_corrupt.png'} (not an image Pillow can identify)"
    ]
    from_parquet = convoy.train(
        digits_job(tmp_path, *common, "data.name=parquet", f"data.path={parquet}", "run.name=pq")
    ).summary
    for summary in (folder, from_parquet):
        assert summary["steps"] == 3  # 12 rows: 6 per worker, micro-batches of 2
        assert summary["metrics"]["test/samples"] == 6
        assert summary["metrics"]["test/acc"] == 1.0  # dark vs light


TASKS = {
    # odd eval splits: diabetes 44 val / 88 test; the text corpus packs across row groups
    # with a padded last sequence; sensor series: the fleet test below
    "regression": ("diabetes_regression.yaml", ["run.epochs=1"]),
    "language_modeling": (
        "digits_mlp.yaml",
        [
            "task.name=language_modeling",
            "data.name=text",
            "data.path={corpus}",
            "data.tokenizer=bpe",
            "data.vocab_size=300",
            "data.seq_len=32",
            *GPT_TINY_OVERRIDES,
            "data.batch_size=32",
            "run.epochs=1",
        ],
    ),
}


def small_corpus(root: Path) -> Path:
    """The shortest pydoc topics as a streamed corpus: 2 shards a split, row groups of 3."""
    from pydoc_data.topics import topics

    docs = sorted((topics[name] for name in sorted(topics)), key=len)[:44]
    splits: dict[str, list[str | None]] = {"test": docs[:7], "val": docs[7:12], "train": docs[12:]}
    return write_text_shards(root, splits, rows_per_group=3)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_streams_and_evaluates_as_the_torch_loader(
    task: str, tmp_path: Path, ray_session
) -> None:  # type: ignore[no-untyped-def]
    """Table rows and a streamed text corpus (tokenized and packed in Ray Data's tasks) go
    through Ray Data on 2 ranks; the test counts (samples, tokens) and metrics equal the
    torch loader's on the same weights."""
    recipe, overrides = TASKS[task]
    corpus = small_corpus(tmp_path / "corpus") if task == "language_modeling" else None
    overrides = [o.format(corpus=corpus) for o in overrides]
    job = load_job(
        RECIPE.parent / recipe,
        [
            *overrides,
            "scaling.launcher=ray",
            "scaling.num_workers=2",
            "scaling.cpus_per_worker=0.5",
            "data.loader=ray_data",
            "checkpoint.every_epochs=1",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
        ],
    )
    result = convoy.train(job)
    torch_loader = evaluate_exported(export_checkpoint(result.run_dir, tmp_path / "export"))
    tested = {k: v for k, v in result.summary["metrics"].items() if k.startswith("test/")}
    assert tested.keys() <= torch_loader.keys()
    for key, value in tested.items():
        assert torch_loader[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    counts = [k for k in tested if k in ("test/samples", "test/tokens")]
    assert all(torch_loader[k] == tested[k] for k in counts) and counts


def test_a_fleet_streams_from_s3_through_either_loader(tmp_path: Path, ray_session, s3) -> None:  # type: ignore[no-untyped-def]
    """Parquet series on the S3 test server: Ray Data reads their row groups in its tasks
    (2 ranks), the torch loader streams them in 2 torchrun processes; the same eval counts, the
    Ray Data run's test metrics equal the torch loader's on its weights, and both loaders
    train the same batches to the same losses."""
    from convoy.data.telematics import FleetSpec, write_fleet

    fleet = f"s3://{s3.bucket}/{tmp_path.name}/fleet"
    written = write_fleet(FleetSpec(devices=6, hours=0.1, rate_hz=5, rows_per_group=8), fleet)
    assert written["rows"] == {"test": 36, "val": 36, "train": 144}
    common = [
        "data.name=series",
        f"data.path={fleet}",
        "model={name: conv1d, kwargs: {hidden: 16, depth: 2}}",
        "data.batch_size=16",
        "data.eval_batch_size=10",
        "checkpoint.every_epochs=1",
        "run.epochs=1",
    ]
    streamed = convoy.train(
        digits_job(tmp_path, *common, "scaling.cpus_per_worker=0.5", "run.name=ray-data")
    )
    torch_loader = evaluate_exported(export_checkpoint(streamed.run_dir, tmp_path / "export"))
    metrics = streamed.summary["metrics"]
    assert metrics["test/samples"] == torch_loader["test/samples"] == 36
    for key in ("test/loss", "test/acc", "test/f1"):
        assert torch_loader[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-7), key
    assert metrics["train/samples"] == 144  # 72 rows a rank, 9 micro-batches of 8
    # The torch loader under torchrun, on the same 2 ranks: the same plan of row groups,
    # so the same batches and the same training.
    local = convoy.train(
        digits_job(
            tmp_path, *common, "data.loader=torch", "scaling.launcher=torchrun", "run.name=torch"
        )
    ).summary["metrics"]
    assert local["test/samples"] == 36 and local["train/samples"] == 144
    for key in ("train/loss", "test/loss", "test/acc"):
        assert local[key] == pytest.approx(metrics[key], rel=1e-5), key

"""``s3://`` run storage against a real S3-compatible server (moto) on loopback.

Runs write config, metrics, summary and checkpoints to S3 and resume from it: in-process with
the ``local`` launcher (bitwise equal to a run on local disk), and on Ray Train, where the
checkpoints are reported to Ray and a second run of the same name resumes through
``ray.train.get_checkpoint()``. Cutting the connection mid-run gives one clear error and
leaves the committed checkpoints loadable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import convoy
from convoy.checkpoint import CheckpointStorageError, committed_checkpoints
from convoy.config import Job, load_job
from convoy.engine.faults import InjectedFault
from convoy.errors import LaunchError
from convoy.export import WEIGHTS_FILE, export_checkpoint
from convoy.outputs import CONFIG_FILE, read_metrics, read_summary
from convoy.storage import RunStorage

pytestmark = pytest.mark.e2e
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STORAGE = "s3://convoy/runs"  # the bucket the s3 fixture creates
FINAL_STEP = 78  # 2 epochs of 39 steps


def digits_job(storage_dir: str | Path, name: str, *extra: str) -> Job:
    return load_job(
        RECIPES / "digits_mlp.yaml",
        [
            "run.epochs=2",
            "checkpoint.every_steps=20",
            "run.progress=off",
            f"run.storage_dir={storage_dir}",
            f"run.name={name}",
            *extra,
        ],
    )


def final_weights(run: str | Path, out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(export_checkpoint(run, out) / WEIGHTS_FILE))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def test_local_run_on_s3_resumes_exactly(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    reference = digits_job(tmp_path, "on-disk")
    convoy.train(reference)

    job = digits_job(STORAGE, "local-s3", "fault.kind=raise", "fault.at_step=30")
    with pytest.raises(InjectedFault):
        convoy.train(job)
    run = f"{STORAGE}/local-s3"
    assert committed_checkpoints(run) == ["step_00000020"]

    result = convoy.train(job)  # the same name again: resumes from S3
    assert result.run_uri == run
    assert result.summary["resumed_from"] == f"{run}/checkpoints/step_00000020"
    assert result.summary["steps"] == FINAL_STEP
    # Everything the run keeps is in the bucket, and nothing was written locally.
    assert read_summary(run) == result.summary
    assert [r["epoch"] for r in read_metrics(run) if r["kind"] == "epoch"] == [1, 2]
    assert "local-s3" in RunStorage.at(run).read_text(CONFIG_FILE)
    assert committed_checkpoints(run) == ["step_00000060", f"step_{FINAL_STEP:08d}"]  # keep 2
    assert not (Path.cwd() / STORAGE).exists()
    assert_same_weights(
        final_weights(reference.run_dir, tmp_path / "disk"), final_weights(run, tmp_path / "s3")
    )


def test_ray_run_on_s3_resumes_through_ray_train(s3, ray_session, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job = digits_job(
        STORAGE,
        "ray-s3",
        "scaling.launcher=ray",
        "scaling.num_workers=2",
        "scaling.cpus_per_worker=0.5",
        "fault.kind=raise",
        "fault.rank=1",
        "fault.at_step=50",
    )
    with pytest.raises(LaunchError):  # max_failures 0: the first failure ends the run
        convoy.train(job)
    run = RunStorage.at(f"{STORAGE}/ray-s3")
    # Ray Train registered each committed checkpoint in its snapshot, in the run directory.
    snapshot = json.loads(run.read_text("checkpoint_manager_snapshot.json"))
    assert "checkpoints/step_00000040" in json.dumps(snapshot)
    assert committed_checkpoints(run) == ["step_00000020", "step_00000040"]

    result = convoy.train(job)  # resumes through ray.train.get_checkpoint() from S3
    assert result.summary["resumed_from"] == f"{run.uri}/checkpoints/step_00000040"
    assert result.summary["steps"] == FINAL_STEP
    assert result.summary["metrics"]["test/acc"] >= 0.93
    # Ray Train owns retention under Ray: checkpoint.keep_latest 2 became num_to_keep=2.
    assert committed_checkpoints(run) == ["step_00000060", f"step_{FINAL_STEP:08d}"]
    assert final_weights(run.uri, tmp_path / "export")


def test_unreachable_s3_fails_clearly_and_keeps_checkpoints(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job = digits_job(STORAGE, "cut-s3")
    s3.cut_on(b"step_00000040")  # the connection drops as the step-40 save starts
    try:
        with pytest.raises(CheckpointStorageError) as failure:
            convoy.train(job)
    finally:
        s3.restore()
    message = str(failure.value)
    assert f"cannot write {STORAGE}/cut-s3/checkpoints/step_00000040" in message
    assert "check that the S3 endpoint (http://127.0.0.1:" in message
    assert committed_checkpoints(f"{STORAGE}/cut-s3") == ["step_00000020"]
    result = convoy.train(job)  # reachable again: resumes from the intact checkpoint
    assert result.summary["resumed_from"].endswith("checkpoints/step_00000020")
    assert result.summary["steps"] == FINAL_STEP

"""Worker kills on Ray Train: restarts resume from the last committed checkpoint, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import convoy
from convoy.checkpoint import committed_checkpoints
from convoy.config import Job, load_job
from convoy.errors import LaunchError
from convoy.export import WEIGHTS_FILE, export_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"


def ray_job(tmp_path: Path, name: str, *extra: str) -> Job:
    return load_job(
        RECIPE,
        [
            "scaling.launcher=ray",
            "scaling.num_workers=2",
            "scaling.cpus_per_worker=0.5",
            "scaling.max_failures=2",
            "run.epochs=1",  # 39 steps: the kills land mid-epoch, after the save at step 20
            "checkpoint.every_steps=20",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
            f"run.name={name}",
            *extra,
        ],
    )


def final_weights(job: Job, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = export_checkpoint(job.run_dir, tmp_path / f"{job.run.name}-export")
    return load_file(str(out / WEIGHTS_FILE))


KILL_RANK_1 = ("fault.kind=kill", "fault.rank=1", "fault.at_step=30")


def test_two_kills_are_survived_with_the_same_result(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    """Two SIGKILLs at step 30 of a 39-step epoch, through Ray Data: each restart resumes at
    step 20 and reads exactly the rows the uninterrupted run trained from there, in its
    order, so the final weights are bitwise the same. (The torch loader's bitwise resume on
    Ray: tests/cluster/test_preemption.py.)"""
    reference = ray_job(tmp_path, "uninterrupted", "data.loader=ray_data")
    convoy.train(reference)
    killed = ray_job(
        tmp_path, "killed-twice", "data.loader=ray_data", *KILL_RANK_1, "fault.attempts=2"
    )
    result = convoy.train(killed)
    assert (killed.run_dir / ".attempts").read_text() == "3"  # two SIGKILLs, then success
    assert result.summary["resumed_from"].endswith("step_00000020")
    expected, got = final_weights(reference, tmp_path), final_weights(killed, tmp_path)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def test_a_kill_past_max_failures_fails_clearly_and_keeps_checkpoints(
    tmp_path: Path, ray_session
) -> None:  # type: ignore[no-untyped-def]
    """``scaling.max_failures=0``: the kill ends the run with one clear error, no restart, and
    the checkpoint committed before it still loads. (Kills within the limit are survived:
    the test above.)"""
    job = ray_job(tmp_path, "killed-of-none", *KILL_RANK_1, "scaling.max_failures=0")
    with pytest.raises(LaunchError, match="Ray Train run failed") as caught:
        convoy.train(job)
    # What to do comes first, Ray's report of each rank after it.
    first = str(caught.value).splitlines()[0]
    assert "the committed checkpoint step_00000020 resumes when you run 'killed-of-none'" in first
    assert (job.run_dir / ".attempts").read_text() == "1"
    checkpoints = committed_checkpoints(job.run_dir)
    assert checkpoints == ["step_00000020"]
    for checkpoint in checkpoints:  # every committed checkpoint still loads
        out = export_checkpoint(job.run_dir, tmp_path / checkpoint, checkpoint)
        assert load_file(str(out / WEIGHTS_FILE))

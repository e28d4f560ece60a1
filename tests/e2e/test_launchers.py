"""Evidence 3: the same small recipe trains under local, torchrun and ray (2 workers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import convoy
from convoy.checkpoint import committed_checkpoints, partial_checkpoints
from convoy.config import load_job
from convoy.errors import LaunchError, ResourceError
from convoy.launchers import get_launcher
from convoy.launchers.base import WorkerEntry
from convoy.outputs import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, read_metrics
from convoy.testing import CENSUS_VARIABLE

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"
ACCURACY_BAR = 0.93  # the MLP recipe reaches ~0.97-0.99 test accuracy on digits


def recipe_job(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_job(RECIPE, [f"run.storage_dir={tmp_path}", "run.progress=plain", *overrides])


def assert_trained(result: convoy.launchers.RunResult, world_size: int) -> None:  # type: ignore[name-defined]
    summary = result.summary
    assert summary["world_size"] == world_size
    assert summary["metrics"]["test/acc"] >= ACCURACY_BAR
    assert summary["metrics"]["test/samples"] == 359
    assert len(summary["peak_memory_bytes_per_rank"]) == world_size
    for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE):
        assert (result.run_dir / name).is_file()
    assert json.loads((result.run_dir / SUMMARY_FILE).read_text()) == summary
    # The recipe saves every 4 of its 8 epochs and keeps 2: both are committed, none partial.
    assert committed_checkpoints(result.run_dir) == [
        "step_00000156",
        "step_00000312",
    ]
    assert partial_checkpoints(result.run_dir) == []
    epochs = [r for r in read_metrics(result.run_dir) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(1, 9))
    assert epochs[-1]["train/loss"] < epochs[0]["train/loss"]
    # Every logged step carries each rank's step time, data wait and memory, and throughput.
    steps = [r for r in read_metrics(result.run_dir) if r["kind"] == "step"]
    assert steps
    for record in steps:
        for key in ("rank_step_seconds", "rank_data_wait_seconds", "rank_memory_bytes"):
            assert len(record[key]) == world_size
        assert all(
            0 <= w <= s
            for w, s in zip(
                record["rank_data_wait_seconds"], record["rank_step_seconds"], strict=True
            )
        )
        assert record["tflops"] > 0
        assert record["mfu"] is None  # CPU: no peak, no MFU
    assert summary["flops_per_sample"] > 0
    # The first batch's wait apart, and the rest's fraction: together the whole run's.
    first, after = summary["first_batch_seconds"], summary["data_wait_fraction_after_first"]
    assert first >= 0 and 0 <= after <= 1
    assert first <= summary["data_wait_fraction"] * summary["train_seconds"] + 1e-9
    assert (
        summary["step_seconds_p10"] <= summary["step_seconds_median"] <= summary["step_seconds_p90"]
    )


def test_local(tmp_path: Path) -> None:
    result = convoy.train(recipe_job(tmp_path, "strategy.name=single"))
    assert_trained(result, 1)


def test_torchrun_two_workers(tmp_path: Path) -> None:
    job = recipe_job(tmp_path, "scaling.launcher=torchrun", "scaling.num_workers=2")
    assert_trained(convoy.train(job), 2)


def test_a_failed_torchrun_worker_is_torchruns_summary_and_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun's agent runs in this process: a worker that fails ends the run with torchrun's
    summary of the failure (which rank, its exit code) and Convoy's one error, without the
    agent's ``ChildFailedError`` traceback."""
    job = recipe_job(
        tmp_path,
        "scaling.launcher=torchrun",
        "scaling.num_workers=2",
        "fault.kind=raise",
        "fault.rank=1",
        "fault.at_step=1",
    )
    with pytest.raises(LaunchError, match="torchrun exited with code 1"):
        convoy.train(job)
    err = capsys.readouterr().err
    assert "convoy_worker FAILED" in err and "rank      : 1" in err
    assert "ChildFailedError" not in err


RAY_ARGS = ("scaling.launcher=ray", "scaling.num_workers=2", "scaling.cpus_per_worker=0.5")


@pytest.fixture(scope="module")
def ray_run(ray_session, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The recipe on Ray with 2 workers, its storage_dir relative as in make run (Ray's workers
    run in another working directory): the folder it ran in and its result. The resume test
    continues a copy of it."""
    folder = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        return folder, convoy.train(recipe_job(Path("runs"), *RAY_ARGS))


@pytest.mark.ray
def test_ray_two_workers(ray_run) -> None:  # type: ignore[no-untyped-def]
    folder, result = ray_run
    assert result.run_dir.parent == folder / "runs"
    assert_trained(result, 2)


@pytest.mark.ray
def test_ray_refuses_what_the_cluster_can_never_place(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    job = recipe_job(tmp_path, "scaling.launcher=ray", "scaling.num_workers=4", "run.name=too-big")
    with pytest.raises(ResourceError) as info:
        convoy.train(job)
    message = str(info.value)
    assert message.startswith("scaling.num_workers: got 4 workers of {'CPU': 1.0}")
    assert "can place at most 2" in message
    assert not (tmp_path / "too-big").exists()  # refused before anything was written


@pytest.mark.ray
def test_ray_run_with_the_same_name_resumes(tmp_path: Path, ray_run) -> None:  # type: ignore[no-untyped-def]
    """Running a finished run's name again with more epochs continues from its checkpoint
    (the finished run: a copy of ``ray_run``'s, named ``extend``)."""
    _, first = ray_run
    assert first.summary["resumed_from"] is None
    shutil.copytree(first.run_dir, tmp_path / "extend")
    second = convoy.train(recipe_job(tmp_path, *RAY_ARGS, "run.name=extend", "run.epochs=10"))
    assert second.summary["resumed_from"] == str(tmp_path / "extend/checkpoints/step_00000312")
    assert second.summary["steps"] == 390  # 2 more epochs of 39 steps, not 10
    epochs = [r["epoch"] for r in read_metrics(second.run_dir) if r["kind"] == "epoch"]
    assert epochs == [*range(1, 9), 9, 10]  # metrics.jsonl keeps the first run's records


def census_entry(tag: str) -> WorkerEntry:
    return WorkerEntry("convoy.testing:rank_census", {"tag": tag}, preflight=False)


def assert_census(result: convoy.launchers.RunResult, world_size: int, tag: str) -> None:  # type: ignore[name-defined]
    ranks = result.summary["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world_size))
    assert {r["world_size"] for r in ranks} == {world_size}
    assert {r["tag"] for r in ranks} == {tag}
    assert len({r["pid"] for r in ranks}) == world_size  # one process per rank
    assert json.loads((result.run_dir / SUMMARY_FILE).read_text()) == result.summary


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_launchers_run_any_worker_entry(tmp_path: Path, launcher: str) -> None:
    workers = 1 if launcher == "local" else 2
    job = recipe_job(tmp_path, f"scaling.launcher={launcher}", f"scaling.num_workers={workers}")
    result = get_launcher(launcher).launch(job, census_entry(launcher))
    assert_census(result, workers, launcher)
    assert not (result.run_dir / METRICS_FILE).exists()  # the engine did not run


def test_torchrun_workers_get_the_environment_and_output_of_their_launch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers are forked from a fork server that this process starts once, with the
    environment and the standard output of that moment. Each launch's workers still see the
    environment this process has at their launch, and write to its standard output as it is
    then: the second launch's to this test's capture, where the first launch (which starts the
    server, unless an earlier test did) wrote past it."""

    def census(launch: str) -> dict:  # type: ignore[type-arg]
        monkeypatch.setenv(CENSUS_VARIABLE, launch)
        job = recipe_job(tmp_path, "scaling.launcher=torchrun", "scaling.num_workers=2",
                         f"run.name={launch}")  # fmt: skip
        result = get_launcher("torchrun").launch(job, census_entry(launch))
        assert_census(result, 2, launch)
        return result.summary

    with capfd.disabled():
        first = census("first")
    second = census("second")
    assert {r["environment"] for r in first["ranks"]} == {"first"}
    assert {r["environment"] for r in second["ranks"]} == {"second"}
    assert not any(r["argv0"].endswith("convoy/launchers/torchrun.py") for r in second["ranks"])
    out = capfd.readouterr().out
    assert "census second rank 0" in out and "census second rank 1" in out
    assert "census first" not in out
    # The server is out of this process's session: a signal to this process group (a
    # terminal's Ctrl-C or hang-up) does not end it under the agent.
    from multiprocessing.forkserver import _forkserver

    assert os.getsid(_forkserver._forkserver_pid) != os.getsid(0)


def test_above_the_fork_limit_torchrun_starts_its_workers_as_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With more workers on a node than ``MAX_FORKED_WORKERS`` (here lowered to 1), torchrun
    starts them as ``python -m convoy.launchers.torchrun`` commands, and they run as forked
    ones do."""
    from convoy.launchers import torchrun

    monkeypatch.setattr(torchrun, "MAX_FORKED_WORKERS", 1)
    monkeypatch.setenv(CENSUS_VARIABLE, "commands")
    job = recipe_job(tmp_path, "scaling.launcher=torchrun", "scaling.num_workers=2")
    result = get_launcher("torchrun").launch(job, census_entry("commands"))
    assert_census(result, 2, "commands")
    ranks = result.summary["ranks"]
    assert {r["environment"] for r in ranks} == {"commands"}
    assert all(r["argv0"].endswith("convoy/launchers/torchrun.py") for r in ranks), ranks


def test_a_script_that_launches_at_its_top_level_launches_once(tmp_path: Path) -> None:
    """A user's script that calls ``convoy.train`` at its top level, with no ``if __name__ ==
    "__main__":``, trains once on torchrun: the workers forked for it do not run the script
    again (Python's fork server would, as the parent's ``__main__``)."""
    script = tmp_path / "train_top_level.py"
    script.write_text(
        "import convoy\n"
        "from convoy.config import load_job\n"
        f"job = load_job({str(RECIPE)!r}, [{f'run.storage_dir={tmp_path}'!r}, 'run.max_steps=5',\n"
        "    'run.progress=off', 'scaling.launcher=torchrun', 'scaling.num_workers=2'])\n"
        "print('launching', flush=True)\n"
        "print('trained', convoy.train(job).summary['steps'], flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("launching") == 1, done.stdout[-3000:]
    assert "trained 5" in done.stdout


@pytest.mark.ray
def test_ray_runs_any_worker_entry(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    job = recipe_job(tmp_path, *RAY_ARGS)
    assert_census(get_launcher("ray").launch(job, census_entry("ray")), 2, "ray")

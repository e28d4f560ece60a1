"""Exact resume: N steps straight == K steps, stop (mid-epoch), resume, N-K steps (bitwise).

A layout's straight and stopped runs are made once for the module (``saved_runs``); the tests
that resume them (fsdp2's: bitwise, under tensor parallel, by single, by hsdp) each resume a
copy of their own."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.multiprocessing.spawn import ProcessException

from convoy.checkpoint import (
    CheckpointStorageError,
    checkpoint_root,
    committed_checkpoints,
    partial_checkpoints,
)
from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.faults import InjectedFault
from convoy.engine.loop import train
from convoy.testing import TINY_VIT_OVERRIDES, run_on_gloo, train_on_rank

pytestmark = pytest.mark.distributed
TOTAL_STEPS = 12  # digits at global batch 32: 39 steps per epoch, so the stop is mid-epoch


def resume_job(root: Path, strategy: str, workers: int, *extra: str) -> Job:
    return load_job(
        None,
        [
            *TINY_VIT_OVERRIDES,
            "data.batch_size=32",
            f"strategy.name={strategy}",
            f"scaling.num_workers={workers}",
            f"scaling.launcher={'local' if workers == 1 else 'torchrun'}",
            f"run.max_steps={TOTAL_STEPS}",
            "run.progress=off",
            f"run.storage_dir={root}",
            "checkpoint.every_steps=5",
            "run.collective_timeout_s=60",  # a peer of a failed rank must not wait 10 minutes
            *extra,
        ],
    )


def final_model(job: Job, tmp: Path) -> dict[str, torch.Tensor]:
    """The last committed checkpoint's model, consolidated, loaded without unpickling code."""
    latest = committed_checkpoints(job.run_dir)[-1]
    assert latest == f"step_{TOTAL_STEPS:08d}"
    target = tmp / f"{job.run.name}.pt"
    dcp_to_torch_save(checkpoint_root(job.run_dir) / latest, target)
    return torch.load(target, weights_only=True)["model"]


def run(job: Job, workers: int) -> dict:
    """The job trained on ``workers`` ranks (in this process when 1); rank 0's summary."""
    if workers == 1:
        return train(job, WorkerContext())
    return run_on_gloo(train_on_rank, workers, job)[0]


TENSOR_PARALLEL = ("strategy.tp_size=2",)


@dataclass(frozen=True)
class SavedRuns:
    """A layout's runs, made once for the module: ``straight`` (all 12 steps; its rank-0
    summary and final model) and ``stopped`` (failed after step 7, step 5 its last save).
    A test copies a run into its own folder before resuming it, so each test resumes a run
    no other test has touched."""

    straight: Path
    summary: dict
    final: dict[str, torch.Tensor]
    stopped: Path

    def copy(self, run: Path, root: Path, name: str) -> None:
        shutil.copytree(run, root / name)


@pytest.fixture(scope="module")
def saved_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, int, tuple[str, ...]], SavedRuns]:
    """The straight and stopped runs of a layout, made at its first use: fsdp2 on 2 ranks
    is saved by one test's runs and resumed by four (bitwise, under tensor parallel, by
    single, by hsdp)."""
    made: dict[tuple[str, int, tuple[str, ...]], SavedRuns] = {}

    def runs(strategy: str, workers: int, extra: tuple[str, ...] = ()) -> SavedRuns:
        key = (strategy, workers, extra)
        if key not in made:
            root = tmp_path_factory.mktemp(f"saved-{strategy}-{workers}")
            straight = resume_job(root, strategy, workers, "run.name=straight", *extra)
            summary = run(straight, workers)
            stopped = stop_after_step_7(root, strategy, workers, *extra)
            final = final_model(straight, root)
            made[key] = SavedRuns(straight.run_dir, summary, final, stopped.run_dir)
        return made[key]

    return runs


@pytest.mark.parametrize(
    ("strategy", "workers", "extra"),
    [
        ("single", 1, ()),
        ("ddp", 2, ()),
        ("fsdp", 2, ()),
        ("fsdp2", 2, ()),
        ("fsdp2", 2, TENSOR_PARALLEL),
    ],
)
def test_resume_is_bitwise_exact(
    strategy: str,
    workers: int,
    extra: tuple[str, ...],
    tmp_path: Path,
    saved_runs: Callable[[str, int, tuple[str, ...]], SavedRuns],
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Resumed from step 5, the run ends on the uninterrupted run's weights, bit for bit; the
    ranks' saves and resume print none of torch's warnings about itself (FSDP1's ShardedTensor
    deprecations on every rank; DCP's single-process note is checked where it is raised, in
    tests/unit/test_run_storage.py: the single layout runs in this process)."""
    saved = saved_runs(strategy, workers, extra)
    saved.copy(saved.stopped, tmp_path, "stopped")
    stopped = stopped_job(tmp_path, strategy, workers, *extra)
    capfd.readouterr()
    run(stopped, workers)  # the same run name again: resumes from step 5
    torch_warnings = [
        line
        for line in capfd.readouterr().err.splitlines()
        if "/torch/" in line and "Warning:" in line
    ]
    assert torch_warnings == []
    expected, resumed = saved.final, final_model(stopped, tmp_path)
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, resumed[name]), name


def stopped_job(root: Path, strategy: str, workers: int, *extra: str) -> Job:
    """``run.name=stopped``, with a fault after step 7 (on the run's first attempt)."""
    return resume_job(
        root,
        strategy,
        workers,
        "run.name=stopped",
        "fault.kind=raise",
        "fault.at_step=7",
        f"fault.rank={workers - 1}",
        *extra,
    )


def stop_after_step_7(root: Path, strategy: str, workers: int, *extra: str) -> Job:
    """Run ``run.name=stopped`` until a fault after step 7; step 5's checkpoint is the last."""
    stopped = stopped_job(root, strategy, workers, *extra)
    # In-process the InjectedFault itself; spawned, the failed rank's exit.
    expected_error = InjectedFault if workers == 1 else ProcessException
    with pytest.raises(expected_error):
        run(stopped, workers)
    # Step 5 committed; the fault came after step 7, before the step-10 save.
    assert committed_checkpoints(stopped.run_dir) == ["step_00000005"]
    return stopped


def test_fsdp2_checkpoint_resumes_under_tensor_parallel(
    tmp_path: Path, saved_runs: Callable[[str, int, tuple[str, ...]], SavedRuns]
) -> None:
    """Saved by fsdp2 on 2 ranks (half of every parameter each), resumed with tp 2 on 2 ranks
    (each block's heads and MLP split instead): DCP reshards every tensor, optimizer state
    included, and training goes on as fsdp2's would. Not bitwise: a row-wise split sums each
    output over two partial products, another order of float additions than one matmul."""
    saved = saved_runs("fsdp2", 2, ())
    saved.copy(saved.stopped, tmp_path, "stopped")
    resumed = resume_job(tmp_path, "fsdp2", 2, "run.name=stopped", *TENSOR_PARALLEL)
    run(resumed, 2)
    expected, got = saved.final, final_model(resumed, tmp_path)
    assert expected.keys() == got.keys()
    far = {
        name: float((got[name] - tensor).abs().max())
        for name, tensor in expected.items()
        if not torch.allclose(got[name], tensor, rtol=1e-5, atol=key_bias_atol(name))
    }
    assert not far, far


def key_bias_atol(name: str) -> float:
    """The key projection's bias has no gradient in exact arithmetic (softmax ignores what
    it adds to a whole row of scores): what it gets is rounding, which Adam scales up to
    steps of ~1e-6 that differ with the order of additions. Everything else: 1e-6."""
    return 1e-5 if name.endswith("attn.k.bias") else 1e-6


def test_partial_checkpoint_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A save that never committed (crash mid-save) is never loaded, and the run says so."""
    job = resume_job(
        tmp_path, "single", 1, "run.name=partial", "run.max_steps=5", "run.progress=plain"
    )
    train(job, WorkerContext())
    # Simulate a crash during the next save: shards of step 10 written, no commit.
    partial = checkpoint_root(job.run_dir) / "step_00000010"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    capsys.readouterr()
    longer = resume_job(tmp_path, "single", 1, "run.name=partial", "run.progress=plain")
    summary = train(longer, WorkerContext())
    out = capsys.readouterr().out
    assert "skipped step_00000010: its save never committed (no meta.json)" in out
    assert "resumed from step_00000005" in out
    assert summary["resumed_from"].endswith("step_00000005")
    assert summary["steps"] == TOTAL_STEPS


def test_reshard_two_rank_fsdp2_to_one_rank_single(
    tmp_path: Path, saved_runs: Callable[[str, int, tuple[str, ...]], SavedRuns]
) -> None:
    """Saved by 2-rank fsdp2, resumed by 1-rank single: the same eval metrics."""
    saved = saved_runs("fsdp2", 2, ())
    saved.copy(saved.straight, tmp_path, "reshard")
    # Evaluate the restored weights without training further (resume at the final step).
    single = resume_job(tmp_path, "single", 1, "run.name=reshard")
    summary = train(single, WorkerContext())
    assert summary["resumed_from"].endswith(f"step_{TOTAL_STEPS:08d}")
    for key in ("test/acc", "test/loss", "test/f1"):
        assert summary["metrics"][key] == pytest.approx(saved.summary["metrics"][key], rel=1e-5)


def test_reshard_two_rank_fsdp2_to_four_rank_hsdp(
    tmp_path: Path, saved_runs: Callable[[str, int, tuple[str, ...]], SavedRuns]
) -> None:
    """Saved by fsdp2 on 2 ranks (each holds half of every parameter), resumed by hsdp on 4
    (2 replicas x 2 shards): DCP reshards it, and the restored weights evaluate the same."""
    saved = saved_runs("fsdp2", 2, ())
    saved.copy(saved.straight, tmp_path, "to-hsdp")
    hybrid = resume_job(tmp_path, "hsdp", 4, "run.name=to-hsdp", "strategy.shard_size=2")
    resumed = run_on_gloo(train_on_rank, 4, hybrid)
    assert resumed[0]["resumed_from"].endswith(f"step_{TOTAL_STEPS:08d}")
    for key in ("test/acc", "test/loss", "test/f1"):
        assert resumed[0]["metrics"][key] == pytest.approx(saved.summary["metrics"][key], rel=1e-5)


def consolidated(checkpoint: Path, target: Path) -> dict:
    dcp_to_torch_save(checkpoint, target)
    return torch.load(target, weights_only=True)


def assert_same_state(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


def test_async_save_writes_what_a_sync_save_writes(tmp_path: Path) -> None:
    """Background writes (dcp.async_save) while training goes on: the same bytes per step."""
    sync = resume_job(tmp_path, "ddp", 2, "run.name=sync", "checkpoint.keep_latest=3")
    background = resume_job(
        tmp_path,
        "ddp",
        2,
        "run.name=async",
        "checkpoint.keep_latest=3",
        "checkpoint.asynchronous=true",
    )
    run_on_gloo(train_on_rank, 2, sync)
    run_on_gloo(train_on_rank, 2, background)
    names = committed_checkpoints(background.run_dir)
    assert names == ["step_00000005", "step_00000010", f"step_{TOTAL_STEPS:08d}"]
    assert partial_checkpoints(background.run_dir) == []
    for name in names[:2]:  # the two written in the background
        expected = consolidated(checkpoint_root(sync.run_dir) / name, tmp_path / f"s{name}.pt")
        got = consolidated(checkpoint_root(background.run_dir) / name, tmp_path / f"a{name}.pt")
        assert_same_state(expected, got)


def test_storage_failure_is_clear_and_keeps_committed_checkpoints(tmp_path: Path) -> None:
    """A save that cannot write fails with one clear error; step 5 still loads and resumes."""
    job = resume_job(tmp_path, "single", 1, "run.name=storage")
    # Block the step-10 save: its directory is a link the save may not delete or write
    # through (root ignores permissions, so a read-only directory would not stop it).
    root = checkpoint_root(job.run_dir)
    root.mkdir(parents=True)
    blocker = tmp_path / "elsewhere"
    blocker.mkdir()
    (root / "step_00000010").symlink_to(blocker, target_is_directory=True)
    with pytest.raises(CheckpointStorageError) as failure:
        train(job, WorkerContext())
    message = str(failure.value)
    assert "cannot write" in message and "checkpoints/step_00000010" in message
    assert "committed checkpoints are intact (latest: step_00000005)" in message
    (root / "step_00000010").unlink()
    summary = train(job, WorkerContext())  # resumes from the intact step-5 checkpoint
    assert summary["resumed_from"].endswith("step_00000005")
    assert summary["steps"] == TOTAL_STEPS


def test_a_streamed_source_resumes_mid_epoch_bitwise(tmp_path: Path) -> None:
    """Parquet series streamed row group by row group (6 steps an epoch over 2 ranks): the run
    resumed from step 5 trains the rows it had not seen, in the same order."""
    from convoy.data.telematics import FleetSpec, write_fleet

    fleet = tmp_path / "fleet"
    write_fleet(FleetSpec(devices=5, hours=0.05, rate_hz=5, rows_per_group=4), str(fleet))
    series = (
        "model={name: conv1d, kwargs: {hidden: 16, depth: 2}}",
        "data.name=series",
        f"data.path={fleet}",
        "data.batch_size=8",
        "data.shuffle_row_groups=2",
        "run.epochs=3",
    )
    straight = resume_job(tmp_path, "ddp", 2, "run.name=straight", *series)
    run(straight, 2)
    stopped = stop_after_step_7(tmp_path, "ddp", 2, *series)
    run(stopped, 2)
    expected, resumed = final_model(straight, tmp_path), final_model(stopped, tmp_path)
    for name, tensor in expected.items():
        assert torch.equal(tensor, resumed[name]), name

"""Evidence 1: single on global batch B == ddp / fsdp / fsdp2 on B/2 per rank (gloo, 2 ranks).

The engine itself runs on both sides, so this also checks the sampler's global-batch split,
gradient averaging, the schedule and the logged (rank-averaged) loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.outputs import read_metrics
from convoy.testing import TINY_VIT_OVERRIDES, parity_overrides, run_on_gloo, train_on_rank

pytestmark = pytest.mark.distributed
STEPS = 8


def parity_job(tmp_path: Path, strategy: str, workers: int, extra: list[str] = ()) -> Job:  # type: ignore[assignment]
    return load_job(
        None,
        [
            *TINY_VIT_OVERRIDES,
            "data.name=digits",
            "data.batch_size=32",
            "optim.lr=5e-3",
            "optim.warmup_steps=2",
            "optim.grad_clip_norm=1.0",
            *parity_overrides(tmp_path, strategy, workers, STEPS, 7, f"{strategy}-{workers}"),
            *extra,
        ],
    )


def step_losses(job: Job) -> list[float]:
    records = read_metrics(job.run_dir)
    return [r["train/loss"] for r in records if r["kind"] == "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict]:
    job = parity_job(tmp_path_factory.mktemp("single"), "single", 1)
    summary = train(job, WorkerContext())
    return step_losses(job), summary


def test_updates_change_the_losses(reference: tuple[list[float], dict], tmp_path: Path) -> None:
    """The parity below is not trivial: with a negligible lr the same batches give other losses."""
    expected, _ = reference
    job = parity_job(tmp_path, "single", 1, ["optim.lr=1e-12"])
    train(job, WorkerContext())
    frozen = step_losses(job)
    assert frozen[0] == pytest.approx(expected[0], rel=1e-6)
    assert abs(frozen[-1] - expected[-1]) > 1e-3


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_losses_match_single(
    strategy: str, reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    expected, single_summary = reference
    job = parity_job(tmp_path, strategy, 2)
    summaries = run_on_gloo(train_on_rank, 2, job)
    losses = step_losses(job)
    assert len(losses) == len(expected) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5)
    # Both ranks return the same (all-rank) metrics, equal to the single-process ones.
    assert summaries[0]["metrics"] == summaries[1]["metrics"]
    for key in ("val/acc", "test/acc", "test/loss"):
        assert summaries[0]["metrics"][key] == pytest.approx(
            single_summary["metrics"][key], rel=1e-4
        )


def test_fsdp_with_activation_checkpointing_matches_single(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """FSDP1's per-block units recompute their blocks in backward: the same losses."""
    expected, _ = reference
    job = parity_job(tmp_path, "fsdp", 2, ["strategy.activation_checkpointing=full"])
    run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)


def test_hsdp_two_by_two_matches_single(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """hsdp on 4 ranks as 2 replicas x 2 shards (all-gathers inside each pair, gradient
    shards all-reduced across the pairs) == single on the same global batch."""
    expected, single_summary = reference
    job = parity_job(tmp_path, "hsdp", 4, ["strategy.shard_size=2"])
    summaries = run_on_gloo(train_on_rank, 4, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)
    assert summaries[0]["metrics"]["test/acc"] == pytest.approx(
        single_summary["metrics"]["test/acc"], rel=1e-4
    )


def test_fsdp2_with_tensor_parallel_matches_single(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """fsdp2 over 2 data-parallel ranks x tp 2 (each block's heads and MLP split over a pair
    that reads the same batch) == single; evaluation counts every sample once."""
    expected, single_summary = reference
    job = parity_job(tmp_path, "fsdp2", 4, ["strategy.tp_size=2"])
    summaries = run_on_gloo(train_on_rank, 4, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)
    assert all(summary["metrics"] == summaries[0]["metrics"] for summary in summaries)
    single = single_summary["metrics"]
    for key in ("train/samples", "val/samples", "test/samples"):
        assert summaries[0]["metrics"][key] == single[key]
    for key in ("val/acc", "test/acc", "test/loss"):
        assert summaries[0]["metrics"][key] == pytest.approx(single[key], rel=1e-4)


def test_a_user_models_own_plan_matches_single(tmp_path: Path) -> None:
    """A user's model with its own plan (two linears per block); its norms, stem and head
    are not in it, and Convoy replicates them over the pair."""
    user = ["model.name=task_data_helpers:PlannedMLP", "model.kwargs={}"]
    single = parity_job(tmp_path / "single", "single", 1, user)
    train(single, WorkerContext())
    split = parity_job(tmp_path / "split", "fsdp2", 2, [*user, "strategy.tp_size=2"])
    run_on_gloo(train_on_rank, 2, split)
    assert step_losses(split) == pytest.approx(step_losses(single), rel=1e-5)


def test_tensor_parallel_composes_with_compile_and_checkpointing(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """tp 2 on 2 ranks with each block compiled and checkpointed: the same losses."""
    expected, _ = reference
    blocks = ["run.compile=true", "strategy.activation_checkpointing=full"]
    job = parity_job(tmp_path, "fsdp2", 2, ["strategy.tp_size=2", *blocks])
    summaries = run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)
    assert summaries[0]["compile_seconds"] > 0


def test_accumulation_matches_one_big_batch(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """ddp with 2 accumulation micro-steps (no_sync on the first) == single on the full batch."""
    expected, _ = reference
    job = parity_job(tmp_path, "ddp", 2, ["optim.grad_accum_steps=2"])
    run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)

"""Evidence 1 for the tasks: single on global batch B == ddp / fsdp / fsdp2 on B/2 per rank.

Language modeling on ragged sequences (``task_data_helpers.ragged_lm``: 1 to 32 real tokens
each, padding -100), so the two halves of a global batch hold different numbers of tokens and
only the engine's global-count scaling makes a rank's gradient part of the exact token mean;
a control shows that per-rank means would not match. Then regression on diabetes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convoy.config import Job, load_job
from convoy.data.registry import load_splits
from convoy.data.samplers import GlobalBatchSampler
from convoy.distributed import WorkerContext
from convoy.engine.loop import seed_everything, train
from convoy.models.registry import build_initial
from convoy.outputs import read_metrics
from convoy.tasks import LanguageModeling
from convoy.testing import parity_overrides, run_on_gloo, train_on_rank
from task_data_helpers import GPT_TINY_OVERRIDES, real_tokens

pytestmark = pytest.mark.distributed
STEPS = 6  # the whole first epoch: 96 ragged sequences at global batch 16
BATCH = 16
SEED = 7


def lm_job(tmp_path: Path, strategy: str, workers: int, extra: list[str] = ()) -> Job:  # type: ignore[assignment]
    return load_job(
        None,
        [
            *GPT_TINY_OVERRIDES,
            "task.name=language_modeling",
            "data.name=task_data_helpers:ragged_lm",
            f"data.batch_size={BATCH}",
            "optim.lr=1e-2",
            "optim.warmup_steps=1",
            "optim.grad_clip_norm=1.0",
            *parity_overrides(tmp_path, strategy, workers, STEPS, SEED, f"{strategy}-{workers}"),
            *extra,
        ],
    )


def regression_job(tmp_path: Path, strategy: str, workers: int) -> Job:
    return load_job(
        None,
        [
            "task.name=regression",
            "model.name=tabular_mlp",
            "model.kwargs.hidden=32",
            "data.name=diabetes",
            "data.batch_size=32",
            "optim.lr=1e-2",
            "optim.grad_clip_norm=1.0",
            *parity_overrides(
                tmp_path, strategy, workers, STEPS, SEED, f"regression-{strategy}-{workers}"
            ),
        ],
    )


def step_losses(job: Job) -> list[float]:
    records = read_metrics(job.run_dir)
    return [r["train/loss"] for r in records if r["kind"] == "step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict]:
    job = lm_job(tmp_path_factory.mktemp("single"), "single", 1)
    summary = train(job, WorkerContext())
    return step_losses(job), summary


def first_global_batch(job: Job) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's and rank 1's (inputs, targets) of step 1, as the engine's sampler cuts them."""
    train_split = load_splits(job.data).train  # a TensorDataset: a list of indices picks rows
    halves = []
    for rank in range(2):
        sampler = GlobalBatchSampler(train_split, BATCH, 2, rank, seed=SEED)
        sampler.set_epoch(0)
        halves.append(train_split[list(sampler)[: BATCH // 2]])
    return halves


def test_ranks_hold_unequal_token_counts(tmp_path: Path) -> None:
    """The data makes the two halves of every global batch hold different token counts."""
    job = lm_job(tmp_path, "ddp", 2)
    train_split = load_splits(job.data).train
    tokens = real_tokens(train_split)
    samplers = [GlobalBatchSampler(train_split, BATCH, 2, rank, seed=SEED) for rank in range(2)]
    per_rank = [tokens[list(s)].view(STEPS, BATCH // 2).sum(dim=1) for s in samplers]
    assert (per_rank[0] != per_rank[1]).all(), per_rank
    # Padding is everywhere: no step is close to full sequences.
    assert int(per_rank[0].sum() + per_rank[1].sum()) < 0.7 * STEPS * BATCH * 32


def test_step_one_is_the_global_token_mean_not_a_mean_of_rank_means(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """By hand, for step 1: the logged loss is sum / global tokens; the rank means' average is
    measurably different, so the parity below would catch a per-rank mean."""
    expected, _ = reference
    job = lm_job(tmp_path, "single", 1)
    splits = load_splits(job.data)
    seed_everything(SEED)  # as the engine does before building the model
    model = build_initial(job.model.name, job.model.kwargs, splits.shape, SEED)
    task = LanguageModeling()
    sums, counts = [], []
    with torch.no_grad():
        for inputs, targets in first_global_batch(job):
            sums.append(float(task.loss_sum(model(inputs), targets)))
            counts.append(int(task.count(targets)))
    assert counts[0] != counts[1]
    exact = sum(sums) / sum(counts)
    rank_means = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    assert expected[0] == pytest.approx(exact, rel=1e-6)
    assert abs(rank_means - exact) / exact > 10 * 1e-5  # 10x the parity tolerance


@pytest.mark.parametrize(("strategy", "mode"), [("fsdp2", "full"), ("ddp", "every_n")])
def test_lm_losses_match_single_with_activation_checkpointing(
    strategy: str, mode: str, reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """Recomputing blocks in backward (under FSDP2's per-block gathers, and under DDP's
    bucketed all-reduce) changes no loss."""
    expected, _ = reference
    job = lm_job(tmp_path, strategy, 2, [f"strategy.activation_checkpointing={mode}"])
    run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)


def test_lm_losses_match_single_under_hsdp(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """Ragged token counts over 4 ranks in 2 replicas x 2 shards: still the global mean."""
    expected, _ = reference
    job = lm_job(tmp_path, "hsdp", 4, ["strategy.shard_size=2"])
    run_on_gloo(train_on_rank, 4, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)


def test_lm_losses_match_single_under_hsdp_with_tensor_parallel(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """8 ranks as 2 replicas x 2 shards x tp 2 (a 3-D mesh): still the global mean."""
    expected, _ = reference
    job = lm_job(tmp_path, "hsdp", 8, ["strategy.tp_size=2", "strategy.shard_size=2"])
    run_on_gloo(train_on_rank, 8, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("workers", "extra"),
    [(4, []), (2, ["run.compile=true", "strategy.activation_checkpointing=full"])],
    ids=["2x2", "tp2-compiled-checkpointed"],
)
def test_lm_losses_match_single_under_tensor_parallel(
    workers: int, extra: list[str], reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """Ragged token counts, data-parallel ranks x tp 2 with GPT's sequence-parallel norms:
    each pair counts its tokens once; and with its blocks compiled and checkpointed."""
    expected, single_summary = reference
    job = lm_job(tmp_path, "fsdp2", workers, ["strategy.tp_size=2", *extra])
    summaries = run_on_gloo(train_on_rank, workers, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)
    single = single_summary["metrics"]
    for key in ("train/tokens", "val/tokens", "test/tokens", "test/samples"):
        assert summaries[0]["metrics"][key] == single[key]
    for key in ("val/loss", "test/loss"):
        assert summaries[0]["metrics"][key] == pytest.approx(single[key], rel=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_lm_losses_match_single(
    strategy: str, reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    expected, single_summary = reference
    job = lm_job(tmp_path, strategy, 2)
    summaries = run_on_gloo(train_on_rank, 2, job)
    losses = step_losses(job)
    assert len(losses) == len(expected) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5)
    assert summaries[0]["metrics"] == summaries[1]["metrics"]
    single = single_summary["metrics"]
    for key in ("train/tokens", "val/tokens", "test/tokens", "test/samples"):
        assert summaries[0]["metrics"][key] == single[key]
    for key in ("train/loss", "val/loss", "test/loss", "test/ppl", "test/bpb"):
        assert summaries[0]["metrics"][key] == pytest.approx(single[key], rel=1e-5)


def test_lm_accumulation_matches_single(
    reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    """ddp with 2 micro-steps of 4 ragged sequences per rank == single on all 16 at once."""
    expected, _ = reference
    job = lm_job(tmp_path, "ddp", 2, ["optim.grad_accum_steps=2"])
    run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)


def test_per_rank_means_do_not_match(reference: tuple[list[float], dict], tmp_path: Path) -> None:
    """Control: ddp averaging each rank's own token mean (PerRankMeanLM) misses the reference
    by far more than the tolerance above, from step 1 on."""
    expected, _ = reference
    job = lm_job(tmp_path, "ddp", 2, ["task.name=task_data_helpers:PerRankMeanLM"])
    run_on_gloo(train_on_rank, 2, job)
    losses = step_losses(job)
    assert len(losses) == STEPS
    relative = [abs(a - b) / b for a, b in zip(losses, expected, strict=True)]
    assert min(relative) > 10 * 1e-5, relative


@pytest.fixture(scope="module")
def regression_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], dict]:
    job = regression_job(tmp_path_factory.mktemp("regression"), "single", 1)
    summary = train(job, WorkerContext())
    return step_losses(job), summary


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_regression_losses_match_single(
    strategy: str, regression_reference: tuple[list[float], dict], tmp_path: Path
) -> None:
    expected, single_summary = regression_reference
    assert abs(expected[-1] - expected[0]) > 1e-2  # the updates move the loss
    job = regression_job(tmp_path, strategy, 2)
    summaries = run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(expected, rel=1e-5)
    assert summaries[0]["metrics"] == summaries[1]["metrics"]
    single = single_summary["metrics"]
    for key in ("val/samples", "test/samples"):
        assert summaries[0]["metrics"][key] == single[key]
    for key in ("val/loss", "val/r2", "val/mae", "test/loss", "test/r2", "test/mae"):
        assert summaries[0]["metrics"][key] == pytest.approx(single[key], rel=1e-5)

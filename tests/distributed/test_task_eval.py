"""Evidence 2 for the tasks: 2-rank evaluation of fixed weights on odd-sized splits == single.

Language modeling on ragged sequences (every one with its own number of real tokens) and
regression on diabetes; each split has an odd number of samples, so rank 1's shard ends in a
padding duplicate that must not be counted. Every token and sample is counted exactly once:
the counts equal the data's own, and loss / ppl / bpb / r2 / mae equal the single-process ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from convoy.config import DataConfig, load_job
from convoy.data.base import Splits
from convoy.data.loaders import eval_loader
from convoy.data.registry import load_splits
from convoy.data.samplers import ShardedEvalSampler
from convoy.distributed import WorkerContext, join_process_group
from convoy.engine.amp import Precision
from convoy.engine.evaluate import evaluate
from convoy.metrics import MetricsManager
from convoy.models.registry import build_model
from convoy.strategies import build_strategy
from convoy.tasks import LanguageModeling, Regression, Task
from convoy.testing import run_on_gloo
from task_data_helpers import GPT_TINY_KWARGS, real_tokens

pytestmark = pytest.mark.distributed
SPLITS = ("val", "test")
LM_DATA = DataConfig(name="task_data_helpers:ragged_lm")  # val 37, test 41 sequences
REGRESSION_DATA = DataConfig(name="diabetes", test_fraction=0.21, val_fraction=0.11)
SETUPS: dict[str, tuple[type[Task], DataConfig, str, dict[str, Any]]] = {
    "language_modeling": (LanguageModeling, LM_DATA, "gpt_tiny", GPT_TINY_KWARGS),
    "regression": (Regression, REGRESSION_DATA, "tabular_mlp", {"hidden": 32}),
}


def evaluate_fixed_model(
    ctx: WorkerContext, setup: str, strategy_name: str, batch_size: int
) -> dict[str, float]:
    """Fixed (seeded, untrained) weights of ``setup``'s model, evaluated on val and test."""
    task_class, data_cfg, model_name, model_kwargs = SETUPS[setup]
    torch.manual_seed(123)
    splits = load_splits(data_cfg)
    model = build_model(model_name, model_kwargs, splits.shape)
    strategy_cfg = load_job(
        None, [f"strategy.name={strategy_name}", "scaling.num_workers=1"]
    ).strategy
    strategy = build_strategy(strategy_cfg, ctx.device, torch.float32)
    model = strategy.wrap(model)
    task = task_class()
    metrics = MetricsManager(task, splits.shape, ctx.device, splits.meta)
    precision = Precision(torch.float32, ctx.device, strategy)
    results: dict[str, float] = {}
    for split in SPLITS:
        loader = eval_loader(getattr(splits, split), batch_size, ctx.world_size, ctx.rank)
        results |= evaluate(model, task, loader, split, metrics, precision, ctx.device)
    return results


def evaluate_every_setup(
    ctx: WorkerContext, strategy_name: str, batch_size: int
) -> dict[str, dict[str, float]]:
    """Both tasks on one process group (one spawn per strategy keeps the test fast)."""
    if ctx.world_size > 1:
        torch.set_num_threads(1)  # two ranks on a small CPU: oversubscribed, 4x slower
        join_process_group(ctx, timeout_s=60)
    return {setup: evaluate_fixed_model(ctx, setup, strategy_name, batch_size) for setup in SETUPS}


@pytest.fixture(scope="module")
def data() -> dict[str, Splits]:
    return {setup: load_splits(SETUPS[setup][1]) for setup in SETUPS}


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict[str, float]]:
    return evaluate_every_setup(WorkerContext(), "single", 64)


# Odd eval batches too, so the padding sits inside a batch, not in a batch of its own.
@pytest.fixture(scope="module", params=[("ddp", 8), ("fsdp2", 5)], ids=["ddp", "fsdp2"])
def two_ranks(request: pytest.FixtureRequest) -> list[dict[str, dict[str, float]]]:
    strategy, batch_size = request.param
    return run_on_gloo(evaluate_every_setup, 2, strategy, batch_size)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_splits_are_odd_sized_so_rank_one_is_padded(setup: str, data: dict[str, Splits]) -> None:
    for split in SPLITS:
        dataset = getattr(data[setup], split)
        assert len(dataset) % 2 == 1
        shard = ShardedEvalSampler(dataset, 2, 1)
        assert len(shard) == shard.num_real + 1  # one duplicate the engine must drop
    if setup == "language_modeling":  # and the duplicate would add tokens if it were counted
        shard = ShardedEvalSampler(data[setup].test, 2, 1)
        assert real_tokens(data[setup].test)[shard.indices[-1]] > 0


def test_single_process_counts_every_token_once(
    single_process: dict[str, dict[str, float]], data: dict[str, Splits]
) -> None:
    lm, regression = single_process["language_modeling"], single_process["regression"]
    for split in SPLITS:
        tokens = real_tokens(getattr(data["language_modeling"], split))
        assert lm[f"{split}/samples"] == len(tokens)
        assert lm[f"{split}/tokens"] == int(tokens.sum())
        assert regression[f"{split}/samples"] == len(getattr(data["regression"], split))
    assert (regression["val/samples"], regression["test/samples"]) == (49, 93)
    # Sequences are ragged: far fewer tokens than positions.
    assert lm["test/tokens"] < 0.7 * lm["test/samples"] * 32


def test_lm_two_ranks_equal_single_process(
    single_process: dict[str, dict[str, float]],
    two_ranks: list[dict[str, dict[str, float]]],
) -> None:
    expected = single_process["language_modeling"]
    for result in (r["language_modeling"] for r in two_ranks):  # each rank: all-rank values
        for split in SPLITS:
            for key in ("samples", "tokens", "bytes"):  # each token exactly once
                assert result[f"{split}/{key}"] == expected[f"{split}/{key}"]
            for key in ("loss", "ppl", "bpb"):
                assert result[f"{split}/{key}"] == pytest.approx(
                    expected[f"{split}/{key}"], rel=1e-6
                )


def test_regression_two_ranks_equal_single_process(
    single_process: dict[str, dict[str, float]],
    two_ranks: list[dict[str, dict[str, float]]],
) -> None:
    expected = single_process["regression"]
    for result in (r["regression"] for r in two_ranks):
        for split in SPLITS:
            assert result[f"{split}/samples"] == expected[f"{split}/samples"]
            for key in ("loss", "rmse", "mae"):
                assert result[f"{split}/{key}"] == pytest.approx(
                    expected[f"{split}/{key}"], rel=1e-6
                )
            # Untrained, R² is near 0, where a relative tolerance means nothing: compare
            # 1 - R² (the residual over the total sum of squares, float32 sums in torchmetrics).
            assert 1 - result[f"{split}/r2"] == pytest.approx(1 - expected[f"{split}/r2"], rel=1e-6)

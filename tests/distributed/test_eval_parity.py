"""Evidence 2: 2-rank evaluation of fixed weights on an odd-sized split == single process."""

from __future__ import annotations

import pytest
import torch

from convoy.config import DataConfig
from convoy.data.loaders import eval_loader
from convoy.data.registry import load_splits
from convoy.distributed import WorkerContext, join_process_group
from convoy.engine.amp import Precision
from convoy.engine.evaluate import evaluate
from convoy.metrics import MetricsManager
from convoy.models.registry import build_model
from convoy.strategies import build_strategy
from convoy.tasks import Classification
from convoy.testing import run_on_gloo

pytestmark = pytest.mark.distributed


def evaluate_test_split(
    ctx: WorkerContext, strategy_name: str, batch_size: int
) -> dict[str, float]:
    """Fixed (seeded, untrained) weights, evaluated on digits' test split (359 samples)."""
    from convoy.config import load_job

    if ctx.world_size > 1:
        join_process_group(ctx, timeout_s=60)
    torch.manual_seed(123)
    splits = load_splits(DataConfig(name="digits"))
    model = build_model("vit_tiny", {"depth": 2, "hidden": 32, "mlp": 64}, splits.shape)
    strategy_cfg = load_job(
        None, [f"strategy.name={strategy_name}", "scaling.num_workers=1"]
    ).strategy
    strategy = build_strategy(strategy_cfg, ctx.device, torch.float32)
    model = strategy.wrap(model)
    loader = eval_loader(splits.test, batch_size, ctx.world_size, ctx.rank)
    task = Classification()
    metrics = MetricsManager(task, splits.shape, ctx.device)
    precision = Precision(torch.float32, ctx.device, strategy)
    return evaluate(model, task, loader, "test", metrics, precision, ctx.device)


@pytest.fixture(scope="module")
def single_process() -> dict[str, float]:
    return evaluate_test_split(WorkerContext(), "single", 64)


def test_split_is_odd_sized(single_process: dict[str, float]) -> None:
    assert single_process["test/samples"] == 359


@pytest.mark.parametrize(("strategy", "batch_size"), [("ddp", 64), ("fsdp2", 50)])
def test_two_ranks_equal_single_process(
    single_process: dict[str, float], strategy: str, batch_size: int
) -> None:
    results = run_on_gloo(evaluate_test_split, 2, strategy, batch_size)
    for result in results:  # every rank sees the all-rank value
        assert result["test/samples"] == 359  # each sample exactly once: no padding duplicates
        assert result["test/acc"] == single_process["test/acc"]
        assert result["test/top5"] == single_process["test/top5"]
        assert result["test/f1"] == pytest.approx(single_process["test/f1"], abs=1e-7)
        assert result["test/loss"] == pytest.approx(single_process["test/loss"], rel=1e-6)

"""The strategies a plan knows, and the job a layout runs: the recipe with another strategy
and world size, its micro-batch per rank and the dtype it computes in.
"""

from __future__ import annotations

from typing import Any

import torch

from convoy.config import (
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    FSDPStrategyConfig,
    Job,
    SingleStrategyConfig,
)
from convoy.errors import ConfigError

STRATEGY_ORDER = ("single", "ddp", "fsdp2", "fsdp")
"""Preference among layouts with the same number of workers: the simplest first, FSDP2
(Convoy's default sharded strategy) before FSDP1."""

DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
SHARDED = ("fsdp", "fsdp2")

_STRATEGY_CONFIGS: dict[str, type[Any]] = {
    "single": SingleStrategyConfig,
    "ddp": DDPStrategyConfig,
    "fsdp": FSDPStrategyConfig,
    "fsdp2": FSDP2StrategyConfig,
}


def layout_job(job: Job, strategy: str, world_size: int) -> Job:
    """``job`` run with ``strategy`` on ``world_size`` ranks. The recipe's own strategy
    settings are kept when it names the same strategy; others get their defaults."""
    cfg = job.strategy if job.strategy.name == strategy else _STRATEGY_CONFIGS[strategy]()
    scaling = job.scaling.model_copy(update={"num_workers": world_size})
    # model_copy skips the cross-section checks that tie a strategy to a launcher: a plan
    # asks about layouts, not about how this recipe would launch them.
    return job.model_copy(update={"strategy": cfg, "scaling": scaling})


def micro_batch(job: Job, world_size: int) -> int:
    """Samples per rank per forward: the global batch over ranks and accumulation steps."""
    parts = world_size * job.optim.grad_accum_steps
    if job.data.batch_size % parts:
        raise ConfigError(
            "data.batch_size",
            job.data.batch_size,
            f"must divide by world size x optim.grad_accum_steps = {world_size} x "
            f"{job.optim.grad_accum_steps}; pick world sizes that divide it",
        )
    return job.data.batch_size // parts


def compute_dtype(job: Job) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job.precision]

"""The strategies a plan knows, and the job a layout runs: the recipe with another strategy
and world size, its micro-batch per rank and the dtype it computes in.
"""

from __future__ import annotations

import torch

from convoy.config import Job, micro_batch, tp_size_of
from convoy.strategies import strategy_class, strategy_classes

DEFAULT_WORLD_SIZES = (1, 2, 4, 8)


def strategy_order() -> list[str]:
    """Every strategy, in the planner's preference among layouts with the same number of
    workers (``Strategy.plan_preference``): the simplest first, FSDP2 (Convoy's default
    sharded strategy) before FSDP1."""
    classes = strategy_classes()
    return sorted(classes, key=lambda name: classes[name].plan_preference)


def layout_job(job: Job, strategy: str, world_size: int, tp_size: int | None = None) -> Job:
    """``job`` run with ``strategy`` on ``world_size`` ranks. The recipe's own strategy
    settings are kept when it names the same strategy; others get their defaults, with the
    recipe's activation checkpointing (every strategy takes it). ``tp_size``: that tensor
    parallelism (a strategy that has it), else the recipe's where it names the strategy."""
    same = job.strategy.name == strategy
    cfg = (
        job.strategy
        if same
        else strategy_class(strategy, "--strategies").config_model(
            activation_checkpointing=job.strategy.activation_checkpointing,
            checkpoint_every=job.strategy.checkpoint_every,
        )
    )
    if tp_size is not None and tp_size != tp_size_of(cfg):
        cfg = cfg.model_copy(update={"tp_size": tp_size})
    scaling = job.scaling.model_copy(update={"num_workers": world_size})
    # model_copy skips the cross-section checks that tie a strategy to a launcher: a plan
    # asks about layouts, not about how this recipe would launch them.
    return job.model_copy(update={"strategy": cfg, "scaling": scaling})


def takes_tensor_parallel(strategy: str) -> bool:
    """Whether ``strategy``'s config has ``tp_size``."""
    return "tp_size" in strategy_class(strategy, "--strategies").config_model.model_fields


def compute_dtype(job: Job) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job.precision]


__all__ = [
    "DEFAULT_WORLD_SIZES",
    "compute_dtype",
    "layout_job",
    "micro_batch",
    "strategy_order",
    "takes_tensor_parallel",
    "tp_size_of",
]

"""``fsdp``: FSDP1 with ``transformer_auto_wrap_policy`` on the model's block class.

Kept for users coming from Ray Train's ``prepare_model(parallel_strategy="fsdp")``; unlike
that path it runs on CPU with gloo, wraps each block, and applies real mixed precision.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from convoy.config import FSDPStrategyConfig
from convoy.strategies.base import (
    InitialWeights,
    LightningCounterpart,
    Sharding,
    Strategy,
    transformer_blocks,
)

# FSDP1's sharded state dict (every checkpoint, on every rank) goes through torch's own
# deprecated paths (ShardedTensor, ``_get_pg_default_device``), and torch warns about itself
# there: nothing a user can act on, so these stay out of the run's output.
TORCH_INTERNAL_WARNINGS = (  # (category, message, module), as warnings.filterwarnings takes
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor", r"torch\."),
    (UserWarning, "`_get_pg_default_device` will be deprecated", r"torch\.distributed\.fsdp"),
    (
        UserWarning,
        "Multiple backends are registered with this ProcessGroup",
        r"torch\.distributed\.fsdp",
    ),
)

SHARDING = {
    "full_shard": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
}


class FSDPStrategy(Strategy):
    name = "fsdp"
    config_model = FSDPStrategyConfig
    requires_process_group = True
    # What full_shard (the default) splits: the planner models every FSDP1 run so.
    sharding = Sharding(
        parameters=True,
        gradients=True,
        optimizer_state=True,
        mesh_dim="world",
        layout="flat_per_unit",
    )
    comm_buffers = "fsdp_units"
    casts_parameters = True
    memory_tracking = None
    untracked_reason = (
        "torch's trackers cannot follow FSDP1's flat parameters (MemTracker hooks every "
        "parameter a module uses; use_orig_params makes them views during forward, which "
        "autograd refuses hooks on)"
    )
    lightning = LightningCounterpart("FSDPStrategy", ray_strategy="RayFSDPStrategy", needs_gpu=True)
    plan_preference = 3  # after fsdp2, Convoy's default sharded strategy
    compiles_whole_model = False

    @classmethod
    def comm_passes(cls, cfg: Any) -> float:
        # full_shard all-gathers in forward and again in backward, then reduce-scatters;
        # shard_grad_op keeps parameters gathered after forward; no_shard is DDP's all-reduce.
        return 3.0 if cfg.sharding == "full_shard" else 2.0

    def wrap(self, model: nn.Module, weights: InitialWeights | None = None) -> nn.Module:
        for category, message, module in TORCH_INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message, category, module)
        block_classes = {type(block) for block in transformer_blocks(model)}
        policy = (
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=block_classes)
            if block_classes
            else None
        )
        mixed = None
        if self.handles_precision:
            mixed = MixedPrecision(
                param_dtype=self.compute_dtype,
                reduce_dtype=torch.float32,  # gradients are averaged in full precision
                buffer_dtype=self.compute_dtype,
            )
        # A meta-built model is materialized and filled by FSDP one module at a time as it
        # wraps each unit (param_init_fn), before it flattens and shards the unit: a rank
        # holds its shards and one unit whole, never the model.
        init = (
            None
            if weights is None
            else functools.partial(weights.materialize_and_fill, device=self.device)
        )
        return FSDP(
            model if weights is not None else model.to(self.device),
            param_init_fn=init,
            auto_wrap_policy=policy,
            sharding_strategy=SHARDING[self.cfg.sharding],
            mixed_precision=mixed,
            cpu_offload=CPUOffload(offload_params=self.cfg.cpu_offload),
            # An explicit CPU device_id is what lets FSDP1 run on CPU with gloo.
            device_id=self.device,
            use_orig_params=True,
        )

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with model.no_sync():  # type: ignore[operator]
            yield

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)  # type: ignore[operator]

    def grad_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        return ShardedGradScaler(self.device.type, enabled=enabled)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, FSDP) else model

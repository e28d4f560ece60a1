"""``fsdp``: FSDP1 with ``transformer_auto_wrap_policy`` on the model's block class.

Kept for users coming from Ray Train's ``prepare_model(parallel_strategy="fsdp")``; unlike
that path it runs on CPU with gloo, wraps each block, and applies real mixed precision.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from convoy.strategies.base import Strategy, transformer_blocks

SHARDING = {
    "full_shard": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
}


class FSDPStrategy(Strategy):
    name = "fsdp"
    requires_process_group = True

    @property
    def handles_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    def wrap(self, model: nn.Module) -> nn.Module:
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
        return FSDP(
            model.to(self.device),
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

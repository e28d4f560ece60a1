"""``ddp``: DistributedDataParallel, with optional fp16/bf16 gradient compression.

The compression hooks halve allreduce traffic (as Horovod's fp16 compression does): gradients
are cast down, averaged, and cast back into the fp32 gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from convoy.config import DDPStrategyConfig
from convoy.dynamo_guard import dynamo_stand_in
from convoy.strategies.base import InitialWeights, LightningCounterpart, MemoryTracking, Strategy


def compress_hook(dtype: torch.dtype) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """Allreduce gradients cast to ``dtype`` (pre-divided by world size), then cast back.

    torch's own ``bf16_compress_hook`` refuses anything but NCCL; this one runs on gloo too.
    """

    # No annotations on purpose: DDP compares them with the real classes, and this module's
    # postponed (string) annotations would fail that check.
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        return future.then(decompress)

    hook.__name__ = f"{dtype_name(dtype)}_gloo_compatible_compress_hook"
    return hook


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


COMM_HOOKS = {"fp16": torch.float16, "bf16": torch.bfloat16}


class DDPStrategy(Strategy):
    name = "ddp"
    config_model = DDPStrategyConfig
    requires_process_group = True
    comm_buffers = "ddp_buckets"
    memory_tracking = MemoryTracking("MemTracker", fake_tensors=False)
    lightning = LightningCounterpart("DDPStrategy", ray_strategy="RayDDPStrategy")
    plan_preference = 1

    @classmethod
    def comm_passes(cls, cfg: Any) -> float:
        return 2.0  # one all-reduce of the gradients

    def wrap(self, model: nn.Module, weights: InitialWeights | None = None) -> nn.Module:
        model = self.place(model, weights)
        with dynamo_stand_in():  # torch's constructor would import Dynamo for one setting
            ddp = DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=self.cfg.find_unused_parameters,
                bucket_cap_mb=self.cfg.bucket_cap_mb,
            )
        if self.cfg.comm_hook != "none":
            ddp.register_comm_hook(None, compress_hook(COMM_HOOKS[self.cfg.comm_hook]))
        return ddp

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with model.no_sync():  # type: ignore[operator]
            yield

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

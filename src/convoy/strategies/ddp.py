"""``ddp``: DistributedDataParallel, with optional fp16/bf16 gradient compression.

The compression hooks halve allreduce traffic (as Horovod's fp16 compression does): gradients
are cast down, averaged, and cast back into the fp32 gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from convoy.strategies.base import Strategy

COMM_HOOKS = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


class DDPStrategy(Strategy):
    name = "ddp"
    requires_process_group = True

    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self.cfg.find_unused_parameters,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
        )
        if self.cfg.comm_hook != "none":
            ddp.register_comm_hook(None, COMM_HOOKS[self.cfg.comm_hook])
        return ddp

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with model.no_sync():  # type: ignore[operator]
            yield

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

"""``fsdp2``: per-parameter sharding with ``fully_shard`` on each block, then the root.

Mixed precision is real: ``MixedPrecisionPolicy(param_dtype=...)`` all-gathers and computes in
the job's precision while the sharded fp32 master weights and the optimizer stay in fp32;
``reduce_dtype`` sets the gradient reduce-scatter dtype. ``cpu_offload`` keeps sharded
parameters, gradients and optimizer state in CPU memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from convoy.config import FSDP2StrategyConfig
from convoy.strategies.base import (
    InitialWeights,
    LightningCounterpart,
    MemoryTracking,
    Sharding,
    Strategy,
    dtype_from_name,
    transformer_blocks,
)
from convoy.strategies.tensor_parallel import apply_tensor_parallel

SHARD, TP = "shard", "tp"


class FSDP2Strategy(Strategy):
    name = "fsdp2"
    config_model = FSDP2StrategyConfig
    requires_process_group = True
    sharding = Sharding(
        parameters=True,
        gradients=True,
        optimizer_state=True,
        mesh_dim="world",
        layout="per_parameter",
        unsharded_copies_on_one_rank=True,
    )
    comm_buffers = "fsdp_units"
    casts_parameters = True
    memory_tracking = MemoryTracking("FSDPMemTracker")
    # Data parallel over every worker, no tensor parallelism; Ray Train has no subclass.
    lightning = LightningCounterpart("ModelParallelStrategy")
    plan_preference = 2
    compiles_whole_model = False

    @classmethod
    def shard_ranks(cls, cfg: Any, world_size: int) -> int | None:
        """Its data-parallel ranks: every rank, or every tensor-parallel group (whose ranks
        hold different parts)."""
        if world_size % cfg.tp_size:
            return None
        return int(cfg.data_parallel_size(world_size))

    @classmethod
    def comm_volume(cls, cfg: Any, world_size: int) -> float:
        """FSDP's passes over the data-parallel ranks, each moving a rank's 1 / tp share of
        the parameters (counting every parameter as split). Tensor parallelism's own
        all-reduces carry activations, which scale with the batch, not with psi: not in it."""
        return super().comm_volume(cfg, world_size // cfg.tp_size) / cfg.tp_size

    @classmethod
    def comm_passes(cls, cfg: Any) -> float:
        # All-gather in forward and (resharded after it) again in backward, reduce-scatter.
        return 3.0 if cfg.reshard_after_forward else 2.0

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        param_dtype = self.compute_dtype if self.handles_precision else None
        return MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=dtype_from_name(self.cfg.reduce_dtype)
        )

    def data_parallel_layout(self, ranks: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The shape and dimension names of the mesh FSDP2 shards over, on ``ranks``
        data-parallel ranks: all of them, in one dimension."""
        return (ranks,), (SHARD,)

    def meshes(self) -> tuple[DeviceMesh, DeviceMesh | None]:
        """The data-parallel mesh FSDP2 shards over and, with ``tp_size`` > 1, the
        tensor-parallel one: the inner dimension of a single mesh, so a group is consecutive
        ranks (one node's, where TP's per-layer all-reduces belong)."""
        world, tp = dist.get_world_size(), self.cfg.tp_size
        shape, names = self.data_parallel_layout(world // tp)
        if tp == 1:
            return init_device_mesh(self.device.type, shape, mesh_dim_names=names), None
        mesh = init_device_mesh(self.device.type, (*shape, tp), mesh_dim_names=(*names, TP))
        # Flattened views (every rank; hsdp's shard x tp) let DTensor reduce a norm over the
        # dimensions a gradient is split on in one all-reduce (clipping), not one per dimension.
        mesh._flatten()
        if len(names) > 1:
            mesh[(names[-1], TP)]._flatten()
        return mesh[names], mesh[TP]

    def device_mesh(self) -> DeviceMesh:
        """The mesh the parameters are sharded over (data parallel)."""
        return self.meshes()[0]

    def wrap(self, model: nn.Module, weights: InitialWeights | None = None) -> nn.Module:
        """Tensor parallelism, then ``fully_shard`` per block and on the root. A meta-built
        model (``weights``) is laid out on meta, then only the rank's shards are materialized
        and filled (TorchTitan's order): no rank holds the whole model."""
        # Pinned host memory needs an accelerator; on a CPU-only run plain memory is right.
        pin = self.device.type == "cuda"
        offload = CPUOffloadPolicy(pin_memory=pin) if self.cfg.cpu_offload else OffloadPolicy()
        # Meshes on the strategy's device: the default mesh is the machine's accelerator even
        # where the run is on CPU (scaling.use_gpu=false), and would move the model there.
        options: dict[str, Any] = {
            "mp_policy": self.mixed_precision_policy(),
            "offload_policy": offload,
            "reshard_after_forward": self.cfg.reshard_after_forward,
        }
        if not self.cfg.cpu_offload and weights is None:
            model = model.to(self.device)
        data_parallel, tensor_parallel = self.meshes()
        options["mesh"] = data_parallel
        if tensor_parallel is not None:
            apply_tensor_parallel(model, tensor_parallel)
        for block in transformer_blocks(model):
            fully_shard(block, **options)
        fully_shard(model, **options)
        if weights is not None:
            # Offloaded shards live in host memory (FSDP2 moves them in for each unit).
            weights.materialize(model, torch.device("cpu") if self.cfg.cpu_offload else self.device)
            weights.fill(model)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # clip_grad_norm_ reduces over DTensor shards; the result is a DTensor to materialize.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def grad_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        return ShardedGradScaler(self.device.type, enabled=enabled)

"""``hsdp``: FSDP2's ``fully_shard`` over a 2-D mesh, replicate x shard (hybrid sharding).

Each group of ``strategy.shard_size`` ranks (default: the workers of one node) holds one
sharded replica of the model: parameters are all-gathered and gradients reduce-scattered
inside the group, as ``fsdp2`` does over every rank, and the gradient shards are then
all-reduced across the replicas. Between nodes only that all-reduce travels (2 x psi / shard
bytes a rank, against fsdp2's 3 x psi all-gathers and reduce-scatters over every rank), at the
cost of one replica per node in memory. Everything else (mixed precision, offload, clipping,
DCP checkpoints that reshard to and from ``fsdp2`` and other world sizes) is ``fsdp2``'s.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from convoy.config import HSDPStrategyConfig
from convoy.errors import ConfigError
from convoy.strategies.base import LightningCounterpart, Sharding
from convoy.strategies.fsdp2 import SHARD, FSDP2Strategy

REPLICATE = "replicate"


class HSDPStrategy(FSDP2Strategy):
    name = "hsdp"
    config_model = HSDPStrategyConfig  # type: ignore[assignment]  # fsdp2's, with shard_size
    sharding = Sharding(
        parameters=True,
        gradients=True,
        optimizer_state=True,
        mesh_dim=SHARD,
        layout="per_parameter",
        unsharded_copies_on_one_rank=True,
    )
    lightning = LightningCounterpart(
        "ModelParallelStrategy",
        refused="hsdp's 2-D mesh is not wired into Lightning's ModelParallelStrategy here "
        "(a LightningModule builds its own mesh in configure_model)",
    )
    plan_preference = 3

    @classmethod
    def shard_ranks(cls, cfg: Any, world_size: int) -> int | None:
        """The shard group's size; None where it is unset (the workers of a node, which only
        the placement knows) or does not split ``world_size`` into 2 or more replicas."""
        if cfg.shard_size is None:
            return None
        try:
            cfg.check_layout([world_size], None)
        except ConfigError:
            return None
        return int(cfg.shard_size)

    @classmethod
    def comm_volume(cls, cfg: Any, world_size: int) -> float:
        """fsdp2's passes inside a shard group, then an all-reduce (two passes) of each
        rank's 1/shard of the gradients across the replicas; a shard size the config leaves
        to the cluster counts as every data-parallel rank (fsdp2's volume). Under tensor
        parallelism, of each rank's 1 / tp share (as fsdp2's)."""
        ranks = world_size // cfg.tp_size  # data-parallel; each moves its 1 / tp share
        shard = cfg.shard_size or ranks
        replicas = ranks // shard
        inside = cls.comm_passes(cfg) * (shard - 1) / shard
        across = 2.0 * (replicas - 1) / replicas / shard
        return (inside + across) / cfg.tp_size

    def data_parallel_layout(self, ranks: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        shard = self.cfg.default_shard_size(self.local_world_size)
        # The config checked what it knew; under Ray the placement decides the default.
        self.cfg.check_layout([dist.get_world_size()], self.local_world_size)
        return (ranks // shard, shard), (REPLICATE, SHARD)

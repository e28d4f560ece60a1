"""The ``strategy`` section: one config model per strategy, and the facts about a strategy
that the schema's own checks need.

Why the models live here, below ``convoy.strategies``, and not in each strategy's file: the
``strategy`` field is a pydantic union told apart by ``name`` (its errors name the field and
the allowed names), and a union must know every member when ``Job`` is defined. Loading a
recipe must stay pure and light (no torch, no FSDP: a recorded job loads anywhere, and
``import convoy.config`` leaves the strategy modules unloaded), and the layers put config
under strategies. So the config models are this one list, and each ``Strategy`` class in
``convoy.strategies`` points down at its model (``config_model``), never the other way.

What the schema asks of a strategy is answered here, by its section, in plain arithmetic:
how many workers it trains on (``max_workers``), the layouts it takes (``check_layout``),
how a global batch is cut (``data_parallel_size``, ``data_parallel_rank``), and whether
every rank holds the whole model and optimizer (``shards_model_state``, which
``convoy.strategies``' ``Sharding`` agrees with; a test pins it). Everything that needs
torch is asked of the strategy's class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field

from convoy.config.base import Section
from convoy.errors import ConfigError


@dataclass(frozen=True)
class DataParallelRank:
    """A rank's place in the data-parallel split of each global batch."""

    index: int
    """Which share of each global batch it reads."""
    size: int
    """How many shares each global batch is cut into."""
    counts: bool
    """Whether its losses and metrics count: ranks that read the same share (one
    tensor-parallel group) count it once, on the first of them."""


class StrategySection(Section):
    """Base of each strategy's config section. The strategy's class (``convoy.strategies``)
    carries the rest of what is known about it."""

    name: str = ""
    """Each strategy's own ``Literal`` (declared here first so that it leads the section)."""
    max_workers: ClassVar[int | None] = None
    """The most workers the strategy trains on; None: any number."""
    shards_model_state: ClassVar[bool] = False
    """Whether it splits the parameters or the optimizer state over ranks (so no one rank
    can save the whole model alone); the strategy class's ``sharding`` says how."""

    def check_layout(self, world_sizes: list[int], workers_per_node: int | None) -> None:
        """Refuse (``ConfigError``) a layout the strategy cannot take at any of the run's
        world sizes; ``workers_per_node`` None where only the cluster decides it (Ray)."""

    def data_parallel_size(self, world_size: int) -> int:
        """How many shares each global batch is cut into on ``world_size`` ranks: one per rank,
        except where ranks of a tensor-parallel group read the same share."""
        return world_size

    def data_parallel_rank(self, rank: int, world_size: int) -> DataParallelRank:
        """Which share of each global batch ``rank`` reads, and whether it counts it."""
        return DataParallelRank(rank, world_size, counts=True)

    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    """Recompute blocks' activations in backward instead of keeping them (the model's
    ``blocks``): ``full`` every block, ``every_n`` blocks 0, n, 2n, ... (``checkpoint_every``).
    Only each checkpointed block's input is kept; the math is unchanged."""
    checkpoint_every: Annotated[int, Field(ge=2)] = 2
    """n for ``activation_checkpointing: every_n``."""


class SingleStrategyConfig(StrategySection):
    name: Literal["single"] = "single"
    max_workers: ClassVar[int | None] = 1


class DDPStrategyConfig(StrategySection):
    name: Literal["ddp"] = "ddp"
    comm_hook: Literal["none", "fp16", "bf16"] = "none"
    """Gradient compression for the allreduce (as Horovod's fp16 compression)."""
    find_unused_parameters: bool = False
    bucket_cap_mb: Annotated[float, Field(gt=0)] = 25.0


class FSDPStrategyConfig(StrategySection):
    name: Literal["fsdp"] = "fsdp"
    shards_model_state: ClassVar[bool] = True
    sharding: Literal["full_shard", "shard_grad_op", "no_shard"] = "full_shard"
    cpu_offload: bool = False


class FSDP2StrategyConfig(StrategySection):
    name: Literal["fsdp2"] = "fsdp2"
    shards_model_state: ClassVar[bool] = True
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the gradient reduce-scatter; params use the job's precision."""
    tp_size: Annotated[int, Field(gt=0)] = 1
    """Ranks that split each layer's matrices (tensor parallelism, the inner dimension of a
    data-parallel x tensor-parallel mesh: consecutive ranks, so one node's); they read the
    same batch. 1: none. The model states its plan (``tensor_parallel_plan``)."""

    def check_layout(self, world_sizes: list[int], workers_per_node: int | None) -> None:
        for world in world_sizes:
            self.data_parallel_size(world)

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.tp_size:
            raise ConfigError(
                "strategy.tp_size",
                self.tp_size,
                f"must divide the world size {world_size} (data-parallel x tensor-parallel ranks)",
            )
        return world_size // self.tp_size

    def data_parallel_rank(self, rank: int, world_size: int) -> DataParallelRank:
        # Tensor-parallel groups are consecutive ranks (the mesh's inner dimension); the
        # first rank of each counts its group's losses and metrics, once.
        return DataParallelRank(
            rank // self.tp_size,
            self.data_parallel_size(world_size),
            counts=rank % self.tp_size == 0,
        )


class HSDPStrategyConfig(FSDP2StrategyConfig):
    name: Literal["hsdp"] = "hsdp"  # type: ignore[assignment]
    shard_size: Annotated[int, Field(gt=0)] | None = None
    """Ranks that shard one replica of the model (the inner dimension of a replicate x shard
    mesh); the replicas all-reduce gradient shards between them. Default: the workers of one
    node, so all-gathers stay inside a node and only the all-reduce crosses the network."""

    def check_layout(self, world_sizes: list[int], workers_per_node: int | None) -> None:
        super().check_layout(world_sizes, workers_per_node)
        shard = self.default_shard_size(workers_per_node)
        if shard is None:
            return  # the workers of one node, as the cluster places them: checked at start
        field, value = (
            ("strategy.shard_size", shard) if self.shard_size else ("strategy.name", self.name)
        )
        for world in map(self.data_parallel_size, world_sizes):
            workers = "data-parallel ranks" if self.tp_size > 1 else "workers"
            if world % shard:
                raise ConfigError(
                    field, value, f"shard size {shard} must divide the {world} {workers}"
                )
            if world == shard:
                raise ConfigError(
                    field,
                    value,
                    f"hsdp with shard size {shard} on {world} {workers} is one replica, which "
                    "is fsdp2; use strategy.name=fsdp2, or a strategy.shard_size that splits "
                    f"the {workers} into 2 or more replicas",
                )

    def default_shard_size(self, workers_per_node: int | None) -> int | None:
        """``shard_size``, else one node's data-parallel ranks (None where the cluster's
        placement decides the workers of a node)."""
        if self.shard_size is not None:
            return self.shard_size
        if workers_per_node is None:
            return None
        return max(1, workers_per_node // self.tp_size)


StrategyConfig = Annotated[
    SingleStrategyConfig
    | DDPStrategyConfig
    | FSDPStrategyConfig
    | FSDP2StrategyConfig
    | HSDPStrategyConfig,
    Field(discriminator="name"),
]
"""The one list of strategies: a config model per strategy, each naming itself in ``name``.
Every other list of strategies (names, models, ``convoy.strategies``' registry) follows it."""
# Annotated[A | B | ..., Field(...)] -> (A, B, ...), each keyed by its name's default.
STRATEGY_MODELS: dict[str, type[StrategySection]] = {
    model.model_fields["name"].default: model for model in get_args(get_args(StrategyConfig)[0])
}
STRATEGY_NAMES = tuple(STRATEGY_MODELS)


def tp_size_of(strategy: StrategySection) -> int:
    """The tensor-parallel size of a strategy section (1 where it has none)."""
    return int(getattr(strategy, "tp_size", 1))


def layout_name(name: str, tp_size: int = 1) -> str:
    """A strategy's name, with ``+tpN`` under tensor parallelism (``fsdp2+tp2``)."""
    return name + (f"+tp{tp_size}" if tp_size > 1 else "")


def check_strategy_workers(strategy: StrategySection, workers: int, shown: Any) -> None:
    """A strategy that trains on at most N workers (``max_workers``) gets no more."""
    limit = strategy.max_workers
    if limit is None or workers <= limit:
        return
    name = getattr(strategy, "name", "")
    others = [other for other, model in STRATEGY_MODELS.items() if model.max_workers is None]
    alternatives = " or ".join([", ".join(map(repr, others[:-1])), repr(others[-1])])
    trains = "one worker" if limit == 1 else f"at most {limit} workers"
    raise ConfigError(
        "strategy.name",
        name,
        f"{name!r} trains {trains} but scaling.num_workers is {shown}; "
        f"use {alternatives}, or set scaling.num_workers={limit}",
    )

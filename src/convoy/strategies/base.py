"""The ``Strategy`` interface: how model state is split across ranks, and what is known about it.

A strategy wraps a model (model in, model out), says whether gradient sync can be skipped for
accumulation, clips gradients correctly for its parameter layout, and makes the grad scaler
that matches it. It is built from its own config section plus the device and the compute
dtype, and never reads another section.

Its class also carries what the rest of Convoy asks about it, so that no other module
branches on a strategy's name: what it shards (``sharding``), the buffers it communicates
through (``comm_buffers``) and how many bytes per step (``comm_volume``), whether it
all-gathers parameters (``gathers_parameters``), which of torch's memory trackers can follow
it (``memory_tracking``), its Lightning counterpart (``lightning``), its config model
(``config_model``, which also says how many workers it trains on) and where it comes in the
planner's preference (``plan_preference``). The planner, ``convoy plan --check``,
``convoy bench compare`` and the Lightning integration read these.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from convoy.config import StrategySection
from convoy.distributed import is_distributed


class InitialWeights(Protocol):
    """What fills a model built on the meta device once a strategy has laid it out
    (``convoy.models.init.InitialWeights``): strategies call it, models provide it."""

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Real, unset memory for what this rank holds of ``model``."""

    def fill(self, model: nn.Module) -> None:
        """Every parameter's initial values, this rank's part."""

    def materialize_and_fill(self, module: nn.Module, device: torch.device) -> None:
        """One module's own tensors, made real and filled (FSDP1's ``param_init_fn``)."""


ShardLayout = Literal["flat_per_unit", "per_parameter"]
CommBuffers = Literal["none", "ddp_buckets", "fsdp_units"]


@dataclass(frozen=True)
class Sharding:
    """What a strategy splits over ranks (what it does not, every rank holds whole), over
    which device-mesh dimension, and how: the planner's model of its shards."""

    parameters: bool = False
    gradients: bool = False
    optimizer_state: bool = False
    mesh_dim: str | None = None
    """The mesh dimension the shards span: ``"world"`` (every rank) for today's strategies;
    None where nothing is sharded."""
    layout: ShardLayout | None = None
    """``flat_per_unit``: one flat parameter per wrap unit, split evenly, which the optimizer
    steps as plain views of shard shapes (FSDP1 with ``use_orig_params``);
    ``per_parameter``: each parameter's dim 0 split, rank 0 holding the rounded-up chunk, as
    DTensor shards (FSDP2's ``fully_shard``)."""
    unsharded_copies_on_one_rank: bool = False
    """Whether it still all-gathers into separate unsharded copies on a single rank (FSDP2:
    its sharded and unsharded parameters are separate storages; FSDP1 switches to
    ``NO_SHARD`` there)."""


@dataclass(frozen=True)
class MemoryTracking:
    """How ``convoy plan --check`` follows a strategy with ``torch.distributed._tools``."""

    tracker: Literal["MemTracker", "FSDPMemTracker"]
    fake_tensors: bool = True
    """Whether it runs under ``FakeTensorMode`` (no memory, any model size). DDP's reducer
    reads parameter data, which fake tensors do not have: it runs on real tensors."""


@dataclass(frozen=True)
class LightningCounterpart:
    """The Lightning strategy a Convoy strategy maps to (``convoy.integrations.lightning``)."""

    strategy: str
    """A class in ``lightning.pytorch.strategies``."""
    ray_strategy: str | None = None
    """Ray Train's subclass in ``ray.train.lightning``, used under the Ray launcher (and
    validated there by ``prepare_trainer``); None: the Lightning class, with Ray's
    environment as a plugin."""
    needs_gpu: bool = False
    """Lightning runs it only on CUDA."""
    refused: str = ""
    """Why a ``lightning:`` job cannot use it here; empty where it can."""


class Strategy:
    """Base class: the identity strategy on one device. Subclasses override what differs."""

    name: ClassVar[str] = "base"
    config_model: ClassVar[type[StrategySection]]
    """The strategy's section of the job config (``convoy.config``)."""
    requires_process_group: ClassVar[bool] = False
    sharding: ClassVar[Sharding] = Sharding()
    comm_buffers: ClassVar[CommBuffers] = "none"
    """What the planner counts as communication memory: ``ddp_buckets`` (a copy of every
    gradient) or ``fsdp_units`` (wrap units gathered unsharded in turn)."""
    casts_parameters: ClassVar[bool] = False
    """In a low-precision run the strategy casts parameters to the compute dtype itself
    (FSDP's mixed precision): the engine must not autocast, and activations are those of
    cast parameters."""
    memory_tracking: ClassVar[MemoryTracking | None] = MemoryTracking("MemTracker")
    untracked_reason: ClassVar[str] = ""
    """Why no memory tracker can follow it, where ``memory_tracking`` is None."""
    lightning: ClassVar[LightningCounterpart]
    plan_preference: ClassVar[int] = 0
    """Order among layouts with the same number of workers in ``convoy plan``: lower first."""
    compiles_whole_model: ClassVar[bool] = True
    """``run.compile: model`` works: the strategy runs the model's forward as one call (a
    sharding strategy's per-block hooks would break the graph; it compiles per block)."""

    def __init__(
        self,
        cfg: Any,
        device: torch.device,
        compute_dtype: torch.dtype,
        local_world_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.compute_dtype = compute_dtype
        self.local_world_size = local_world_size
        """Workers on this rank's node (HSDP's default shard group)."""

    @classmethod
    def max_world_size(cls) -> int | None:
        """The most ranks it trains on (its config model's ``max_workers``); None: any."""
        return cls.config_model.max_workers

    @classmethod
    def runs_on(cls, world_size: int) -> bool:
        """Whether it can train on ``world_size`` ranks."""
        limit = cls.max_world_size()
        return limit is None or world_size <= limit

    @classmethod
    def shard_ranks(cls, cfg: Any, world_size: int) -> int | None:
        """The ranks its model state is split over on ``world_size`` ranks (1: whole on
        every rank); None where ``cfg`` cannot take that world size."""
        return world_size if cls.sharding.parameters else 1

    @classmethod
    def gathers_parameters(cls, world_size: int) -> bool:
        """Whether it all-gathers parameters into unsharded copies on ``world_size`` ranks."""
        one_rank_too = cls.sharding.unsharded_copies_on_one_rank
        return cls.comm_buffers == "fsdp_units" and (world_size > 1 or one_rank_too)

    @classmethod
    def comm_passes(cls, cfg: Any) -> float:
        """Collective passes over the parameter bytes per step with the options in ``cfg``
        (an all-reduce counts two: a reduce-scatter and an all-gather)."""
        return 0.0

    @classmethod
    def comm_volume(cls, cfg: Any, world_size: int) -> float:
        """Bytes sent per step per rank in units of the parameter bytes psi: each pass moves
        (n-1)/n of them (as nccl-tests count a ring); nothing on one rank."""
        if world_size == 1:
            return 0.0
        return cls.comm_passes(cfg) * (world_size - 1) / world_size

    @property
    def handles_precision(self) -> bool:
        """True when the strategy casts parameters itself, so the engine must not autocast."""
        return self.casts_parameters and self.compute_dtype != torch.float32

    def wrap(self, model: nn.Module, weights: InitialWeights | None = None) -> nn.Module:
        """The model laid out for training on this rank. ``weights``: the model was built on
        the meta device (``convoy.models.init``) and these fill it, on the rank's part of it
        only where the strategy shards; None: it is real already."""
        return self.place(model, weights)

    def place(self, model: nn.Module, weights: InitialWeights | None) -> nn.Module:
        """The whole model, real and on this rank's device: a meta-built one materialized
        there and filled (one copy, as ``single`` and ``ddp`` hold)."""
        if weights is None:
            return model.to(self.device)
        weights.materialize(model, self.device)
        weights.fill(model)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronization (for all but the last accumulation micro-step)."""
        yield

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def grad_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper (for names, blocks, export)."""
        return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (``model.blocks``), the unit that sharding wraps.

    A model without them is sharded as one unit, which works but gathers every parameter at
    once and overlaps no communication: say so rather than leave it silent.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    if is_distributed() and dist.get_rank() != 0:
        return []  # said once, by rank 0
    warnings.warn(
        f"{type(model).__name__} has no `blocks` (an nn.ModuleList of its repeated layers): "
        "it is sharded as a single unit; expose its layers as `self.blocks` to shard per block",
        stacklevel=2,
    )
    return []


def dtype_from_name(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]

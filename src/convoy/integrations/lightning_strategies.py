"""``strategy.name`` -> a Lightning strategy, per launcher.

Each Convoy strategy names its Lightning counterpart (``Strategy.lightning``); this module
builds it with the options Lightning takes from the strategy's config. Under Ray the
strategies are Ray Train's where it has one (``RayDDPStrategy``, ``RayFSDPStrategy``) with its
``RayLightningEnvironment``; ``fsdp2`` is Lightning's ``ModelParallelStrategy`` (data
parallel over every worker, no tensor parallelism), which ``prepare_trainer`` refuses, so it
gets the environment as a plugin and explicit ``devices``/``num_nodes``. Under ``local`` and
``torchrun`` Convoy has already joined the process group (``convoy.distributed``), and
``ConvoyEnvironment`` tells Lightning the ranks from the ``WorkerContext``; Lightning then
neither spawns processes nor creates a group of its own.

fsdp2: a module that overrides ``configure_model`` shards itself (Lightning's documented
way, which also allows tensor parallelism). One that does not is sharded by Convoy:
``fully_shard`` on each child module (its ``blocks`` first), over the data-parallel mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch.strategies
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from convoy.config import Job
from convoy.distributed import WorkerContext
from convoy.errors import ConvoyError
from convoy.strategies import strategy_class

FSDP_SHARDING = {
    "full_shard": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
}


class ConvoyEnvironment(ClusterEnvironment):
    """Ranks and world size from Convoy's ``WorkerContext``; the launcher made the processes
    and the process group, so Lightning's setters change nothing."""

    def __init__(self, ctx: WorkerContext, main_address: str = "127.0.0.1", port: int = 0):
        super().__init__()
        self.ctx = ctx
        self._address = main_address
        self._port = port

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._address

    @property
    def main_port(self) -> int:
        return self._port

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.ctx.world_size

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    def global_rank(self) -> int:
        return self.ctx.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # fixed by the launcher

    def local_rank(self) -> int:
        return self.ctx.local_rank

    def node_rank(self) -> int:
        return self.ctx.rank // max(1, self.ctx.local_world_size)


@dataclass(frozen=True)
class LightningLayout:
    """What ``lightning.Trainer`` gets for the strategy: the strategy object, its cluster
    environment plugin (if any), and the devices per node and node count."""

    strategy: Strategy
    plugins: list[Any]
    devices: int
    num_nodes: int


def build_layout(job: Job, ctx: WorkerContext) -> LightningLayout:
    """The strategy for ``job.strategy.name`` under ``job.scaling.launcher``."""
    devices = max(1, ctx.local_world_size)
    nodes = max(1, ctx.world_size // devices)
    strategy = lightning_strategy(job, ctx)
    if not strategy_class(job.strategy.name).requires_process_group:
        return LightningLayout(strategy, [], 1, 1)  # one device: no cluster to describe
    if job.scaling.launcher_section.runs_ray_train:
        from ray.train.lightning import RayLightningEnvironment  # the ray extra

        environment: ClusterEnvironment = RayLightningEnvironment()
    else:
        environment = ConvoyEnvironment(ctx)
    # The environment goes in as a plugin only: Lightning refuses it in both places.
    return LightningLayout(strategy, [environment], devices, nodes)


def lightning_strategy(job: Job, ctx: WorkerContext) -> Strategy:
    """The Convoy strategy's Lightning counterpart (Ray Train's subclass under Ray, where
    it has one), with the options Lightning takes from the strategy's config."""
    counterpart = strategy_class(job.strategy.name).lightning
    options = LIGHTNING_OPTIONS[counterpart.strategy](job.strategy, ctx)
    if job.scaling.launcher_section.runs_ray_train and counterpart.ray_strategy is not None:
        import ray.train.lightning  # the ray extra

        ray_class = getattr(ray.train.lightning, counterpart.ray_strategy)
        return ray_class(**options)
    lightning_class = getattr(lightning.pytorch.strategies, counterpart.strategy)
    return lightning_class(**options)


def _ddp_options(cfg: Any, ctx: WorkerContext) -> dict[str, Any]:
    return {
        "find_unused_parameters": getattr(cfg, "find_unused_parameters", False),
        "bucket_cap_mb": getattr(cfg, "bucket_cap_mb", 25.0),
    }


def _fsdp_options(cfg: Any, ctx: WorkerContext) -> dict[str, Any]:
    return {"sharding_strategy": FSDP_SHARDING[getattr(cfg, "sharding", "full_shard")]}


def _model_parallel_options(cfg: Any, ctx: WorkerContext) -> dict[str, Any]:
    # "auto" sizes would be num_nodes x devices; every worker is one data-parallel rank.
    return {"data_parallel_size": ctx.world_size, "tensor_parallel_size": 1}


LIGHTNING_OPTIONS: dict[str, Callable[[Any, WorkerContext], dict[str, Any]]] = {
    "SingleDeviceStrategy": lambda cfg, ctx: {"device": ctx.device},
    "DDPStrategy": _ddp_options,
    "FSDPStrategy": _fsdp_options,
    "ModelParallelStrategy": _model_parallel_options,
}
"""Per Lightning strategy class: its constructor's options from a Convoy strategy config."""


def prepare_module(job: Job, module: LightningModule) -> None:
    """Give a module without ``configure_model`` Convoy's FSDP2 sharding under ``fsdp2`` (whose
    counterpart, ``ModelParallelStrategy``, shards only what ``configure_model`` shards).

    The hook is set on this instance only (the class stays the user's): Lightning calls it
    on every fit/test, under its init contexts, with the device mesh in place.
    """
    counterpart = strategy_class(job.strategy.name).lightning
    # ModelParallelStrategy leaves sharding to the module's configure_model.
    if counterpart.strategy != "ModelParallelStrategy" or is_overridden("configure_model", module):
        return
    reshard = bool(getattr(job.strategy, "reshard_after_forward", True))
    module.configure_model = functools.partial(shard_module, module, reshard)  # type: ignore[method-assign]


def shard_module(module: LightningModule, reshard_after_forward: bool) -> None:
    """``fully_shard`` each child with parameters (its ``blocks`` first, when it has an
    ``nn.ModuleList`` of them) over the data-parallel mesh; idempotent, since Lightning calls
    ``configure_model`` again for ``test``."""
    if any(True for _ in module.parameters(recurse=False)):
        raise ConvoyError(
            f"strategy.name: got 'fsdp2'; {type(module).__name__} holds parameters directly "
            "(not in a submodule), which Convoy's sharding does not cover; define "
            "configure_model and apply fully_shard there (see docs/lightning.md)"
        )
    assert module.device_mesh is not None, "ModelParallelStrategy sets the mesh first"
    mesh = module.device_mesh["data_parallel"]
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    for child in module.children():
        if isinstance(child, FSDPModule) or not any(True for _ in child.parameters()):
            continue
        blocks = getattr(child, "blocks", None)
        for block in blocks if isinstance(blocks, nn.ModuleList) else ():
            fully_shard(block, **options)
        fully_shard(child, **options)

"""The ``scaling`` section: how many workers, and the launcher that starts them.

Each launcher has a section class here (``LocalLauncherConfig``, ``TorchrunConfig``,
``RayLauncherConfig``: the latter two are also its options, ``scaling.torchrun`` and
``scaling.ray``) that carries what the schema and the rest of Convoy ask of the launcher, as a
strategy's section does: how many workers it runs (``check_workers``), how they sit on nodes
(``workers_per_node``, ``node_size``, ``check_layout``), the data loaders it takes
(``loaders``) and builds in the driver (``driver_loaders``), whether its workers are Ray
Train's (``runs_ray_train``), and what else it refuses before a worker starts
(``check_checkpoint``). ``ScalingConfig.launcher_section`` is the chosen one; no code outside
``convoy.launchers`` compares a launcher's or a loader's name. The launcher classes that start
workers (``convoy.launchers``) sit above the engine and point down at these
(``Launcher.config_model``), so loading a recipe imports none of them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from convoy.config.base import Section
from convoy.config.run import CheckpointConfig
from convoy.config.strategy import StrategySection, tp_size_of
from convoy.errors import ConfigError


class LauncherSection(Section):
    """Base of each launcher's section: the facts and checks of a launcher that the schema
    and the rest of Convoy ask for (defaults: any worker count, placed by the cluster, the
    torch loader built in each worker)."""

    name: ClassVar[str]
    """The launcher's ``scaling.launcher``."""
    loaders: ClassVar[tuple[str, ...]] = ("torch",)
    """The ``data.loader``s it takes."""
    driver_loaders: ClassVar[tuple[str, ...]] = ()
    """Of those, the ones it builds in the driver and streams into the workers (Ray Data);
    a worker builds every other loader itself (torch's DataLoader)."""
    driver_loader_reason: ClassVar[str] = ""
    """Why its driver loaders need this launcher (for the error that refuses them elsewhere)."""
    runs_ray_train: ClassVar[bool] = False
    """Whether its workers are Ray Train's: Lightning's Ray strategies and environment, Ray
    Tune's trials, Ray Train's checkpoint retention and relaxed collectives go with them."""

    def workers_per_node(self, scaling: ScalingConfig) -> int | None:
        """Workers on each node, where the config decides it; None where the cluster's
        placement does (Ray)."""
        return None

    def node_size(self, scaling: ScalingConfig) -> int:
        """World sizes come in multiples of this: the workers of a node, where the launcher
        adds and removes whole nodes (torchrun); else 1."""
        return 1

    def check_layout(self, scaling: ScalingConfig) -> None:
        """Refuse (``ConfigError``) a layout of workers on nodes it cannot start."""

    def check_workers(self, scaling: ScalingConfig) -> None:
        """Refuse more workers than it can run."""

    def check_checkpoint(self, checkpoint: CheckpointConfig) -> None:
        """Refuse a checkpoint retention it cannot keep."""

    @classmethod
    def check_driver_loader(
        cls, loader: str, scaling: ScalingConfig, strategy: StrategySection
    ) -> None:
        """Refuse a run that the loader it would build in the driver cannot feed (checked
        whichever launcher the job names: the loader's own limits come first)."""

    @classmethod
    def takes_loader(cls, loader: str) -> bool:
        """Whether it runs a job whose ``data.loader`` is ``loader``."""
        return loader in cls.loaders

    @classmethod
    def builds_in_driver(cls, loader: str) -> bool:
        """Whether it builds ``loader`` in the driver and streams it into the workers (the
        one place the loader is chosen: each worker builds torch's DataLoader otherwise)."""
        return loader in cls.driver_loaders


class LocalLauncherConfig(LauncherSection):
    """``local``: the engine in this process, one worker. It has no options."""

    name: ClassVar[str] = "local"

    def workers_per_node(self, scaling: ScalingConfig) -> int | None:
        return scaling.max_workers

    def check_workers(self, scaling: ScalingConfig) -> None:
        if scaling.max_workers > 1:
            shown = scaling.worker_bounds if scaling.elastic else scaling.max_workers
            others = [name for name in LAUNCHER_NAMES if name != self.name]
            raise ConfigError(
                "scaling.num_workers",
                shown,
                f"the {self.name!r} launcher runs one in-process worker; use "
                f"{' or '.join(map(repr, others))} for more",
            )


class TorchrunConfig(LauncherSection):
    """``torchrun``: workers started by torchrun on each node, whole nodes at a time."""

    name: ClassVar[str] = "torchrun"
    nnodes: str = "1"
    """Number of nodes, or ``MIN:MAX`` for elastic training (derived from an elastic
    ``scaling.num_workers`` when that is a range)."""
    nproc_per_node: Annotated[int, Field(gt=0)] | None = None
    """Workers per node; default: ``scaling.num_workers`` over the (maximum) node count, or 1
    with an elastic ``scaling.num_workers``."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it (torchrun ``--local-addr``); default:
    the address this node uses to reach the rendezvous endpoint."""
    node_rank: Annotated[int, Field(ge=0)] | None = None
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous; a free local port when unset."""
    rdzv_id: str | None = None

    @field_validator("nnodes", mode="before")
    @classmethod
    def _count_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("nnodes")
    @classmethod
    def _count_or_range(cls, value: str) -> str:
        nodes_range(value)
        return value

    def workers_per_node(self, scaling: ScalingConfig) -> int | None:
        return torchrun_layout(scaling)[1]

    def node_size(self, scaling: ScalingConfig) -> int:
        return self.nproc_per_node or 1

    def check_layout(self, scaling: ScalingConfig) -> None:
        torchrun_layout(scaling)


def nodes_range(nnodes: str) -> tuple[int, int]:
    """Parse torchrun's ``"2"`` or ``"1:4"`` into (min, max) nodes."""
    try:
        low, _, high = nnodes.partition(":")
        bounds = int(low), int(high or low)
    except ValueError:
        bounds = (0, 0)
    if not 0 < bounds[0] <= bounds[1]:
        raise ValueError("expected N or MIN:MAX nodes with 0 < MIN <= MAX")
    return bounds


def torchrun_layout(scaling: ScalingConfig) -> tuple[str, int]:
    """torchrun's ``--nnodes`` and ``--nproc-per-node`` for ``scaling``.

    Fixed size: ``num_workers`` spread over the node count (or ``nproc_per_node`` each).
    Elastic ``num_workers: [MIN, MAX]``: torchrun adds and removes whole nodes, so the bounds
    must be multiples of ``nproc_per_node`` (default 1) and ``--nnodes`` is MIN:MAX nodes.
    """
    opts = scaling.torchrun
    low_nodes, max_nodes = nodes_range(opts.nnodes)
    if not scaling.elastic:
        if low_nodes != max_nodes:
            raise ConfigError(
                "scaling.torchrun.nnodes",
                opts.nnodes,
                "an elastic torchrun run is set with scaling.num_workers: [MIN, MAX] (workers), "
                "from which --nnodes MIN:MAX follows; give nnodes as a node count here",
            )
        workers = scaling.max_workers
        per_node = opts.nproc_per_node or max(1, workers // max_nodes)
        if per_node * max_nodes != workers:
            raise ConfigError(
                "scaling.num_workers",
                workers,
                f"torchrun starts scaling.torchrun.nnodes {max_nodes} x {per_node} worker(s) per "
                f"node = {per_node * max_nodes}; make them agree",
            )
        return opts.nnodes, per_node
    per_node = opts.nproc_per_node or 1
    if any(bound % per_node for bound in scaling.worker_bounds):
        raise ConfigError(
            "scaling.num_workers",
            scaling.worker_bounds,
            f"torchrun adds and removes whole nodes of scaling.torchrun.nproc_per_node="
            f"{per_node} workers, so both bounds must be multiples of {per_node}",
        )
    low, high = (bound // per_node for bound in scaling.worker_bounds)
    # The default "1" (also what a saved config.yaml carries) defers to the range.
    if (low_nodes, max_nodes) not in ((1, 1), (low, high)):
        raise ConfigError(
            "scaling.torchrun.nnodes",
            opts.nnodes,
            f"scaling.num_workers {scaling.worker_bounds} with {per_node} worker(s) per node "
            f"means --nnodes {low}:{high}; leave nnodes unset or make them agree",
        )
    return f"{low}:{high}", per_node


class RayLauncherConfig(LauncherSection):
    """``ray``: Ray Train's workers, placed by the Ray cluster (an embedded local Ray, or the
    one ``RAY_ADDRESS`` names)."""

    name: ClassVar[str] = "ray"
    loaders: ClassVar[tuple[str, ...]] = ("torch", "ray_data")
    driver_loaders: ClassVar[tuple[str, ...]] = ("ray_data",)
    driver_loader_reason: ClassVar[str] = "Ray Data streams into Ray Train workers"
    runs_ray_train: ClassVar[bool] = True

    start_timeout_s: Annotated[float, Field(gt=0)] = 180.0
    """How long an embedded local Ray may take to start on a busy machine (its daemons, its
    dashboard when one is needed, the first worker processes registering), retries included,
    before the run gives up with one line."""
    worker_niceness: Annotated[int, Field(ge=-20, le=19)] | None = None
    """Scheduling priority (nice value) of the train workers; default: the niceness ``convoy``
    itself runs at, as torchrun's workers would have (Ray's own default is 15)."""

    def check_checkpoint(self, checkpoint: CheckpointConfig) -> None:
        if checkpoint.keep_best and checkpoint.keep_latest > 1:
            # Under Ray, Ray Train's checkpoint manager owns retention: the best K by a
            # score, plus the latest one. Convoy's "latest K and best K" cannot be expressed.
            raise ConfigError(
                "checkpoint.keep_latest",
                checkpoint.keep_latest,
                f"with checkpoint.keep_best {checkpoint.keep_best} under scaling.launcher "
                f"{self.name!r}, Ray Train keeps the best K plus only the latest checkpoint; "
                "set keep_latest: 1 (or keep_best: 0)",
            )

    @classmethod
    def check_driver_loader(
        cls, loader: str, scaling: ScalingConfig, strategy: StrategySection
    ) -> None:
        if loader not in cls.driver_loaders:
            return
        if scaling.elastic:
            raise ConfigError(
                "scaling.num_workers",
                scaling.worker_bounds,
                f"data.loader {loader} cuts the eval splits per rank when the run starts, so "
                "it needs a fixed worker count; use data.loader: torch for an elastic run",
            )
        workers = scaling.max_workers
        if strategy.data_parallel_size(workers) < workers:
            raise ConfigError(
                "data.loader",
                loader,
                f"Ray Data streams each worker its own share of a batch, while the ranks of a "
                f"tensor-parallel group (strategy.tp_size {tp_size_of(strategy)}) "
                "must read the same one; use data.loader: torch with tensor parallelism",
            )


LAUNCHER_MODELS: dict[str, type[LauncherSection]] = {
    model.name: model for model in (LocalLauncherConfig, TorchrunConfig, RayLauncherConfig)
}
"""Each launcher's section class by name, in ``scaling.launcher``'s order (a test pins it)."""
LAUNCHER_NAMES = tuple(LAUNCHER_MODELS)


class ScalingConfig(Section):
    launcher: Literal["local", "torchrun", "ray"] = "ray"
    num_workers: int | tuple[int, int] = 2
    """Train workers, or ``[MIN, MAX]`` (also ``"MIN:MAX"``) for elastic training: Ray Train
    resizes between the bounds as nodes come and go, torchrun gets ``--nnodes MIN:MAX``. At
    any size the global batch is ``data.batch_size`` and step k sees the same samples."""
    elastic_monitor_interval_s: Annotated[float, Field(gt=0)] = 60.0
    """Elastic Ray runs: how often Ray Train checks whether the cluster fits another size."""
    use_gpu: bool = False
    cpus_per_worker: Annotated[float, Field(gt=0)] = 1.0
    """CPUs Ray reserves per train worker; fractional values leave CPUs for Ray Data."""
    gpus_per_worker: Annotated[float, Field(ge=0)] | None = None
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    """Extra custom Ray resources per worker."""
    threads_per_worker: Annotated[int, Field(gt=0)] | None = None
    """torch intra-op threads per worker; default: the node's cores / local workers."""
    max_failures: Annotated[int, Field(ge=0)] = 0
    """Restarts after a worker failure (Ray FailureConfig / torchrun --max-restarts)."""
    max_preemption_failures: Annotated[int, Field(ge=-1)] = -1
    """Ray: restarts after a node of the run was preempted (drained, then gone), counted
    apart from ``max_failures``; -1: no limit (Ray Train's default). Under torchrun a
    restart after a stop is one of ``--max-restarts``."""
    relax_collectives_on_preemption: bool = False
    """Ray, ddp: on a node's preemption notice the other ranks save without it (rank 0
    writes the whole model and optimizer alone, and Ray's report barrier leaves the
    preempted ranks out), so a node that dies before the save is done costs no step. Each
    rank's RNG state is saved only for rank 0."""
    torchrun: TorchrunConfig = Field(default_factory=TorchrunConfig)
    ray: RayLauncherConfig = Field(default_factory=RayLauncherConfig)
    """The `ray` launcher's embedded local Ray: start-up bound and the train workers' priority."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers_or_range(cls, value: Any) -> Any:
        if isinstance(value, str) and ":" in value:
            low, _, high = value.partition(":")
            value = (low.strip(), high.strip())
        if isinstance(value, (list, tuple)):
            try:
                first, last = (int(v) for v in value)
            except (TypeError, ValueError):
                raise ValueError("expected a count N or a range [MIN, MAX]") from None
            if not 0 < first <= last:
                raise ValueError("a range [MIN, MAX] needs 0 < MIN <= MAX")
            return (first, last) if first < last else first
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError("expected a count N or a range [MIN, MAX]")
        try:
            count = int(value)
        except ValueError:
            raise ValueError("expected a count N or a range [MIN, MAX]") from None
        if count <= 0:
            raise ValueError("input should be greater than 0")
        return count

    @property
    def worker_bounds(self) -> list[int]:
        """``[min, max]`` workers (equal for a fixed count)."""
        return [self.min_workers, self.max_workers]

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def launcher_section(self) -> LauncherSection:
        """The chosen launcher's section, which answers for it: its options where it has
        them (``scaling.torchrun``, ``scaling.ray``: the field named after the launcher)."""
        options = getattr(self, self.launcher, None)
        if isinstance(options, LauncherSection):
            return options
        return LAUNCHER_MODELS[self.launcher]()

    @property
    def elastic(self) -> bool:
        """True when ``num_workers`` is a range: the world size may change during the run."""
        return isinstance(self.num_workers, tuple)


def world_sizes(scaling: ScalingConfig) -> list[int]:
    """Every world size a run may have: each size of an elastic range (whole nodes of
    ``nproc_per_node`` workers under torchrun: the launcher's ``node_size``)."""
    step = scaling.launcher_section.node_size(scaling)
    sizes = range(scaling.min_workers, scaling.max_workers + 1)
    return [n for n in sizes if n % step == 0] or [scaling.max_workers]

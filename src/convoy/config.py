"""The job config: one frozen, validated pydantic model built from a YAML recipe plus overrides.

A ``Job`` has the sections ``task``, ``model``, ``data``, ``optim``, ``strategy``,
``precision``, ``scaling``, ``run``, ``checkpoint``, ``fault``, ``tracking``, ``monitor``,
``lightning`` and ``k8s``. Every section forbids unknown keys, so a misspelled key fails at
load time with a suggestion instead of being silently ignored. Checks that span sections
(global batch divisible by workers x accumulation, fp16 needs a GPU) run once the whole job
is known. The schema is pure: checks that import code, read files or build the model and
data live in ``convoy.preflight``, run once in the driver before any worker starts.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from convoy.errors import ConfigError, one_of


class Section(BaseModel):
    """Base for every config section: frozen, unknown keys forbidden."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class TaskConfig(Section):
    name: str = "classification"
    """What a batch is, the loss and the metrics: classification, language_modeling,
    regression, or the user's own ``package.module:Class`` (a ``convoy.tasks.Task``)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task's constructor."""


class ModelConfig(Section):
    name: str = "vit_tiny"
    """A registered model name (see ``convoy.models``) or a user factory ``package.module:fn``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory; data-shaped ones the factory accepts
    (``num_classes``, ``in_channels``, ``image_size``, ``vocab_size``, ``num_features``...)
    default to the dataset's."""


class RayDataConfig(Section):
    """How the ``ray_data`` loader runs its preprocessing (``map_batches``) on CPU."""

    compute: Literal["tasks", "actors"] = "tasks"
    """tasks: stateless Ray tasks; actors: a pool of long-lived actors."""
    concurrency: Annotated[int, Field(gt=0)] | None = None
    """Most tasks at once, or the actor pool's size, per pipeline (every train worker runs
    its own for training; default: Ray decides; 1 actor)."""
    batch_size: Annotated[int, Field(gt=0)] = 256
    """Rows per preprocessing batch."""
    reserved_cpus: Annotated[float, Field(gt=0)] = 1.0
    """CPUs kept free of train workers for the pipeline; train workers get fractions if needed."""
    prefetch_batches: Annotated[int, Field(ge=0)] = 2
    """Units (row groups or chunks) each worker's pipeline hands over ahead of the step, and
    batches of an eval split (iter_torch_batches)."""
    shuffle_buffer_rows: Annotated[int, Field(ge=0)] = 1024
    """Rows of an in-memory source (or of parquet image slices) whose order each worker
    shuffles together every epoch (a window of chunks, after the chunks' own seeded order);
    streamed sources use ``data.shuffle_row_groups``."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources every preprocessing task or actor asks for, e.g.
    ``{preprocess: 1}``: the map stages then run only on nodes started with that resource
    (``ray start --resources '{"preprocess": 8}'``), so CPU-only nodes preprocess and the
    training nodes only train."""
    cache_eval_mib: Annotated[float, Field(ge=0)] = 1024
    """Eval splits whose preprocessed tensors fit in this many MiB are preprocessed once and
    kept in the object store; larger ones are streamed at every evaluation."""

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ValueError(
                    f"{name}={amount}: allowed: custom resource names (not CPU, GPU or memory: "
                    "CPUs come from reserved_cpus) with amounts above 0"
                )
        return value


class DataConfig(Section):
    name: str = "digits"
    """A registered dataset (``convoy list``) or a user factory ``package.module:fn`` that
    returns the splits (see the README's "Your own model, data and task")."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for a user data factory."""
    path: str | None = None
    """Directory, file or archive for datasets read from disk (cifar10, imagefolder, parquet,
    numpy; text: a .txt file, a folder of them, or parquet with a text column; series: a
    folder or s3://bucket/prefix of parquet shards, streamed)."""
    seq_len: Annotated[int, Field(gt=0)] = 128
    """Tokens per training sequence (text): the corpus is packed into sequences this long."""
    tokenizer: Literal["bpe", "bytes"] = "bpe"
    """text: 'bpe' trains a byte-level BPE on the training split (tokenizers library);
    'bytes' uses the 256 UTF-8 byte values (no training, no vocabulary file)."""
    vocab_size: Annotated[int, Field(ge=257)] = 2048
    """text with tokenizer 'bpe': the vocabulary size to train."""
    text_column: str = "text"
    """text from parquet: the column that holds the documents."""
    series_columns: list[str] | None = None
    """series: the list columns that are the channels, in order (default: series.json's
    channels, else every list column)."""
    label_column: str = "label"
    """series: the integer label column."""
    series_len: Annotated[int, Field(gt=0)] | None = None
    """series: the padding rule; every series is padded with zeros or cut to this many steps
    (unset: all series must have one length)."""
    shuffle_row_groups: Annotated[int, Field(gt=0)] = 4
    """Streamed sources (series, a sharded text corpus), either loader: rows are shuffled
    within windows of this many row groups, which is also what a worker holds in memory at
    once."""
    stream_readers: Annotated[int, Field(gt=0)] = 2
    """Streamed sources with the torch loader: threads that read a rank's next windows at
    once, each a whole window (a rank holds this many windows more in memory). More keep a
    GPU fed at large batches (one H200, conv1d at batch 1,024: 1 -> 2 readers took the data
    wait from 13% to 6.5%) and hide object storage's latency."""
    loader: Literal["torch", "ray_data"] = "torch"
    """torch: a DataLoader in every worker; ray_data: a Ray Data pipeline streamed into the
    Ray Train workers (needs scaling.launcher: ray)."""
    on_bad_record: Literal["error", "skip"] = "error"
    """An unreadable image: error names it and stops; skip leaves it out and reports it."""
    ray_data: RayDataConfig = Field(default_factory=RayDataConfig)
    batch_size: Annotated[int, Field(gt=0)] = 64
    """Global training batch: split over workers and accumulation steps."""
    eval_batch_size: Annotated[int, Field(gt=0)] = 256
    """Per-worker batch for evaluation."""
    num_workers: Annotated[int, Field(ge=0)] = 0
    """DataLoader worker processes per training worker."""
    val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
    """Share of the training set held out for validation when the dataset has no val split."""
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """Share held out for test when the dataset has no test split (digits)."""
    image_size: Annotated[int, Field(gt=0)] | None = None
    """Resize images to this size (imagefolder); synthetic images use it as their size."""
    train_size: Annotated[int, Field(gt=0)] | None = None
    """Number of training samples (synthetic), or a cap on them (other datasets)."""
    augment_crop_padding: Annotated[int, Field(ge=0)] = 0
    """Training-only augmentation: pad by this many pixels and crop back at a random offset."""
    augment_flip: bool = False
    """Training-only augmentation: flip images horizontally with probability 1/2."""


TORCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"betas": (0.9, 0.999), "weight_decay": 0.01},  # torch.optim.AdamW
    "sgd": {"momentum": 0.0, "weight_decay": 0.0},  # torch.optim.SGD
}
"""Each optimizer's own fields and torch's defaults for them: what a recipe that leaves one
out gets, so a loop ported from plain PyTorch trains the same. A field that is not in its
optimizer's entry (``momentum`` for adamw, ``betas`` for sgd) stays null."""


class OptimConfig(Section):
    """The optimizer and its learning-rate schedule.

    ``weight_decay``, ``momentum`` and ``betas`` default to torch's for ``name``
    (``TORCH_DEFAULTS``), resolved at load time so ``convoy config show`` prints what will
    be used; one the optimizer does not have is refused rather than ignored. The schedule is
    Convoy's, as torch's optimizers have none to follow: cosine by default (the shipped
    recipes are tuned with it), after ``warmup_steps`` of linear warm-up (none unless asked
    for). ``convoy train`` prints both before it starts.
    """

    name: Literal["adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 1e-3
    """Peak learning rate (after warmup), before optional linear scaling."""
    weight_decay: Annotated[float, Field(ge=0)] | None = None
    """Weight decay of parameters of 2-D and up (decoupled for adamw, L2 for sgd); default:
    torch's, 0.01 for adamw and 0 for sgd."""
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = None
    """sgd only; default: torch's 0 (``SGD(lr, momentum=0.9)`` is ``momentum: 0.9``)."""
    betas: tuple[float, float] | None = None
    """adamw only; default: torch's (0.9, 0.999)."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Steps of linear warm-up from lr / warmup_steps to the peak."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine decay to ``min_lr_ratio`` x lr over the run, or a constant lr
    (what a plain torch loop without a scheduler does)."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Cosine floor as a fraction of the peak learning rate."""
    scale_lr_base_batch: Annotated[int, Field(gt=0)] | None = None
    """If set, lr is scaled linearly by global_batch / this value (Goyal et al.)."""
    grad_clip_norm: Annotated[float, Field(gt=0)] | None = None
    """Clip the global gradient norm (over every shard) to this value."""
    grad_accum_steps: Annotated[int, Field(gt=0)] = 1
    fused: bool | None = None
    """torch's fused optimizer kernel (one launch for every parameter, not one per tensor);
    default: on for CUDA, off elsewhere (on the CPU the per-tensor loop is torch's default,
    and the fused kernel rounds differently)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not all(0 <= beta < 1 for beta in value):
            raise ValueError("allowed: two numbers in [0, 1), e.g. [0.9, 0.999]")
        return value

    @model_validator(mode="after")
    def _torch_defaults(self) -> OptimConfig:
        """Fill the optimizer's unset fields with torch's defaults; refuse the other's."""
        own = TORCH_DEFAULTS[self.name]
        for key in ("weight_decay", "momentum", "betas"):
            value = getattr(self, key)
            if key not in own and value is not None:
                has = next(name for name, fields in TORCH_DEFAULTS.items() if key in fields)
                raise ConfigError(
                    f"optim.{key}",
                    value,
                    f"set but optim.name is {self.name!r}, which has no {key}; remove it, or "
                    f"use optim.name: {has}",
                )
            if key in own and value is None:
                # The model is frozen; this runs once, while it is being built.
                object.__setattr__(self, key, own[key])
        return self

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The optimizer's own fields, resolved (``momentum`` or ``betas``, and
        ``weight_decay``), as torch's constructor names them."""
        return {key: getattr(self, key) for key in TORCH_DEFAULTS[self.name]}


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
    sharding: Literal["full_shard", "shard_grad_op", "no_shard"] = "full_shard"
    cpu_offload: bool = False


class FSDP2StrategyConfig(StrategySection):
    name: Literal["fsdp2"] = "fsdp2"
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


class TorchrunConfig(Section):
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


class RayLauncherConfig(Section):
    start_timeout_s: Annotated[float, Field(gt=0)] = 180.0
    """How long an embedded local Ray may take to start on a busy machine (its daemons, its
    dashboard when one is needed, the first worker processes registering), retries included,
    before the run gives up with one line."""
    worker_niceness: Annotated[int, Field(ge=-20, le=19)] | None = None
    """Scheduling priority (nice value) of the train workers; default: the niceness ``convoy``
    itself runs at, as torchrun's workers would have (Ray's own default is 15)."""


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
    def elastic(self) -> bool:
        """True when ``num_workers`` is a range: the world size may change during the run."""
        return isinstance(self.num_workers, tuple)


class RunConfig(Section):
    name: str | None = None
    """Run directory name; unnamed runs get ``<model>-<data>-<strategy>-<timestamp>-<id>``."""
    storage_dir: str = "runs"
    """Root for run outputs, ``<storage_dir>/<name>/``: a local or shared (NFS) path, or
    ``s3://bucket/prefix`` (an S3-compatible server via ``AWS_ENDPOINT_URL``)."""
    seed: int = 0
    epochs: Annotated[int, Field(gt=0)] = 1
    max_steps: Annotated[int, Field(gt=0)] | None = None
    """Stop after this many optimizer steps (overrides epochs when reached first)."""
    eval_every_epochs: Annotated[int, Field(gt=0)] = 1
    log_every_steps: Annotated[int, Field(gt=0)] = 10
    progress: Literal["auto", "bar", "plain", "off"] = "auto"
    """auto: a live bar on a TTY, plain lines otherwise (rank 0 only)."""
    collective_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Timeout of one collective operation (the process group's timeout)."""
    hang_timeout_s: Annotated[float, Field(gt=0)] | None = None
    """Fail the attempt, naming the stuck rank(s), when a rank makes no progress this long."""
    shared_storage: bool = False
    """Say that a local ``storage_dir`` is a filesystem every node mounts at the same path
    (NFS, EFS, a PVC); without it, runs whose workers span several nodes refuse local paths."""
    compile: bool | Literal["blocks", "model"] = False
    """``torch.compile``: ``blocks`` (or ``true``) compiles each of the model's ``blocks``
    (each block's forward, one graph), before sharding; ``model`` compiles the whole model's
    forward, the loss of a model that computes it (``gpt``) included, where the strategy
    keeps the model whole (``single``, ``ddp``; a sharded strategy compiles per block). The
    time spent compiling is reported apart from the step time."""
    stop_on_signal: bool = True
    """SIGTERM, SIGUSR1 or Ctrl-C (a spot notice, a scheduler, a user), and under Ray a
    preemption notice for a node of the run, save the step just finished and stop the run,
    resumable (exit code 75; under Ray, restarted by Ray Train once the node is gone); the
    ranks agree on it with a small all-reduce at most every ~0.1 s. false: a signal ends the
    workers as it would any program, and a preempted Ray run restarts from its last
    periodic checkpoint."""
    stop_poll_s: Annotated[float, Field(ge=0)] = 0.1
    """How often, at most, the ranks agree on stop requests (0: at every step boundary). A
    request is acted on within about two of these, after a finished step."""

    @field_validator("storage_dir")
    @classmethod
    def _local_or_s3(cls, value: str) -> str:
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", value)
        if scheme and scheme.group(1) != "s3":
            raise ValueError("allowed: a local or shared path, or s3://bucket/prefix")
        if not re.match(r"^s3://[^/]+", value) and value.startswith("s3:"):
            raise ValueError("an s3:// location needs a bucket: s3://bucket/prefix")
        return value

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off_is_false(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False; the user meant the string.
        return "off" if value is False else value


class CheckpointConfig(Section):
    every_steps: Annotated[int, Field(gt=0)] | None = None
    """Save every this many optimizer steps (mid-epoch checkpoints resume mid-epoch)."""
    every_epochs: Annotated[int, Field(gt=0)] | None = None
    """Save at the end of every this many epochs."""
    keep_latest: Annotated[int, Field(gt=0)] = 2
    """Committed checkpoints to keep; older ones are deleted only after a newer one commits."""
    asynchronous: bool = False
    """Write shards in the background (dcp.async_save) while training continues."""
    keep_best: Annotated[int, Field(ge=0)] = 0
    """Also keep this many best checkpoints by ``best_metric`` (as of their save)."""
    best_metric: str = "val/loss"
    """A ``val/`` or ``train/`` metric the task reports (``val/acc``, ``val/bpb``, ``val/r2``...);
    checked against the task before the run starts."""
    best_mode: Literal["auto", "min", "max"] = "auto"
    """Which way is better for ``best_metric``; auto: the task's (min for losses, max for
    accuracy and R²)."""
    resume: bool = True
    """Continue from the latest committed checkpoint in the run directory, if there is one."""

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_epochs is not None


class FaultConfig(Section):
    """Fault injection, for tests and demonstrations of recovery."""

    kind: Literal["none", "raise", "kill", "hang", "slow", "preempt"] = "none"
    """raise: an exception; kill: SIGKILL the process; hang: stop making progress; slow: from
    ``at_step`` on, this rank spends ``slow_seconds`` more on every step's forward (a straggler:
    a slower device or a busier host); preempt: this rank gets a stop notice whose deadline is
    ``deadline_s`` away, as a spot reclaim or a scheduler's warning would give it (the run saves
    and stops if a save fits in that time, else stops and resumes from its last checkpoint)."""
    rank: Annotated[int, Field(ge=0)] = 0
    at_step: Annotated[int, Field(gt=0)] = 1
    """Fire right after this optimizer step (and after its checkpoint, if one is due)."""
    attempts: Annotated[int, Field(ge=0)] = 1
    """Fire on the first this many attempts of the run (restarts included); 0: every attempt."""
    slow_seconds: Annotated[float, Field(gt=0)] = 0.05
    """With ``kind: slow``: the delay added to each of the rank's steps."""
    deadline_s: Annotated[float, Field(ge=0)] = 30.0
    """With ``kind: preempt``: seconds from the notice to the (notional) kill."""


class MlflowConfig(Section):
    """The MLflow sink: params = the resolved recipe, metrics = the event stream, artifacts =
    the summary (and the export, when one is made)."""

    enabled: bool = False
    tracking_uri: str | None = None
    """Any MLflow tracking URI (``http://host:5000``, ``sqlite:///path.db``). Default: a local
    SQLite store ``mlflow.db`` with artifacts under ``mlruns/``, both in ``run.storage_dir``."""
    experiment: str = "convoy"


class TrackingConfig(Section):
    """Experiment tracking sinks, next to ``metrics.jsonl`` (which is always written)."""

    tensorboard: bool = True
    """TensorBoard event files under ``<run>/tensorboard/`` (needs ``convoy[tracking]``).
    Without it, the default is turned off quietly; a recipe that sets it is told so in one
    line before any worker starts, and trains without it."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)


class MonitorConfig(Section):
    """Live monitoring of the workers, at every logged step (``run.log_every_steps``)."""

    straggler_margin: Annotated[float, Field(gt=0)] = 0.25
    """A rank whose local work per step (data wait + forward) exceeds the median of the other
    ranks' by more than this fraction is named a straggler."""
    straggler_min_seconds: Annotated[float, Field(ge=0)] = 0.002
    """...and by more than this many seconds, so timer noise on tiny models names nobody."""
    straggler_patience: Annotated[int, Field(gt=0)] = 2
    """...in this many logged steps in a row: a rank slowed once (a busy core) is not named."""
    prometheus: bool | None = None
    """Under Ray: export the per-rank figures as ``ray.util.metrics`` (Prometheus) metrics.
    Unset: on when the run joins a Ray cluster (a Prometheus scrapes its nodes' metrics
    ports), off on the private Ray a run starts for itself, whose port is picked at random
    and which stops with the run (its metrics collection then costs every step about 4%
    here for nothing). ``true`` exports there too."""


class LightningConfig(Section):
    """Run a user's ``LightningModule`` unchanged (``module``), with its ``LightningDataModule``
    (``datamodule``), under Convoy's launchers and ``strategy.name``. Unset: Convoy's engine."""

    module: str | None = None
    """``package.module:Class`` of a ``lightning.LightningModule``."""
    module_kwargs: dict[str, Any] = Field(default_factory=dict)
    datamodule: str | None = None
    """``package.module:Class`` of a ``lightning.LightningDataModule``; required with module."""
    datamodule_kwargs: dict[str, Any] = Field(default_factory=dict)
    trainer_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra ``lightning.Trainer`` arguments (e.g. ``gradient_clip_val``); Convoy sets the
    strategy, devices, epochs, precision, logging and checkpointing itself."""

    @property
    def enabled(self) -> bool:
        return self.module is not None


class K8sConfig(Section):
    """How ``convoy k8s`` runs the job on Kubernetes: a KubeRay ``RayJob`` (default), a
    long-lived ``RayCluster``, or a Kubeflow ``PyTorchJob``. ``convoy train`` ignores it;
    ``convoy.k8s.validate`` checks it (with the rest of the job) before anything is sent."""

    kind: Literal["rayjob", "raycluster", "pytorchjob"] = "rayjob"
    """What ``convoy k8s render`` writes (``--kind`` overrides it)."""
    image: str | None = None
    """Image with Convoy and Ray 2.60.0 installed, pinned by tag or digest
    (``registry.example.com/convoy:0.1.0``); untagged and ``:latest`` images are refused."""
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)
    namespace: str = "default"
    name: str | None = None
    """Name of the objects (DNS-1035; a RayJob at most 47 characters); default: from
    ``run.name``. It is also the run id: the ``convoy.io/run-id`` label and the Ray job id."""
    service_account: str | None = None
    """Service account of every pod (IRSA / workload identity for S3, for example)."""
    workers_per_pod: Annotated[int, Field(gt=0)] = 1
    """Train workers per worker pod (e.g. 8 on an 8-GPU node)."""
    worker_cpu: Annotated[float, Field(gt=0)] | None = None
    """CPUs of one worker pod (request = limit); default: scaling.cpus_per_worker x
    workers_per_pod."""
    worker_memory: str = "8Gi"
    """Memory of one worker pod (request = limit), ``/dev/shm`` included."""
    worker_gpus: Annotated[int, Field(ge=0)] | None = None
    """GPUs of one worker pod; default with scaling.use_gpu: GPUs per worker x workers_per_pod."""
    head_cpu: Annotated[float, Field(gt=0)] = 2.0
    """CPUs of the Ray head pod; the head takes no train workers (``num-cpus: 0``)."""
    head_memory: str = "4Gi"
    gpu_type: str | None = None
    """The GPU model worker pods must land on, matched against ``gpu_node_label``
    (e.g. ``NVIDIA-H100-80GB-HBM3``); required with scaling.use_gpu."""
    gpu_node_label: str = "nvidia.com/gpu.product"
    """The node label that names the GPU model (NVIDIA GPU feature discovery sets this one)."""
    gpu_resource: str = "nvidia.com/gpu"
    extra_resources: dict[str, str] = Field(default_factory=dict)
    """More limits per worker pod, e.g. ``vpc.amazonaws.com/efa: "4"``."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels every pod needs: head, workers and the RayJob's submitter alike (e.g.
    ``node.kubernetes.io/instance-type``); GPU pods also get ``gpu_node_label: gpu_type``."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Pod tolerations; GPU pods also get ``{key: <gpu_resource>, operator: Exists}``."""
    pvc: str | None = None
    """A ReadWriteMany PVC that every pod mounts at ``pvc_mount_path``; the run is stored on it
    (``run.storage_dir`` becomes ``<pvc_mount_path>/<storage_dir>``). Without it,
    ``run.storage_dir`` must be ``s3://``: the pods share no other filesystem."""
    pvc_mount_path: str = "/mnt/shared"
    shm_size: str = "2Gi"
    """Size of ``/dev/shm`` (a memory ``emptyDir``: NCCL and DataLoader workers use it)."""
    tmp_size: str = "4Gi"
    """Size limit of ``/tmp`` (an ``emptyDir`` on the node's disk: Ray's session directory,
    logs and spilled objects); a pod that writes more is evicted."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every Ray / PyTorch container (e.g. ``AWS_ENDPOINT_URL``)."""
    termination_grace_s: Annotated[int, Field(gt=0)] | None = None
    """``terminationGracePeriodSeconds`` of the training pods: the time from a stop (a spot
    reclaim, a node drain, a deleted pod) to the kill, in which the run saves the step it
    finished. Default: 30 s plus twice the planned save (the checkpoint bytes one pod writes,
    at 100 MiB/s); ``convoy k8s validate`` warns when the run's last measured save is longer."""
    env_secrets: list[str] = Field(default_factory=list)
    """Secrets whose keys become environment variables in every pod (S3 credentials)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """More labels on every object (e.g. ``kueue.x-k8s.io/queue-name``)."""
    recipe_in: Literal["configmap", "inline"] = "configmap"
    """How the resolved recipe reaches the pods: a ConfigMap mounted at /etc/convoy, or inline
    in the entrypoint (no extra object; limited by the entrypoint's size)."""
    active_deadline_s: Annotated[int, Field(gt=0)] = 86_400
    """Fail the job after this long, whatever it is doing (never retried)."""
    pre_running_deadline_s: Annotated[int, Field(gt=0)] = 1_200
    """Fail the job if it is not Running after this long (image pulls, unschedulable GPUs)."""
    ttl_after_finished_s: Annotated[int, Field(ge=0)] = 3_600
    """Delete the Ray cluster this long after the job ends (its pods' logs go with it)."""
    backoff_limit: Annotated[int, Field(ge=0)] = 0
    """Retries of the whole job, each on a new Ray cluster (resuming from the checkpoint)."""
    autoscaling: bool = False
    """Opt in to the KubeRay autoscaler (v2) between the min and max worker pods; training
    defaults to a fixed-size worker group."""
    max_worker_pods: Annotated[int, Field(gt=0)] | None = None
    """With autoscaling: the cap on worker pods (required)."""
    ray_version: str = "2.60.0"
    """The Ray in the image; token auth needs 2.52 or later."""

    @field_validator("env", "extra_resources", "node_selector", "labels", mode="before")
    @classmethod
    def _scalars_as_strings(cls, value: Any) -> Any:
        """YAML reads ``OMP_NUM_THREADS: 4`` or ``efa: 4`` as a number and ``x: true`` as a
        bool; these maps hold strings (``"4"``, ``"true"``), so scalars are written out."""
        if not isinstance(value, dict):
            return value
        return {
            k: ("true" if v else "false") if isinstance(v, bool)
            else str(v) if isinstance(v, (int, float)) else v
            for k, v in value.items()
        }  # fmt: skip


class Job(Section):
    """A whole training job."""

    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    strategy: StrategyConfig = Field(default_factory=DDPStrategyConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    lightning: LightningConfig = Field(default_factory=LightningConfig)
    k8s: K8sConfig = Field(default_factory=K8sConfig)

    @model_validator(mode="after")
    def _check_across_sections(self) -> Job:
        check_job(self)
        return self

    @property
    def run_uri(self) -> str:
        """``<storage_dir>/<name>``: an absolute local path or an ``s3://`` URI (launchers name
        unnamed runs first)."""
        name = self.run.name or "unnamed"
        if self.run.storage_dir.startswith("s3://"):
            return f"{self.run.storage_dir.rstrip('/')}/{name}"
        return str(Path(self.run.storage_dir).expanduser().resolve() / name)

    @property
    def run_dir(self) -> Path:
        """The run directory on this machine's file system; for local storage only."""
        if self.run.storage_dir.startswith("s3://"):
            raise ValueError(f"run.storage_dir: {self.run.storage_dir!r} is not a local path")
        return Path(self.run_uri)


def tp_size_of(strategy: StrategySection) -> int:
    """The tensor-parallel size of a strategy section (1 where it has none)."""
    return int(getattr(strategy, "tp_size", 1))


def layout_name(name: str, tp_size: int = 1) -> str:
    """A strategy's name, with ``+tpN`` under tensor parallelism (``fsdp2+tp2``)."""
    return name + (f"+tp{tp_size}" if tp_size > 1 else "")


def world_sizes(scaling: ScalingConfig) -> list[int]:
    """Every world size a run may have: each size of an elastic range (whole nodes of
    ``nproc_per_node`` workers under torchrun)."""
    step = (scaling.torchrun.nproc_per_node or 1) if scaling.launcher == "torchrun" else 1
    sizes = range(scaling.min_workers, scaling.max_workers + 1)
    return [n for n in sizes if n % step == 0] or [scaling.max_workers]


def split_batch(batch: int, world_size: int, accum_steps: int) -> int | None:
    """The one rule for splitting a global batch: each of ``world_size`` ranks runs
    ``accum_steps`` forwards of ``batch / (world_size x accum_steps)`` samples. None where
    that does not divide evenly (a step's batch must never change with the split)."""
    parts = world_size * accum_steps
    return None if batch % parts else batch // parts


def micro_batch(job: Job, world_size: int) -> int:
    """Samples per rank per forward of ``job`` on ``world_size`` ranks (``split_batch``).
    Raises ``ConfigError`` where the global batch does not split: an elastic launcher may
    start fewer workers than the config names, and a plan may ask about any world size."""
    accum = job.optim.grad_accum_steps
    shares = job.strategy.data_parallel_size(world_size)
    rows = split_batch(job.data.batch_size, shares, accum)
    if rows is None:
        raise ConfigError(
            "data.batch_size",
            job.data.batch_size,
            f"must divide by data-parallel ranks x optim.grad_accum_steps = {shares} x {accum}",
        )
    return rows


def check_batch_split(job: Job) -> None:
    """The global batch must split evenly over workers x accumulation at every world size the
    run may have (``world_sizes``), so a step's batch never changes."""
    sizes = [job.strategy.data_parallel_size(n) for n in world_sizes(job.scaling)]
    accum, batch = job.optim.grad_accum_steps, job.data.batch_size
    uneven = [n for n in sizes if split_batch(batch, n, accum) is None]
    if not uneven:
        return
    if not job.scaling.elastic:
        ranks = (
            "scaling.num_workers / strategy.tp_size"
            if job.strategy.data_parallel_size(job.scaling.max_workers) < job.scaling.max_workers
            else "scaling.num_workers"
        )
        raise ConfigError(
            "data.batch_size",
            batch,
            f"the global batch must be divisible by {ranks} x "
            f"optim.grad_accum_steps = {uneven[0]} x {accum} = {uneven[0] * accum}",
        )
    fits = math.lcm(*(n * accum for n in sizes))
    raise ConfigError(
        "data.batch_size",
        batch,
        f"an elastic run keeps its global batch at every world size in scaling.num_workers "
        f"{job.scaling.worker_bounds}, but {batch} does not split over "
        f"{', '.join(map(str, uneven))} worker(s) x {accum} accumulation step(s); use a "
        f"multiple of {fits}, or narrow the range",
    )


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


def workers_per_node(job: Job) -> int | None:
    """Workers on each node, where the config decides it (``local``: all of them; torchrun:
    its layout); None under Ray, whose placement decides."""
    if job.scaling.launcher == "local":
        return job.scaling.max_workers
    if job.scaling.launcher == "torchrun":
        return torchrun_layout(job.scaling)[1]
    return None


def _check_relaxed_collectives(job: Job) -> None:
    """Relaxed collectives are Ray Train's, and need every rank to hold the whole model."""
    if not job.scaling.relax_collectives_on_preemption:
        return
    from convoy.strategies import strategy_class

    field = "scaling.relax_collectives_on_preemption"
    if job.scaling.launcher != "ray":
        raise ConfigError(field, True, "an option of scaling.launcher 'ray' (Ray Train's)")
    sharding = strategy_class(job.strategy.name).sharding
    if sharding.parameters or sharding.optimizer_state:
        raise ConfigError(
            field,
            True,
            f"needs every rank to hold the whole model and optimizer (ddp), so one rank can "
            f"save them alone; strategy '{job.strategy.name}' shards them",
        )
    if not job.run.stop_on_signal:
        raise ConfigError(field, True, "acts on preemption notices: needs run.stop_on_signal: true")


def check_job(job: Job) -> None:
    """Checks that need more than one section. Raises ``ConfigError``."""
    workers = job.scaling.max_workers
    shown = job.scaling.worker_bounds if job.scaling.elastic else workers
    check_batch_split(job)
    if job.scaling.launcher == "torchrun":
        torchrun_layout(job.scaling)
    if job.precision == "fp16" and not job.scaling.use_gpu:
        raise ConfigError(
            "precision",
            "fp16",
            "fp16 with a grad scaler needs a GPU (scaling.use_gpu: true); on CPU use 'bf16' or 'fp32'",
        )
    check_strategy_workers(job.strategy, workers, shown)
    job.strategy.check_layout(world_sizes(job.scaling), workers_per_node(job))
    if job.fault.kind != "none" and job.fault.rank >= workers:
        raise ConfigError("fault.rank", job.fault.rank, f"ranks are 0..{workers - 1}")
    _check_relaxed_collectives(job)
    if job.fault.kind == "preempt" and not job.run.stop_on_signal:
        raise ConfigError(
            "fault.kind",
            "preempt",
            "a stop notice needs run.stop_on_signal: true (with false, notices are ignored)",
        )
    if (
        job.scaling.launcher == "ray"
        and job.checkpoint.keep_best
        and job.checkpoint.keep_latest > 1
    ):
        # Under Ray, Ray Train's checkpoint manager owns retention: the best K by a score,
        # plus the latest one. Convoy's "latest K and best K" cannot be expressed there.
        raise ConfigError(
            "checkpoint.keep_latest",
            job.checkpoint.keep_latest,
            f"with checkpoint.keep_best {job.checkpoint.keep_best} under scaling.launcher 'ray', "
            "Ray Train keeps the best K plus only the latest checkpoint; set keep_latest: 1 "
            "(or keep_best: 0)",
        )
    if job.data.loader == "ray_data" and job.scaling.elastic:
        raise ConfigError(
            "scaling.num_workers",
            job.scaling.worker_bounds,
            "data.loader ray_data cuts the eval splits per rank when the run starts, so it "
            "needs a fixed worker count; use data.loader: torch for an elastic run",
        )
    if job.data.loader == "ray_data" and job.strategy.data_parallel_size(workers) < workers:
        raise ConfigError(
            "data.loader",
            "ray_data",
            f"Ray Data streams each worker its own share of a batch, while the ranks of a "
            f"tensor-parallel group (strategy.tp_size {tp_size_of(job.strategy)}) "
            "must read the same one; use data.loader: torch with tensor parallelism",
        )
    if job.data.loader == "ray_data" and job.scaling.launcher != "ray":
        raise ConfigError(
            "data.loader",
            "ray_data",
            f"Ray Data streams into Ray Train workers, so it needs scaling.launcher: ray "
            f"(got {job.scaling.launcher!r}); use data.loader: torch with that launcher",
        )
    if job.scaling.launcher == "local" and workers > 1:
        raise ConfigError(
            "scaling.num_workers",
            shown,
            "the 'local' launcher runs one in-process worker; use 'torchrun' or 'ray' for more",
        )


# ---------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides -> Job, with errors that name the field.


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into a key path and a YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("-o", text, "overrides look like key.path=value, e.g. optim.lr=3e-4")
    raw = raw.strip()
    if ":" in raw and not raw.startswith(("{", "[")):
        return key.strip().split("."), raw  # YAML 1.1 would read 1:2 as the base-60 number 62
    value = yaml.safe_load(raw) if raw else ""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with every ``key.path=value`` override applied."""
    result = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        _set_in_place(result, path, value)
    return result


def set_field(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of the recipe dict ``data`` with the dotted field ``key`` set to ``value``."""
    result = _deep_copy(data)
    _set_in_place(result, key.split("."), value)
    return result


def _set_in_place(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(path[: i + 1]), child, "it is a value, not a section")
        node = child
    node[path[-1]] = value


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def job_from_dict(data: dict[str, Any]) -> Job:
    """Validate a plain dict into a ``Job``; pydantic errors become one ``ConfigError``."""
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise _to_config_error(exc, data) from None


def job_from_saved(data: dict[str, Any], overrides: list[str] | None = None) -> Job:
    """A job Convoy wrote itself (a checkpoint's ``meta.json``, an export's ``model.json``, a
    run's ``config.yaml``), validated, with ``overrides`` applied after.

    Every reader of a saved job goes through here, not ``job_from_dict``. Jobs saved before
    the optimizer fields followed ``TORCH_DEFAULTS`` hold ``weight_decay``, ``momentum`` and
    ``betas`` whatever ``optim.name`` is: ``momentum: 0.9`` under adamw, ``betas`` under sgd.
    The optimizer never read the field it does not have, so it is dropped here, and the run
    loads as it trained (its ``weight_decay`` was always written out). A recipe or an
    override that sets such a field is still refused (``OptimConfig``).
    """
    saved = _deep_copy(data)
    optim = saved.get("optim")
    if isinstance(optim, dict):
        own = TORCH_DEFAULTS.get(optim.get("name", OptimConfig.model_fields["name"].default))
        if own is not None:  # an unknown name is left for validation to name
            for key in {k for fields in TORCH_DEFAULTS.values() for k in fields} - own.keys():
                optim.pop(key, None)
    return job_from_dict(apply_overrides(saved, overrides or []))


class RecipeLoader(yaml.SafeLoader):
    """YAML without YAML 1.1's base-60 numbers: ``1:4`` is the text "1:4" (an elastic range),
    not the number 64."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if rx.pattern.find(":[0-5]?[0-9]") < 0]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern in (
    (
        "tag:yaml.org,2002:int",
        r"[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+",
    ),
    (
        "tag:yaml.org,2002:float",
        r"[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
    ),
):
    RecipeLoader.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), list("-+0123456789."))


def read_yaml(text: str) -> Any:
    """Parse recipe or config YAML (``RecipeLoader``)."""
    return yaml.load(text, Loader=RecipeLoader)


def load_job(path: str | Path | None = None, overrides: list[str] | None = None) -> Job:
    """Load a YAML recipe (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        recipe = Path(path)
        if not recipe.is_file():
            raise ConfigError("recipe", str(path), "expected a YAML file that exists")
        try:
            loaded = read_yaml(recipe.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError("recipe", str(path), f"not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("recipe", str(path), "the top level must be a mapping of sections")
        data = loaded or {}
    return job_from_dict(apply_overrides(data, overrides or []))


def job_to_yaml(job: Job) -> str:
    """The resolved config as YAML (what ``convoy config show`` prints and runs save)."""
    return yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)


def _to_config_error(exc: ValidationError, data: dict[str, Any]) -> ConfigError:
    """Turn pydantic's first error into one readable paragraph."""
    err = exc.errors(include_url=False)[0]
    raw_loc = [str(p) for p in err["loc"]]
    # pydantic puts the strategy's discriminator tag into the path: strategy.ddp.comm_hook.
    loc = [
        p
        for i, p in enumerate(raw_loc)
        if not (i and raw_loc[i - 1] == "strategy" and p in STRATEGY_NAMES)
    ]
    field = ".".join(loc) or "config"
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        parent_model = _section_model(loc[:-1], data)
        known = sorted(parent_model.model_fields) if parent_model else []
        guess = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        if loc[:1] == ["strategy"] and len(loc) == 2:
            owners = [name for name, m in STRATEGY_MODELS.items() if loc[1] in m.model_fields]
            if owners:  # another strategy's option, e.g. fsdp2's tp_size under ddp
                hint = f" for this strategy (an option of {' and '.join(map(repr, owners))})"
        return ConfigError(field, value, f"unknown key{hint}; {one_of(known)}")
    if kind == "union_tag_invalid":
        return ConfigError(field + ".name", err["ctx"]["tag"], one_of(STRATEGY_NAMES))
    if kind == "missing":
        return ConfigError(field, None, "this field is required")
    if kind == "value_error":  # our own validators: the message is the allowed clause
        return ConfigError(field, value, str(err["ctx"]["error"]))
    return ConfigError(field, value, err["msg"][0].lower() + err["msg"][1:])


def _section_model(loc: list[str], data: dict[str, Any]) -> type[BaseModel] | None:
    model: type[BaseModel] = Job
    node: Any = data
    for part in loc:
        node = node.get(part, {}) if isinstance(node, dict) else {}
        if part == "strategy":
            # The named strategy's section; single's (it has no options) for none or unknown.
            name = node.get("name") if isinstance(node, dict) else None
            model = STRATEGY_MODELS.get(str(name), SingleStrategyConfig)
            continue
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model

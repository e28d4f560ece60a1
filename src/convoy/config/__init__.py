"""The job config: one frozen, validated pydantic model built from a YAML recipe plus overrides.

A ``Job`` has the sections ``task``, ``model``, ``data``, ``optim``, ``strategy``,
``precision``, ``scaling``, ``run``, ``checkpoint``, ``fault``, ``tracking``, ``monitor``,
``lightning`` and ``k8s``. Every section forbids unknown keys, so a misspelled key fails at
load time with a suggestion instead of being silently ignored. Checks that span sections
(global batch divisible by workers x accumulation, fp16 needs a GPU) run once the whole job
is known. The schema is pure: checks that import code, read files or build the model and
data live in ``convoy.preflight``, run once in the driver before any worker starts.

The package, by concern (each module imports only those above it in this list):

- ``base``: ``Section``, the base of every section;
- ``training``: ``task``, ``model``, ``data``, ``optim``;
- ``strategy``: a config model per strategy, the one list of strategies, and what the
  schema asks of a strategy (why they live here, below ``convoy.strategies``: its docstring);
- ``run``: ``run``, ``checkpoint``, ``fault``, ``tracking``, ``monitor``, ``lightning``;
- ``scaling``: workers, and a section class per launcher that answers for it;
- ``k8s``: how ``convoy k8s`` runs the job;
- ``job``: ``Job`` and the checks that span sections;
- ``loading``: YAML and overrides in, ``Job`` out, errors that name the field.

Every public name is importable from ``convoy.config``. Nothing here imports
``convoy.strategies`` or ``convoy.launchers``: they sit above and point down at their config
models.
"""

from convoy.config.base import Section
from convoy.config.job import Job, check_batch_split, check_job, micro_batch, split_batch
from convoy.config.k8s import K8sConfig
from convoy.config.loading import (
    RecipeLoader,
    apply_overrides,
    job_from_dict,
    job_from_saved,
    job_to_yaml,
    load_job,
    parse_override,
    read_yaml,
    set_field,
)
from convoy.config.run import (
    CheckpointConfig,
    FaultConfig,
    LightningConfig,
    MlflowConfig,
    MonitorConfig,
    RunConfig,
    TrackingConfig,
)
from convoy.config.scaling import (
    LAUNCHER_MODELS,
    LAUNCHER_NAMES,
    LauncherSection,
    LocalLauncherConfig,
    RayLauncherConfig,
    ScalingConfig,
    TorchrunConfig,
    nodes_range,
    torchrun_layout,
    world_sizes,
)
from convoy.config.strategy import (
    STRATEGY_MODELS,
    STRATEGY_NAMES,
    DataParallelRank,
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    FSDPStrategyConfig,
    HSDPStrategyConfig,
    SingleStrategyConfig,
    StrategyConfig,
    StrategySection,
    check_strategy_workers,
    layout_name,
    tp_size_of,
)
from convoy.config.training import (
    LOADER_NAMES,
    TORCH_DEFAULTS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RayDataConfig,
    TaskConfig,
)

__all__ = [
    "LAUNCHER_MODELS",
    "LAUNCHER_NAMES",
    "LOADER_NAMES",
    "STRATEGY_MODELS",
    "STRATEGY_NAMES",
    "TORCH_DEFAULTS",
    "CheckpointConfig",
    "DDPStrategyConfig",
    "DataConfig",
    "DataParallelRank",
    "FSDP2StrategyConfig",
    "FSDPStrategyConfig",
    "FaultConfig",
    "HSDPStrategyConfig",
    "Job",
    "K8sConfig",
    "LauncherSection",
    "LightningConfig",
    "LocalLauncherConfig",
    "MlflowConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "RayDataConfig",
    "RayLauncherConfig",
    "RecipeLoader",
    "RunConfig",
    "ScalingConfig",
    "Section",
    "SingleStrategyConfig",
    "StrategyConfig",
    "StrategySection",
    "TaskConfig",
    "TorchrunConfig",
    "TrackingConfig",
    "apply_overrides",
    "check_batch_split",
    "check_job",
    "check_strategy_workers",
    "job_from_dict",
    "job_from_saved",
    "job_to_yaml",
    "layout_name",
    "load_job",
    "micro_batch",
    "nodes_range",
    "parse_override",
    "read_yaml",
    "set_field",
    "split_batch",
    "torchrun_layout",
    "tp_size_of",
    "world_sizes",
]

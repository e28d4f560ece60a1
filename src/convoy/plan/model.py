"""The model and one batch, without memory: where the planner and the checker build the
model from (``ModelSource``), fake tensors under ``FakeTensorMode``, the FSDP wrap units and
one rank's shard sizes, and a fake process group for sharding without workers.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import default_collate

from convoy.config import Job, tp_size_of
from convoy.data.base import Splits
from convoy.data.registry import load_splits
from convoy.errors import ConfigError, ConvoyError
from convoy.models.init import builds_on_meta
from convoy.models.lora import apply_lora
from convoy.models.registry import build_model
from convoy.strategies.base import transformer_blocks

# Data sources that read files only for their values: when the files are missing, plan
# with a source of the same shapes (memory does not depend on pixel values).
_STAND_INS = {"cifar10": "synthetic"}


@dataclass
class ModelSource:
    """What the planner and the checker build a model from: the data's shapes, one real
    sample batch, and whether the factory runs on the meta device."""

    shape: dict[str, int]
    sample: tuple[Any, Any]
    on_meta: bool = True
    notes: list[str] = field(default_factory=list)


def load_source(job: Job) -> ModelSource:
    """Load the data once for its shapes and a sample batch (a stand-in of the same shapes
    when a file-backed source's files are missing), and probe a meta-device build."""
    notes: list[str] = []
    data_cfg = job.data
    try:
        splits = load_splits(data_cfg)
    except ConvoyError as exc:
        stand_in = _STAND_INS.get(data_cfg.name)
        if stand_in is None:
            raise
        data_cfg = data_cfg.model_copy(update={"name": stand_in, "path": None})
        splits = load_splits(data_cfg)
        notes.append(
            f"data {job.data.name!r} not found ({exc}); planned with {stand_in!r} data of the same shapes"
        )
    source = ModelSource(dict(splits.shape), first_sample(job, splits), notes=notes)
    try:
        with torch.device("meta"):
            with_adapters(job, build_raw(job, source.shape))
    except ConvoyError:
        raise
    except Exception as exc:
        source.on_meta = False
        message = (
            f"model {job.model.name!r} cannot be built on the meta device "
            f"({type(exc).__name__}: {exc}); building it for real instead"
        )
        warnings.warn(message, stacklevel=2)
        source.notes.append(message)
    return source


def first_sample(job: Job, splits: Splits) -> tuple[Any, Any]:
    """The first training sample, collated as a batch of one (``convoy.preflight`` takes a
    few the same way)."""
    item = splits.train[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(
            "data.name", job.data.name, "training items must be (inputs, targets) pairs"
        )
    inputs, targets = default_collate([item])
    return inputs, targets


def build_raw(job: Job, shape: dict[str, int]) -> nn.Module:
    """The model as its factory builds it, without adapters."""
    return build_model(job.model.name, job.model.kwargs, shape)


def with_adapters(job: Job, model: nn.Module) -> nn.Module:
    """``model`` with the job's LoRA adapters (``model.lora``), the rest frozen, as the
    engine builds it (``convoy.models.lora``); unchanged without ``model.lora``."""
    return model if job.model.lora is None else apply_lora(model, job.model.lora)


def build_skeleton(job: Job, source: ModelSource, tp_share: bool = False) -> nn.Module:
    """The model the job trains (with its adapters, ``model.lora``) on the meta device (or
    for real, when its factory cannot run on meta); ``tp_share``: one tensor-parallel rank's
    share of it (``tensor_parallel_share``), under the job's ``strategy.tp_size``."""
    if not source.on_meta:
        model = with_adapters(job, build_raw(job, source.shape))
    else:
        with torch.device("meta"):
            model = with_adapters(job, build_raw(job, source.shape))
    tp_size = tp_size_of(job.strategy)
    return tensor_parallel_share(model, tp_size) if tp_share and tp_size > 1 else model


def whole_build_reason(model: nn.Module) -> str | None:
    """Why every rank builds ``model`` whole before a sharded strategy splits it, or None
    where it is built on the meta device and each rank fills only its part
    (``convoy.models.init``: the model defines ``init_module``)."""
    if builds_on_meta(model):
        return None
    return f"{type(model).__name__} has no init_module(module)"


def largest_module(model: nn.Module) -> int:
    """Parameters of the module that holds the most of its own (not its children's; a
    shared parameter counted once): the most Convoy's initialization makes at a time."""
    seen: set[int] = set()
    largest = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        largest = max(largest, sum(p.numel() for p in own))
    return largest


def tensor_parallel_share(model: nn.Module, tp_size: int) -> nn.Module:
    """What one rank of a tensor-parallel group holds and computes, as a plain model: each
    linear the model's plan splits column-wise has ``out_features / tp`` (its heads or hidden
    units), each row-wise one ``in_features / tp``; the rest is whole. Its parameters, the
    activations it saves and its optimizer state are a tensor-parallel rank's (the split
    attention sees its own heads). Sequence parallelism is played by hooks with the same
    tensors' sizes: the stream cut to 1 / tp of the tokens, gathered whole (a new tensor) into
    the split layers, their row-wise outputs reduce-scattered (a new tensor) back; in place."""
    # DTensor's modules take 1-2 s to import: only tensor parallelism pays them.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    from convoy.strategies.tensor_parallel import model_plan, planned_modules

    plan = model_plan(model, tp_size)
    for pattern, style in plan.items():
        for path, module in planned_modules(model, pattern).items():
            if isinstance(style, PrepareModuleInput):
                _play_input_layouts(module, style, tp_size)
                continue
            if not isinstance(module, nn.Linear) or type(style) not in (
                ColwiseParallel,
                RowwiseParallel,
            ):
                continue
            columns = type(style) is ColwiseParallel
            narrow = nn.Linear(
                module.in_features if columns else module.in_features // tp_size,
                module.out_features // tp_size if columns else module.out_features,
                bias=module.bias is not None,
                device=module.weight.device,
                dtype=module.weight.dtype,
            )
            if not columns and _is_shard(style.output_layouts[0]):  # reduce-scattered
                narrow.register_forward_hook(lambda _, args, out: _cut(out, tp_size))
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, narrow)
    return model


def _play_input_layouts(module: nn.Module, style: Any, tp_size: int) -> None:
    """A ``PrepareModuleInput`` between the whole and the sequence-cut stream, by sizes."""
    source, target = style.input_layouts[0], style.desired_input_layouts[0]
    if _is_shard(target) and not _is_shard(source):
        module.register_forward_pre_hook(lambda _, args: (_cut(args[0], tp_size), *args[1:]))
    elif _is_shard(source) and not _is_shard(target):
        module.register_forward_pre_hook(
            lambda _, args: (torch.cat([args[0]] * tp_size, dim=1), *args[1:])
        )


def _is_shard(placement: Any) -> bool:
    from torch.distributed.tensor import Shard  # DTensor: 1-2 s to import

    return isinstance(placement, Shard) and placement.dim == 1


def _cut(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    """One rank's 1 / tp of the tokens (dim 1), as a tensor of its own."""
    return tensor[:, : tensor.shape[1] // tp_size].contiguous()


def to_fake(model: nn.Module, device: torch.device) -> nn.Module:
    """Give every parameter and buffer a fresh tensor of the same shape and dtype, created
    under the active ``FakeTensorMode`` (call inside one): no memory, any size. Tied
    parameters stay tied. Parameters are replaced, not swapped: ``Module.to`` cannot swap
    fake tensors (the fake mode holds weak references to them)."""
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in fresh:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = fresh[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    # Strategies move the model with Module.to(device); the fake tensors already live there.
    model.to = lambda *args, **kwargs: model  # type: ignore[method-assign]
    return model


def fake_batch(sample: tuple[Any, Any], rows: int, mode: Any) -> tuple[Any, Any]:
    """A batch of ``rows`` samples shaped like ``sample`` (tensors or nests of them), as
    fake tensors of ``mode``."""

    def grow(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            real = value[:1].expand(rows, *value.shape[1:]).contiguous()
            return mode.from_tensor(real)
        if isinstance(value, dict):
            return {key: grow(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(grow(item) for item in value)
        return value

    inputs, targets = sample
    return grow(inputs), grow(targets)


# Parts of the model: wrap units and shard sizes.


def wrap_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """Parameters grouped as the FSDP strategies wrap them: one group per block found by
    ``convoy.strategies.base.transformer_blocks`` (the rule the strategies use), then the
    root's remaining parameters. Shared parameters count once."""
    blocks, root = blocks_and_root(model)
    return [unit for unit in [*blocks, root] if unit]


def blocks_and_root(model: nn.Module) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """``wrap_units`` apart: the blocks' parameter groups in model order (the order they run
    in forward), and the root's remaining parameters (possibly none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strategy says it when it wraps; the plan notes it
        blocks = transformer_blocks(model)
    seen: set[int] = set()
    units: list[list[nn.Parameter]] = []
    for module in [*blocks, model]:
        unit = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in unit)
        units.append(unit)
    return [unit for unit in units[:-1] if unit], units[-1]


def shard_numel(param: torch.Tensor, world_size: int) -> int:
    """Elements rank 0 holds of ``param`` split on dim 0 in ``world_size`` chunks (as
    ``fully_shard``: the rounded-up chunk; FSDP1's padded flat shard is within a row)."""
    if param.dim() == 0:
        return 1
    rows = math.ceil(param.shape[0] / world_size)
    return rows * (param.numel() // max(1, param.shape[0]))


def local_shapes(params: Sequence[torch.Tensor], shards: int) -> list[tuple[int, ...]]:
    """The shapes of this rank's copies of ``params``, each split on dim 0 in ``shards``
    chunks (rank 0's rounded-up one); whole for 1."""
    if shards == 1:
        return [tuple(p.shape) for p in params]
    return [(math.ceil(p.shape[0] / shards), *p.shape[1:]) if p.dim() else () for p in params]


@contextlib.contextmanager
def fake_process_group(world_size: int, needed: bool = True) -> Iterator[None]:
    """A ``fake`` process group of ``world_size`` ranks with this process as rank 0
    (collectives return at once and move nothing), destroyed afterwards."""
    if not needed:
        yield
        return
    if dist.is_initialized():
        raise ConfigError(
            "process group",
            "initialized",
            "planning needs a process without one; run it in the driver",
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_dtensor_plans()


def _forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribution plans. They key on meshes by value
    and keep the mesh they were made on: a later group's mesh of the same shape and names
    (one layout's ``shard x tp`` is another's whole mesh) would run its collectives on the
    destroyed group's names."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    # Imported only once DTensor is loaded: nothing to forget before (its private module).
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch's own copy

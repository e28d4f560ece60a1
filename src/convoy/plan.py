"""``convoy plan``: how much memory one rank needs, per strategy and world size.

The planner composes a rank's peak from parts it derives from the recipe's own model, data,
optimizer and strategy, without Ray, workers or a GPU:

- **model state**: parameters (fp32 master weights), gradients and optimizer state, whole on
  ``single`` / ``ddp``, divided by the world size on ``fsdp`` / ``fsdp2`` (each parameter's
  dim 0 split in N, as ``fully_shard`` does, so rank 0 holds the rounded-up chunk);
- **activations** of one micro-batch (``data.batch_size / (N x optim.grad_accum_steps)``):
  the storages autograd saves during one forward and loss of the real model, measured by a
  forward under ``FakeTensorMode`` (no memory, any size) in the precision the strategy runs
  (autocast for single/ddp, bf16 parameters for FSDP with ``precision: bf16``), plus the
  output the loop keeps for its metrics;
- **backward transient**: the most bytes backward holds beyond the saved activations
  (gradients of activations, e.g. of the logits and the log-softmax; one parameter's gradient
  as it is produced), measured by running that micro-batch's backward on fake tensors while
  following which storages are live: autograd frees saved activations as it passes their
  nodes, so this is not a fixed multiple of the largest one;
- **communication buffers**: DDP's gradient buckets (1x gradients: Convoy's DDP keeps
  ``gradient_as_bucket_view`` off), FSDP's working set: FSDP2's as ``fully_shard`` runs
  it (``Planner._fsdp2_held``: the root and each block unsharded in turn, all-gather outputs,
  the one unit gathered ahead in backward where there is one, the unit's gradients before
  the reduce-scatter; separate unsharded storages even on one rank), FSDP1's the largest
  wrap unit unsharded plus the next one all-gathered ahead (``NO_SHARD`` on one rank);
- **optimizer-step transient**: what one step of the recipe's optimizer allocates on top of
  its state (AdamW's foreach path: ``exp_avg_sq.sqrt()`` for a parameter group and the
  per-tensor temporaries), measured by one step on fake tensors of this rank's shapes.

The peak is the largest of a few moments: the start of backward (activations and the
backward transient), under FSDP2 the model's forward (its most bytes live at once, with the
batch) and backward within the model (the transient from the outputs' gradient on), each
with what FSDP2 holds then, and backward through a unit (FSDP1: the largest, with the next
one all-gathered and its fp32 gradients), and the optimizer step (gradients, state and its
transient). ``convoy.plan_check``
runs the real step under torch's memory trackers and compares.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from convoy.config import (
    DDPStrategyConfig,
    FSDP2StrategyConfig,
    FSDPStrategyConfig,
    Job,
    SingleStrategyConfig,
)
from convoy.errors import ConfigError, ConvoyError, one_of

STRATEGY_ORDER = ("single", "ddp", "fsdp2", "fsdp")
"""Preference among layouts with the same number of workers: the simplest first, FSDP2
(Convoy's default sharded strategy) before FSDP1."""

DEFAULT_WORLD_SIZES = (1, 2, 4, 8)
SHARDED = ("fsdp", "fsdp2")

_STRATEGY_CONFIGS: dict[str, type[Any]] = {
    "single": SingleStrategyConfig,
    "ddp": DDPStrategyConfig,
    "fsdp": FSDPStrategyConfig,
    "fsdp2": FSDP2StrategyConfig,
}

# Data sources that read files only for their values: when the files are missing, plan
# with a source of the same shapes (memory does not depend on pixel values).
_STAND_INS = {"cifar10": "synthetic"}

# ---------------------------------------------------------------------------------------------
# Sizes: parsing and printing.

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
MEMORY_FORMS = "a size such as 80GiB, 80GB, 24G, 81920MiB or plain bytes"


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes in ``text``: ``80GiB`` (binary), ``80GB`` / ``80G`` (decimal, as GPU vendors
    print them), ``81920MiB``, or a plain byte count. Raises ``ConfigError`` naming ``flag``."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(flag, text, f"allowed: {MEMORY_FORMS}")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(flag, text, f"must be more than 0 bytes; allowed: {MEMORY_FORMS}")
    return int(value)


def format_bytes(value: float) -> str:
    """``1536`` -> ``1.5 KiB``; binary units, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return (
                f"{value / size:.3g} {unit}"
                if value / size < 1000
                else f"{value / size:.0f} {unit}"
            )
    return f"{value:.0f} B"


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``; each a positive integer."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size <= 0 for size in sizes):
        raise ConfigError("--world-sizes", text, "allowed: positive integers, e.g. 1,2,4,8")
    return sorted(set(sizes))


def parse_strategies(text: str) -> list[str]:
    """``"single,fsdp2"`` -> ``["single", "fsdp2"]``; each a Convoy strategy name."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in _STRATEGY_CONFIGS]
    if not names or unknown:
        shown = unknown[0] if unknown else text
        raise ConfigError("--strategies", shown, one_of(_STRATEGY_CONFIGS))
    return [name for name in STRATEGY_ORDER if name in names]


# ---------------------------------------------------------------------------------------------
# The job a layout runs: the recipe with another strategy and world size.


def layout_job(job: Job, strategy: str, world_size: int) -> Job:
    """``job`` run with ``strategy`` on ``world_size`` ranks. The recipe's own strategy
    settings are kept when it names the same strategy; others get their defaults."""
    cfg = job.strategy if job.strategy.name == strategy else _STRATEGY_CONFIGS[strategy]()
    scaling = job.scaling.model_copy(update={"num_workers": world_size})
    # model_copy skips the cross-section checks that tie a strategy to a launcher: a plan
    # asks about layouts, not about how this recipe would launch them.
    return job.model_copy(update={"strategy": cfg, "scaling": scaling})


def micro_batch(job: Job, world_size: int) -> int:
    """Samples per rank per forward: the global batch over ranks and accumulation steps."""
    parts = world_size * job.optim.grad_accum_steps
    if job.data.batch_size % parts:
        raise ConfigError(
            "data.batch_size",
            job.data.batch_size,
            f"must divide by world size x optim.grad_accum_steps = {world_size} x "
            f"{job.optim.grad_accum_steps}; pick world sizes that divide it",
        )
    return job.data.batch_size // parts


def compute_dtype(job: Job) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job.precision]


# ---------------------------------------------------------------------------------------------
# The model and one batch, without memory.


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
    from convoy.data.registry import load_splits
    from convoy.preflight import sample_batch

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
    source = ModelSource(dict(splits.shape), sample_batch(job, splits, rows=1), notes=notes)
    try:
        with torch.device("meta"):
            build_raw(job, source.shape)
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


def build_raw(job: Job, shape: dict[str, int]) -> nn.Module:
    from convoy.models.registry import build_model

    return build_model(job.model.name, job.model.kwargs, shape)


def build_skeleton(job: Job, source: ModelSource) -> nn.Module:
    """The model on the meta device (or for real, when its factory cannot run on meta)."""
    if not source.on_meta:
        return build_raw(job, source.shape)
    with torch.device("meta"):
        return build_raw(job, source.shape)


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


# ---------------------------------------------------------------------------------------------
# Parts of the model: parameters, wrap units, activations, optimizer.


def wrap_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """Parameters grouped as the FSDP strategies wrap them: one group per block found by
    ``convoy.strategies.base.transformer_blocks`` (the rule the strategies use), then the
    root's remaining parameters. Shared parameters count once."""
    blocks, root = blocks_and_root(model)
    return [unit for unit in [*blocks, root] if unit]


def blocks_and_root(model: nn.Module) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """``wrap_units`` apart: the blocks' parameter groups in model order (the order they run
    in forward), and the root's remaining parameters (possibly none)."""
    from convoy.strategies.base import transformer_blocks

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


def local_shapes(
    params: Sequence[torch.Tensor], strategy: str, world_size: int
) -> list[tuple[int, ...]]:
    """The shapes of this rank's copies of ``params`` under ``strategy``."""
    if strategy not in SHARDED or world_size == 1:
        return [tuple(p.shape) for p in params]
    return [(math.ceil(p.shape[0] / world_size), *p.shape[1:]) if p.dim() else () for p in params]


@dataclass(frozen=True)
class Activations:
    """What one micro-batch's forward leaves for backward, and what backward adds to it."""

    saved: int
    """Bytes of the distinct storages autograd saved (parameters excluded), plus the output."""
    largest: int
    """The largest one of them."""
    backward: int = 0
    """The backward transient: the most bytes live during backward beyond those live when it
    starts (gradients of activations, and one parameter's gradient as it is produced; the
    parameters' accumulated gradients are counted as gradients, not here), measured by
    running backward; saved activations freed as backward passes their nodes make room."""
    backward_in_model: int = 0
    """The part of ``backward`` from the moment the model's outputs have their gradient (the
    loss's own backward done): what FSDP's backward working set meets. Before it FSDP holds
    nothing unsharded (every unit, the root too, resharded after forward)."""
    forward: int = 0
    """The most bytes live at once during the model's forward (what it has saved so far and
    the ops in flight), plus the batch: what FSDP's forward working set meets."""


class _LiveBytes(TorchDispatchMode):
    """Follows the storages ops allocate (each counted once, until it is freed) and the
    most bytes live at once. ``forget`` stops counting a storage (a parameter's gradient)."""

    def __init__(self, skip: set[Any]) -> None:
        super().__init__()
        self.skip = skip
        self.live = 0
        self.peak = 0
        self._sizes: dict[Any, int] = {}
        self._refs: dict[Any, weakref.ref[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = StorageWeakRef(storage)
            if key in self.skip or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
            self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key: Any, _ref: Any = None) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def forget(self, tensor: torch.Tensor | None) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        if tensor is not None:
            self._freed(StorageWeakRef(tensor.untyped_storage()))


def measure_activations(
    job: Job, source: ModelSource, rows: int, cast_params: torch.dtype | None
) -> Activations:
    """Run the model and the task's loss on a fake micro-batch of ``rows`` samples and sum
    the storages autograd saves; then run backward and measure its transient (see
    ``Activations.backward``). ``cast_params``: the dtype FSDP computes in (its parameters
    are cast), or ``None`` for autocast (single/ddp) in the job's precision."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from convoy.tasks import build_task

    task = build_task(job.task.name, job.task.kwargs)
    mode = FakeTensorMode()
    inputs, targets = fake_batch(source.sample, rows, mode)
    batch = _storage_bytes([*_tensors(inputs), *_tensors(targets)])
    if cast_params is not None:  # FSDP casts floating-point inputs to its param dtype
        cast = _cast_floats(inputs, cast_params)
        batch += _storage_bytes([t for t in _tensors(cast) if t.is_floating_point()])
        inputs = cast
    skeleton = build_skeleton(job, source)  # outside the fake mode: a real build may need values
    if cast_params is not None:  # FSDP's MixedPrecision: parameters cast, no autocast
        skeleton = skeleton.to(cast_params)
    with mode:
        model = to_fake(skeleton, torch.device("cpu"))
        params = [p for p in model.parameters() if p.requires_grad]
        owned = {
            StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]
        }
        saved: dict[StorageWeakRef, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in owned:
                saved[ref] = tensor.untyped_storage().nbytes()
            return tensor

        dtype = compute_dtype(job)
        autocast = cast_params is None and dtype != torch.float32
        tracker = _LiveBytes(owned)
        with tracker:
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
                torch.autocast("cpu", dtype=dtype, enabled=autocast),
            ):
                outputs = task.forward(model, inputs)
                forward = tracker.peak + batch
                loss = task.loss_sum(outputs, targets)
            for out in _tensors(outputs):
                saved[StorageWeakRef(out.untyped_storage())] = out.untyped_storage().nbytes()
            backward = in_model = 0
            if loss.requires_grad:
                # Parameters' gradients are the plan's `grads`: each is counted as it is
                # produced (it is live then, with the activations), then left out.
                hooks = [
                    p.register_post_accumulate_grad_hook(lambda p: tracker.forget(p.grad))
                    for p in params
                ]
                start = tracker.peak = tracker.live
                marks: list[int] = []

                def reached_model(grad: torch.Tensor) -> None:
                    if not marks:  # the loss's backward is done: its peak, then the model's
                        marks.append(tracker.peak)
                        tracker.peak = tracker.live

                hooks += [
                    out.register_hook(reached_model)
                    for out in _tensors(outputs)
                    if out.requires_grad
                ]
                loss.backward()
                backward = max(tracker.peak, *marks) - start
                in_model = tracker.peak - start if marks else backward
                for hook in hooks:
                    hook.remove()
    return Activations(
        sum(saved.values()), max(saved.values(), default=0), backward, in_model, forward
    )


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    from torch.multiprocessing.reductions import StorageWeakRef

    sizes = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _cast_floats(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(item, dtype) for item in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


@dataclass(frozen=True)
class OptimizerCost:
    state: int
    """Bytes of optimizer state after the first step."""
    transient: int
    """Bytes a step allocates on top of that state, at its peak."""


def measure_optimizer(
    job: Job, shapes: Sequence[tuple[int, ...]], fsdp2_world_size: int | None = None
) -> OptimizerCost:
    """One step of the recipe's optimizer on fake parameters of ``shapes`` (with gradients),
    grouped as ``convoy.engine.schedule.build_optimizer`` groups them (decay: 2-D and up).
    ``fsdp2_world_size``: ``shapes`` are whole parameters that ``fully_shard`` splits over
    that many ranks of a fake process group; the step then runs on DTensor shards, whose
    foreach path allocates more than plain tensors'."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    mode = FakeTensorMode()
    with fake_process_group(fsdp2_world_size or 1, needed=fsdp2_world_size is not None):
        with mode:
            holder = nn.ParameterList(nn.Parameter(torch.empty(shape)) for shape in shapes)
        if fsdp2_world_size is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(holder)  # outside the fake mode: it builds its device mesh
        with mode:
            params = list(holder.parameters())
            groups = [
                {"params": [p for p in params if p.dim() >= 2]},
                {"params": [p for p in params if p.dim() < 2]},
            ]
            optimizer = _optimizer(job, [group for group in groups if group["params"]])
            _warm_up(optimizer, params)
            tracker = MemTracker()
            tracker.track_external(*params, optimizer)
            with tracker:
                for _ in range(2):  # the first step creates the state, the second is steady
                    for param in params:
                        param.grad = torch.empty_like(param)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
            peak = _category(tracker.get_tracker_snapshot("peak"), "Optstate")
            state = sum(
                _local(t).untyped_storage().nbytes()
                for per_param in optimizer.state.values()
                for t in per_param.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0  # step counters: 4 bytes each
            )
    return OptimizerCost(state=state, transient=max(0, peak - state))


def _warm_up(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """One untracked step: DTensor's first foreach ops fill its sharding caches, which a
    tracker would count as optimizer memory once."""
    for param in params:
        param.grad = torch.empty_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def fake_process_group(world_size: int, needed: bool = True) -> Iterator[None]:
    """A ``fake`` process group of ``world_size`` ranks with this process as rank 0
    (collectives return at once and move nothing), destroyed afterwards."""
    import torch.distributed as dist

    if not needed:
        yield
        return
    if dist.is_initialized():
        raise ConfigError(
            "process group",
            "initialized",
            "planning needs a process without one; run it in the driver",
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _optimizer(job: Job, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    cfg = job.optim
    for group in groups:
        group["weight_decay"] = cfg.weight_decay
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def _category(snapshot: dict[Any, dict[Any, int]], name: str) -> int:
    """One category's bytes from a tracker snapshot, summed over devices."""
    return sum(
        value
        for per_device in snapshot.values()
        for key, value in per_device.items()
        if str(getattr(key, "value", key)) == name
    )


# ---------------------------------------------------------------------------------------------
# A layout's plan.

CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "comm")
"""Rows of a plan. ``temp``: backward or optimizer-step transients; ``comm``: DDP buckets
or the FSDP unsharded working set."""


def gathers(strategy: str, world_size: int) -> bool:
    """Whether ``strategy`` all-gathers parameters into unsharded copies: FSDP2 at any world
    size (its sharded and unsharded parameters are separate storages even on one rank);
    FSDP1 only on more than one (it switches to ``NO_SHARD`` on one)."""
    return strategy == "fsdp2" or (strategy == "fsdp" and world_size > 1)


@dataclass(frozen=True)
class Layout:
    """One strategy on one world size: per-rank bytes at each moment, and the peak."""

    strategy: str
    world_size: int
    micro_batch: int
    params: int
    grads: int
    optimizer: int
    activations: int
    backward_temp: int
    step_temp: int
    comm: int
    moments: dict[str, dict[str, int]]
    """Each candidate moment's bytes per category (``CATEGORIES``)."""

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=lambda name: sum(self.moments[name].values()))

    @property
    def peak(self) -> int:
        return sum(self.moments[self.peak_moment].values())

    def at_peak(self) -> dict[str, int]:
        return dict(self.moments[self.peak_moment])


class Planner:
    """Plans layouts of one job; measurements are cached across strategies and sizes."""

    def __init__(self, job: Job, source: ModelSource | None = None) -> None:
        self.job = job
        self.source = source or load_source(job)
        self.model = build_skeleton(job, self.source)
        self.blocks, self.root = blocks_and_root(self.model)
        self.units = [unit for unit in [*self.blocks, self.root] if unit]
        self.params = [p for unit in self.units for p in unit]
        self._activations: dict[tuple[int, Any], Activations] = {}
        self._optimizer: dict[tuple[str, int], OptimizerCost] = {}

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def activations(self, strategy: str, rows: int) -> Activations:
        dtype = compute_dtype(self.job)
        cast = dtype if strategy in SHARDED and dtype != torch.float32 else None
        key = (rows, cast)
        if key not in self._activations:
            self._activations[key] = measure_activations(self.job, self.source, rows, cast)
        return self._activations[key]

    def optimizer(self, strategy: str, world_size: int) -> OptimizerCost:
        # FSDP2's optimizer steps DTensor shards (at any world size); FSDP1's (with
        # use_orig_params) plain views of its flat shard, as plain tensors of shard shapes.
        kind = strategy if strategy in SHARDED else "whole"
        size = world_size if strategy in SHARDED else 1
        if (kind, size) not in self._optimizer:
            if kind == "fsdp2":
                shapes = [tuple(p.shape) for p in self.params]
                cost = measure_optimizer(self.job, shapes, fsdp2_world_size=size)
            else:
                cost = measure_optimizer(self.job, local_shapes(self.params, strategy, size))
            self._optimizer[(kind, size)] = cost
        return self._optimizer[(kind, size)]

    def layout(self, strategy: str, world_size: int) -> Layout:
        """The plan of ``strategy`` on ``world_size`` ranks."""
        job = layout_job(self.job, strategy, world_size)
        rows = micro_batch(job, world_size)
        sharded = strategy in SHARDED and world_size > 1
        local = self.param_count
        if sharded and strategy == "fsdp":  # one flat parameter per unit, split evenly
            local = sum(math.ceil(sum(p.numel() for p in u) / world_size) for u in self.units)
        elif sharded:
            local = sum(shard_numel(p, world_size) for p in self.params)
        params = grads = 4 * local  # fp32 master weights and gradients
        opt = self.optimizer(strategy, world_size)
        acts = self.activations(strategy, rows)
        backward_temp = acts.backward
        comm = self._comm(job, strategy, world_size)
        # Accumulation: later micro-steps run with the gradients of earlier ones; no_sync
        # keeps them unsharded under FSDP.
        accum_grads = 0
        if job.optim.grad_accum_steps > 1:
            accum_grads = 4 * self.param_count if strategy in SHARDED else grads
        static = {"params": params, "optimizer": opt.state}
        ddp_buckets = comm if strategy == "ddp" else 0
        moments = {
            "backward": {
                **static,
                "grads": accum_grads,
                "activations": acts.saved,
                "temp": backward_temp,
                "comm": ddp_buckets,
            },
            "optimizer step": {
                **static,
                "grads": grads,
                "activations": 0,
                "temp": opt.transient,
                "comm": ddp_buckets,
            },
        }
        if strategy == "fsdp2":
            # "backward" is the loss's own backward: every unit is resharded then.
            held = self._fsdp2_held(job, world_size)
            parts = {
                "forward (unit)": (acts.forward, 0),
                "backward (in model)": (acts.saved, acts.backward_in_model),
                "backward (unit)": (acts.saved, 0),
            }
            for name, (live, temp) in parts.items():
                moments[name] = {
                    **static,
                    "grads": accum_grads,
                    "activations": live,
                    "temp": temp,
                    "comm": held[name],
                }
            comm = max(held.values())
        elif gathers(strategy, world_size):
            # Backward through the largest unit: it is unsharded, the next one is being
            # all-gathered, and its full gradients wait for the reduce-scatter (fp32).
            moments["backward (unit)"] = {
                **static,
                "grads": accum_grads,
                "activations": acts.saved,
                "temp": 4 * self.largest_unit,
                "comm": comm,
            }
        moments = {
            name: {c: parts.get(c, 0) for c in CATEGORIES} for name, parts in moments.items()
        }
        return Layout(
            strategy=strategy,
            world_size=world_size,
            micro_batch=rows,
            params=params,
            grads=grads,
            optimizer=opt.state,
            activations=acts.saved,
            backward_temp=backward_temp,
            step_temp=opt.transient,
            comm=comm,
            moments=moments,
        )

    def _comm(self, job: Job, strategy: str, world_size: int) -> int:
        """DDP's buckets hold a copy of every gradient (fp32; Convoy's DDP keeps
        ``gradient_as_bucket_view`` off). FSDP holds the largest unit unsharded and
        all-gathers the next one ahead, in the dtype it computes in."""
        if strategy == "ddp":
            return 4 * self.param_count
        if not gathers(strategy, world_size):
            return 0
        dtype = compute_dtype(job)
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return 2 * itemsize * self.largest_unit

    def _fsdp2_held(self, job: Job, world_size: int) -> dict[str, int]:
        """What ``fully_shard`` holds beyond model state at each moment, rank 0's bytes.

        Convoy passes ``reshard_after_forward`` explicitly, so the root reshards after
        forward like the blocks. Each unit's unsharded parameters are separate storages of
        its dim-0-padded size in the param dtype; on more than one rank the all-gather
        output (the same size) comes first and the copy-out fills them from it. Forward
        keeps a unit's all-gather output until the next unit's copy-out (the root's until
        the end of forward); backward frees it right after the copy-out and all-gathers the
        unit that ran before it in forward ahead (the first block has none). A unit's
        gradients (its parameters' shapes, param dtype) live until its post-backward copies
        them into the reduce-scatter input (padded, reduce dtype), after it is resharded;
        the root's live until the end of backward.

        - ``forward (unit)``: the root unsharded, plus the largest of a unit's all-gather
          output with its copy (or with the next unit's all-gather output);
        - ``backward (in model)``, with the part of the backward transient from the model's
          outputs on (the loss's own backward meets nothing unsharded): the root unsharded
          with its gradients, the unit in backward unsharded and the one before it
          all-gathered;
        - ``backward (unit)``: the same without the transient, at a unit's copy-out, its
          gradients' production or its reduce-scatter.
        """
        param_dtype = compute_dtype(job)
        cfg = job.strategy
        reduce_name = cfg.reduce_dtype if isinstance(cfg, FSDP2StrategyConfig) else "fp32"
        param_size = torch.empty((), dtype=param_dtype, device="meta").element_size()
        reduce_size = 4 if reduce_name == "fp32" else 2
        # With accumulation in fp32 the micro-step's gradients add into the accumulated
        # unsharded ones (counted as grads); otherwise they are new tensors.
        new_grads = param_dtype != torch.float32 or job.optim.grad_accum_steps == 1

        def padded(unit: Sequence[nn.Parameter]) -> int:
            return world_size * sum(shard_numel(p, world_size) for p in unit) if unit else 0

        def grads(unit: Sequence[nn.Parameter]) -> int:
            return param_size * sum(p.numel() for p in unit) if new_grads else 0

        gathered = param_size if world_size > 1 else 0  # all-gather output bytes per element
        root = param_size * padded(self.root)
        root_gathered = gathered * padded(self.root)
        forward = [root_gathered]
        backward = [root_gathered]
        unit = [root_gathered]
        previous_gathered = root_gathered  # forward: the root's output is kept until block 1's
        ahead = 0  # backward: what block i all-gathers ahead (block i - 1; block 1: nothing)
        for block in self.blocks:
            unsharded = param_size * padded(block)
            own_gathered = gathered * padded(block)
            reduce_input = reduce_size * padded(block) if world_size > 1 else 0
            forward += [unsharded + own_gathered, previous_gathered + own_gathered]
            backward.append(grads(self.root) + unsharded + ahead)
            unit.append(
                grads(self.root)
                + max(
                    unsharded + own_gathered,
                    unsharded + grads(block) + ahead,
                    reduce_input + grads(block) + ahead,
                )
            )
            previous_gathered, ahead = own_gathered, own_gathered
        if not self.blocks:  # the root alone: its gradients, then its reduce-scatter
            reduce_input = reduce_size * padded(self.root) if world_size > 1 else 0
            backward.append(grads(self.root))
            unit.append(grads(self.root) + reduce_input)
        return {
            "forward (unit)": root + max(forward),
            "backward (in model)": root + max(backward),
            "backward (unit)": root + max(unit),
        }

    @property
    def largest_unit(self) -> int:
        """Parameters in the largest wrap unit."""
        return max(sum(p.numel() for p in unit) for unit in self.units)


@dataclass
class Plan:
    """Every layout planned for a job, and which fit a memory budget."""

    job: Job
    layouts: list[Layout]
    gpu_memory: int | None
    param_count: int
    notes: list[str]

    def fits(self, layout: Layout) -> bool | None:
        return None if self.gpu_memory is None else layout.peak <= self.gpu_memory

    def smallest_fit(self) -> Layout | None:
        """Fewest workers, then the strategy order (single, ddp, fsdp2, fsdp)."""
        fitting = [layout for layout in self.layouts if self.fits(layout)]
        order = {name: i for i, name in enumerate(STRATEGY_ORDER)}
        return min(fitting, key=lambda lay: (lay.world_size, order[lay.strategy]), default=None)


def plan_job(
    job: Job,
    strategies: Sequence[str] = STRATEGY_ORDER,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    gpu_memory: int | None = None,
    planner: Planner | None = None,
) -> Plan:
    """Plan every (strategy, world size) layout; ``single`` only at world size 1 and
    world sizes that do not divide the global batch are left out (and noted)."""
    planner = planner or Planner(job)
    layouts: list[Layout] = []
    notes = list(planner.source.notes)
    if not planner.units[:-1] and any(s in SHARDED for s in strategies):
        notes.append(
            f"{type(planner.model).__name__} has no `blocks`: fsdp/fsdp2 shard it as one unit"
        )
    for size in world_sizes:
        if job.data.batch_size % (size * job.optim.grad_accum_steps):
            notes.append(
                f"world size {size}: data.batch_size {job.data.batch_size} does not split over "
                f"{size} x {job.optim.grad_accum_steps} accumulation step(s); left out"
            )
            continue
        for strategy in strategies:
            if strategy == "single" and size > 1:
                continue
            layouts.append(planner.layout(strategy, size))
    return Plan(job, layouts, gpu_memory, planner.param_count, notes)


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """torch's fake-mode and tracker warnings are noise in a plan's output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


# ---------------------------------------------------------------------------------------------
# Printing.


def format_plan(plan: Plan) -> str:
    """The plan as a plain table: one row per layout, bytes per rank."""
    header = ["layout", "batch/rank", *CATEGORIES, "peak", "peak at"]
    if plan.gpu_memory is not None:
        header.append(f"fits {format_bytes(plan.gpu_memory)}")
    rows = []
    for layout in plan.layouts:
        parts = layout.at_peak()
        row = [
            f"{layout.strategy} x {layout.world_size}",
            str(layout.micro_batch),
            *(format_bytes(parts[c]) for c in CATEGORIES),
            format_bytes(layout.peak),
            layout.peak_moment,
        ]
        if plan.gpu_memory is not None:
            row.append("yes" if plan.fits(layout) else "no")
        rows.append(row)
    lines = [
        f"plan: {plan.job.model.name} ({plan.param_count:,} parameters), {plan.job.precision}, "
        f"{plan.job.optim.name}, global batch {plan.job.data.batch_size}, "
        f"grad_accum_steps {plan.job.optim.grad_accum_steps}; bytes per rank at its peak",
        format_table(header, rows),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    if plan.gpu_memory is not None:
        best = plan.smallest_fit()
        lines.append(
            f"smallest layout that fits {format_bytes(plan.gpu_memory)}: "
            + (
                f"{best.strategy} x {best.world_size} ({format_bytes(best.peak)})"
                if best
                else "none"
            )
        )
    return "\n".join(lines)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned with two spaces; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data."""
    best = plan.smallest_fit()
    return {
        "model": plan.job.model.name,
        "parameters": plan.param_count,
        "precision": plan.job.precision,
        "optimizer": plan.job.optim.name,
        "global_batch": plan.job.data.batch_size,
        "gpu_memory": plan.gpu_memory,
        "layouts": [
            {
                "strategy": lay.strategy,
                "world_size": lay.world_size,
                "micro_batch": lay.micro_batch,
                "peak": lay.peak,
                "peak_moment": lay.peak_moment,
                "at_peak": lay.at_peak(),
                "moments": lay.moments,
                "fits": plan.fits(lay),
            }
            for lay in plan.layouts
        ],
        "smallest_fit": None
        if best is None
        else {"strategy": best.strategy, "world_size": best.world_size},
        "notes": plan.notes,
    }

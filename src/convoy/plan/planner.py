"""A rank's peak per layout: ``Layout`` (bytes at each moment), ``Planner`` (composes them
from the measurements, cached across layouts), ``Plan`` and ``plan_job`` (every layout of a
job, and which fit a memory budget).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from convoy.config import Job, layout_name, split_batch
from convoy.plan.job import (
    DEFAULT_WORLD_SIZES,
    compute_dtype,
    layout_job,
    micro_batch,
    strategy_order,
    takes_tensor_parallel,
    tp_size_of,
)
from convoy.plan.measure import Activations, OptimizerCost, measure_activations, measure_optimizer
from convoy.plan.model import (
    ModelSource,
    blocks_and_root,
    build_skeleton,
    largest_module,
    load_source,
    local_shapes,
    shard_numel,
    whole_build_reason,
)
from convoy.plan.parse import format_bytes
from convoy.plan.setup import ModelSizes, set_up
from convoy.strategies import Strategy, strategy_class, strategy_classes

CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "comm")
"""Rows of a plan. ``temp``: backward or optimizer-step transients, or what the set-up holds
beyond the rank's parameters (a whole model, a module's values); ``comm``: DDP buckets or
the FSDP unsharded working set."""
SETUP = "set-up"
"""The moment of a layout's set-up phase (``convoy.plan.setup``)."""


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
    """Each candidate moment's bytes per category (``CATEGORIES``), ``"set-up"`` among them."""
    tp_size: int = 1
    whole_build: int = 0
    """Bytes of the whole model each rank builds before this layout shards it (0: none)."""

    @property
    def name(self) -> str:
        """The strategy, with ``+tpN`` under tensor parallelism (``fsdp2+tp2``)."""
        return layout_name(self.strategy, self.tp_size)

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=lambda name: sum(self.moments[name].values()))

    @property
    def peak(self) -> int:
        return sum(self.moments[self.peak_moment].values())

    def at_peak(self) -> dict[str, int]:
        return dict(self.moments[self.peak_moment])

    @property
    def setup(self) -> int:
        """Bytes at the set-up's peak: the model built, laid out and filled
        (``convoy.plan.setup``)."""
        return sum(self.moments[SETUP].values())


class Planner:
    """Plans layouts of one job; measurements are cached across strategies and sizes."""

    def __init__(self, job: Job, source: ModelSource | None = None) -> None:
        self.job = job
        self.source = source or load_source(job)
        self._parts: dict[int, ModelParts] = {}
        whole = self.parts(1)
        self.model, self.blocks, self.root = whole.model, whole.blocks, whole.root
        self.units, self.params = whole.units, whole.params
        self.whole_build_reason = (
            whole_build_reason(self.model)
            if self.source.on_meta
            else "its factory cannot run on the meta device"
        )
        """Why every rank builds the model whole before sharding it; None: on meta."""
        self.largest_module = largest_module(self.model)
        self._activations: dict[tuple[int, Any, int], Activations] = {}
        self._optimizer: dict[tuple[str, int, int], OptimizerCost] = {}

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def trainable_count(self) -> int:
        """Parameters that train (all of them, but the adapters alone under ``model.lora``)."""
        return self.parts(1).trainable_count

    def parts(self, tp_size: int) -> ModelParts:
        """The model (one tensor-parallel rank's share of it, for ``tp_size`` > 1) in units."""
        if tp_size not in self._parts:
            job = layout_job(self.job, self.job.strategy.name, 1, tp_size)
            self._parts[tp_size] = ModelParts.of(build_skeleton(job, self.source, tp_share=True))
        return self._parts[tp_size]

    def activations(self, job: Job, rows: int) -> Activations:
        """What ``job`` (a layout's) saves and transiently needs on a micro-batch of ``rows``."""
        dtype = compute_dtype(job)
        casts = strategy_class(job.strategy.name).casts_parameters
        cast = dtype if casts and dtype != torch.float32 else None
        key = (rows, cast, tp_size_of(job.strategy))
        if key not in self._activations:
            self._activations[key] = measure_activations(job, self.source, rows, cast)
        return self._activations[key]

    def optimizer(self, strategy: str, world_size: int, tp_size: int = 1) -> OptimizerCost:
        """The optimizer over the trainable parameters (the adapters alone under LoRA)."""
        # Per-parameter shards (FSDP2) are DTensors the optimizer steps at any world size; a
        # flat shard per unit (FSDP1, use_orig_params) is stepped as plain tensors of shard
        # shapes; unsharded state as the parameters' own shapes.
        sharding = strategy_class(strategy).sharding
        layout = sharding.layout if sharding.optimizer_state else None
        size = world_size if sharding.optimizer_state else 1
        key = (layout or "whole", size, tp_size)
        params = self.parts(tp_size).trainable
        if key not in self._optimizer:
            if layout == "per_parameter":
                shapes = [tuple(p.shape) for p in params]
                cost = measure_optimizer(self.job, shapes, fsdp2_world_size=size)
            else:
                cost = measure_optimizer(self.job, local_shapes(params, size))
            self._optimizer[key] = cost
        return self._optimizer[key]

    def layout(self, strategy: str, world_size: int, tp_size: int | None = None) -> Layout:
        """The plan of ``strategy`` on ``world_size`` ranks (``tp_size``: as ``layout_job``)."""
        cls = strategy_class(strategy, "--strategies")
        job = layout_job(self.job, strategy, world_size, tp_size)
        tp = tp_size_of(job.strategy)
        parts = self.parts(tp)
        rows = micro_batch(job, world_size)
        # What the model state is split over: every data-parallel rank, a shard group (hsdp),
        # or none; under tensor parallelism, the share of one rank of its group.
        shards = cls.shard_ranks(job.strategy, world_size)
        assert shards is not None, f"{strategy} cannot run on {world_size} ranks (plan_job)"
        params = 4 * _local_params(cls, shards, parts)  # fp32 master weights, frozen ones too
        grads = 4 * _local_grads(cls, shards, parts)  # the trainable parameters' only
        opt = self.optimizer(strategy, shards, tp)
        acts = self.activations(job, rows)
        comm = self._comm(job, cls, shards, parts)
        # Accumulation: later micro-steps run with the gradients of earlier ones; no_sync
        # keeps them unsharded under FSDP.
        accum_grads = 0
        if job.optim.grad_accum_steps > 1:
            accum_grads = 4 * parts.trainable_count if cls.sharding.gradients else grads
        static = {"params": params, "optimizer": opt.state}
        ddp_buckets = comm if cls.comm_buffers == "ddp_buckets" else 0
        moments = _step_moments(static, grads, accum_grads, acts, opt, ddp_buckets)
        setup = set_up(cls, shards, params, self._sizes(parts))
        # DDP broadcasts the filled model, then allocates its buckets: the larger of those.
        fill = setup.peak - params
        wrap = max(ddp_buckets, _ddp_broadcast(parts)) if ddp_buckets else 0
        extra = {"temp": fill} if fill > wrap else {"comm": wrap}
        moments[SETUP] = {"params": params, **extra}
        if cls.sharding.layout == "per_parameter":  # fully_shard's working set
            held = self._fsdp2_held(job, shards, parts)
            _add_fsdp2_moments(moments, static, accum_grads, acts, held)
            comm = max(held.values())
        elif cls.gathers_parameters(shards):
            # Backward through the largest unit: it is unsharded, the next one is being
            # all-gathered, and its full gradients wait for the reduce-scatter (fp32).
            moments["backward (unit)"] = {
                **static,
                "grads": accum_grads,
                "activations": acts.saved,
                "temp": 4 * parts.largest_unit,
                "comm": comm,
            }
        return Layout(
            strategy=strategy,
            world_size=world_size,
            micro_batch=rows,
            params=params,
            grads=grads,
            optimizer=opt.state,
            activations=acts.saved,
            backward_temp=acts.backward,
            step_temp=opt.transient,
            comm=comm,
            moments=_by_category(moments),
            tp_size=tp,
            whole_build=setup.whole,
        )

    def _sizes(self, parts: ModelParts) -> ModelSizes:
        """What the set-up of a layout that holds ``parts`` depends on."""
        on_meta = self.whole_build_reason is None
        return ModelSizes(self.param_count, parts.units, self.largest_module, on_meta)

    def _comm(self, job: Job, cls: type[Strategy], world_size: int, parts: ModelParts) -> int:
        """DDP's buckets hold a copy of every gradient (fp32; Convoy's DDP keeps
        ``gradient_as_bucket_view`` off), of trainable parameters only. FSDP holds the
        largest unit unsharded (frozen parameters too) and all-gathers the next one ahead,
        in the dtype it computes in."""
        if cls.comm_buffers == "ddp_buckets":
            return 4 * parts.trainable_count
        if not cls.gathers_parameters(world_size):
            return 0
        dtype = compute_dtype(job)
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        return 2 * itemsize * parts.largest_unit

    def _fsdp2_held(self, job: Job, world_size: int, parts: ModelParts) -> dict[str, int]:
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
        the root's live until the end of backward. Frozen parameters (LoRA's base) are
        gathered with their unit but have no gradients to hold or reduce-scatter.

        - ``forward (unit)``: the root unsharded, plus the largest of a unit's all-gather
          output with its copy (or with the next unit's all-gather output);
        - ``backward (loss)``: the loss's own backward where the model computes its loss
          (otherwise it meets nothing unsharded): the root unsharded;
        - ``backward (in model)``, with the part of the backward transient from the model's
          outputs on: the root unsharded
          with its gradients, the unit in backward unsharded and the one before it
          all-gathered;
        - ``backward (unit)``: the same without the transient, at a unit's copy-out, its
          gradients' production or its reduce-scatter.
        """
        sizes = _Fsdp2Bytes.of(job, world_size)
        root = sizes.unsharded(parts.root)
        root_grads = sizes.grads(parts.root)
        root_gathered = sizes.gathered(parts.root)
        forward = [root_gathered]
        backward = [root_gathered]
        unit = [root_gathered]
        previous_gathered = root_gathered  # forward: the root's output is kept until block 1's
        ahead = 0  # backward: what block i all-gathers ahead (block i - 1; block 1: nothing)
        for block in parts.blocks:
            unsharded = sizes.unsharded(block)
            own_gathered = sizes.gathered(block)
            block_grads = sizes.grads(block)
            forward += [unsharded + own_gathered, previous_gathered + own_gathered]
            backward.append(root_grads + unsharded + ahead)
            unit.append(
                root_grads
                + max(
                    unsharded + own_gathered,
                    unsharded + block_grads + ahead,
                    sizes.reduce_input(block) + block_grads + ahead,
                )
            )
            previous_gathered, ahead = own_gathered, own_gathered
        if not parts.blocks:  # the root alone: its gradients, then its reduce-scatter
            backward.append(root_grads)
            unit.append(root_grads + sizes.reduce_input(parts.root))
        return {
            "backward (loss)": root,
            "forward (unit)": root + max(forward),
            "backward (in model)": root + max(backward),
            "backward (unit)": root + max(unit),
        }

    @property
    def largest_unit(self) -> int:
        """Parameters in the largest wrap unit."""
        return self.parts(1).largest_unit


def _local_params(cls: type[Strategy], shards: int, parts: ModelParts) -> int:
    """Parameters one rank holds: all of them, or its shard of each unit or parameter."""
    sharded = cls.sharding.parameters and shards > 1
    if sharded and cls.sharding.layout == "flat_per_unit":  # split evenly per unit
        return sum(math.ceil(sum(p.numel() for p in u) / shards) for u in parts.units)
    if sharded:
        return sum(shard_numel(p, shards) for p in parts.params)
    return parts.param_count


DDP_BROADCAST_BUCKET = 250 * 2**20
"""Bytes DDP flattens at a time to broadcast rank 0's parameters as it wraps the model
(``DistributedDataParallel.broadcast_bucket_size``)."""


def _ddp_broadcast(parts: ModelParts) -> int:
    """The flat copy DDP makes of the parameters, frozen ones too, to broadcast them at wrap
    (fp32): one bucket at a time, a parameter larger than a bucket alone in its own. Without
    frozen parameters it is never more than the gradient buckets."""
    largest = max((p.numel() for p in parts.params), default=0)
    return 4 * max(min(parts.param_count, DDP_BROADCAST_BUCKET // 4), largest)


def _local_grads(cls: type[Strategy], shards: int, parts: ModelParts) -> int:
    """Gradient elements one rank holds after a step's backward: those of the trainable
    parameters, whole or its shard of each (FSDP1: the flat shard of every unit that holds
    a trainable parameter, frozen ones' places included)."""
    sharded = cls.sharding.gradients and shards > 1
    if sharded and cls.sharding.layout == "flat_per_unit":
        units = [u for u in parts.units if any(p.requires_grad for p in u)]
        return sum(math.ceil(sum(p.numel() for p in u) / shards) for u in units)
    if sharded:
        return sum(shard_numel(p, shards) for p in parts.trainable)
    return parts.trainable_count


def _step_moments(
    static: dict[str, int],
    grads: int,
    accum_grads: int,
    acts: Activations,
    opt: OptimizerCost,
    ddp_buckets: int,
) -> dict[str, dict[str, int]]:
    """The moments every layout has: backward, the optimizer step, and with checkpointed
    blocks, a block recomputed late in backward."""
    moments = {
        "backward": {
            **static,
            "grads": accum_grads,
            "activations": acts.saved,
            "temp": acts.backward,
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
    if acts.recompute_grads:
        # Checkpointed blocks: the peak may come late in backward, a block recomputed
        # with most gradients already produced (in their final, sharded form).
        moments["backward (recompute)"] = {
            **static,
            "grads": accum_grads or round(acts.recompute_grads * grads),
            "activations": acts.saved + min(acts.recompute, 0),
            "temp": max(acts.recompute, 0),
            "comm": ddp_buckets,
        }
    return moments


def _add_fsdp2_moments(
    moments: dict[str, dict[str, int]],
    static: dict[str, int],
    accum_grads: int,
    acts: Activations,
    held: dict[str, int],
) -> None:
    """Add ``fully_shard``'s working set (``held``, from ``Planner._fsdp2_held``) to
    ``moments``. "backward" is the loss's own backward: every unit is resharded then."""
    unit_moments = {
        "forward (unit)": (acts.forward, 0),
        "backward (in model)": (acts.saved, acts.backward_in_model),
        "backward (unit)": (acts.saved, 0),
    }
    for name, (live, temp) in unit_moments.items():
        moments[name] = {
            **static,
            "grads": accum_grads,
            "activations": live,
            "temp": temp,
            "comm": held[name],
        }
    if "backward (recompute)" in moments:  # the recomputed block is unsharded
        moments["backward (recompute)"]["comm"] = held["backward (unit)"]
    if acts.loss_in_model:  # the loss's own backward runs in the root's
        moments["backward"]["comm"] = held["backward (loss)"]


def _by_category(moments: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each moment's bytes in ``CATEGORIES`` order, zero where it holds none."""
    return {
        name: {c: held_bytes.get(c, 0) for c in CATEGORIES} for name, held_bytes in moments.items()
    }


@dataclass(frozen=True)
class _Fsdp2Bytes:
    """Bytes of ``fully_shard``'s buffers for a unit of parameters on ``world_size`` ranks."""

    world_size: int
    param_size: int
    """Bytes per element in the dtype it computes in (unsharded parameters, gradients)."""
    reduce_size: int
    """Bytes per element of the reduce-scatter input."""
    new_grads: bool
    """Whether a micro-step's gradients are new tensors (not added into accumulated ones)."""

    @classmethod
    def of(cls, job: Job, world_size: int) -> _Fsdp2Bytes:
        param_dtype = compute_dtype(job)
        # The config's option where the strategy has one; gradients reduce in fp32 otherwise.
        reduce_name = getattr(job.strategy, "reduce_dtype", "fp32")
        # With accumulation in fp32 the micro-step's gradients add into the accumulated
        # unsharded ones (counted as grads); otherwise they are new tensors.
        new_grads = param_dtype != torch.float32 or job.optim.grad_accum_steps == 1
        return cls(
            world_size=world_size,
            param_size=torch.empty((), dtype=param_dtype, device="meta").element_size(),
            reduce_size=4 if reduce_name == "fp32" else 2,
            new_grads=new_grads,
        )

    def padded(self, unit: Sequence[nn.Parameter]) -> int:
        """Elements of the unit padded so that dim 0 of each parameter splits evenly."""
        size = self.world_size
        return size * sum(shard_numel(p, size) for p in unit) if unit else 0

    def unsharded(self, unit: Sequence[nn.Parameter]) -> int:
        return self.param_size * self.padded(unit)

    def gathered(self, unit: Sequence[nn.Parameter]) -> int:
        """The all-gather output: none on one rank."""
        return self.unsharded(unit) if self.world_size > 1 else 0

    def reduce_input(self, unit: Sequence[nn.Parameter]) -> int:
        """The reduce-scatter input (the trainable parameters'): none on one rank."""
        trainable = [p for p in unit if p.requires_grad]
        return self.reduce_size * self.padded(trainable) if self.world_size > 1 else 0

    def grads(self, unit: Sequence[nn.Parameter]) -> int:
        """The unit's new gradients (its trainable parameters' shapes, param dtype)."""
        numel = sum(p.numel() for p in unit if p.requires_grad)
        return self.param_size * numel if self.new_grads else 0


@dataclass(frozen=True)
class ModelParts:
    """A model as FSDP wraps it: its blocks' parameter groups and the root's remaining ones."""

    model: nn.Module
    blocks: list[list[nn.Parameter]]
    root: list[nn.Parameter]

    @classmethod
    def of(cls, model: nn.Module) -> ModelParts:
        blocks, root = blocks_and_root(model)
        return cls(model, blocks, root)

    @property
    def units(self) -> list[list[nn.Parameter]]:
        return [unit for unit in [*self.blocks, self.root] if unit]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in unit]

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def trainable(self) -> list[nn.Parameter]:
        """The parameters that train (``requires_grad``): under LoRA, the adapters."""
        return [p for p in self.params if p.requires_grad]

    @property
    def trainable_count(self) -> int:
        return sum(p.numel() for p in self.trainable)

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
    trainable_count: int | None = None
    """Parameters that train; None: all of them (``param_count``)."""

    @property
    def trainable(self) -> int:
        """Parameters that train (under LoRA, the adapters)."""
        return self.param_count if self.trainable_count is None else self.trainable_count

    @property
    def frozen(self) -> int:
        """Parameters that do not train (under LoRA, the base model)."""
        return self.param_count - self.trainable

    def fits(self, layout: Layout) -> bool | None:
        return None if self.gpu_memory is None else layout.peak <= self.gpu_memory

    def smallest_fit(self) -> Layout | None:
        """Fewest workers, then the planner's strategy order (``strategy_order``: single,
        ddp, fsdp2, fsdp)."""
        fitting = [layout for layout in self.layouts if self.fits(layout)]
        order = {name: i for i, name in enumerate(strategy_order())}
        return min(
            fitting,
            key=lambda lay: (lay.world_size, order[lay.strategy], lay.tp_size),
            default=None,
        )


def plan_job(
    job: Job,
    strategies: Sequence[str] | None = None,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    gpu_memory: int | None = None,
    planner: Planner | None = None,
    tp_sizes: Sequence[int | None] = (None,),
) -> Plan:
    """Plan every (strategy, world size, tensor-parallel size) layout (``strategies``: all of
    them, in ``strategy_order``, by default; ``tp_sizes``: None, the recipe's). A strategy is
    left out at world sizes it cannot train on (``single`` above 1), and world sizes that do
    not split the global batch are left out (and noted)."""
    strategies = strategy_order() if strategies is None else strategies
    planner = planner or Planner(job)
    layouts: list[Layout] = []
    notes = list(planner.source.notes)
    if not planner.units[:-1] and any(_shards(s) for s in strategies):
        sharding = "/".join(sorted(name for name in strategy_classes() if _shards(name)))
        notes.append(
            f"{type(planner.model).__name__} has no `blocks`: {sharding} shard it as one unit"
        )
    for size in world_sizes:
        if split_batch(job.data.batch_size, size, job.optim.grad_accum_steps) is None:
            notes.append(
                f"world size {size}: data.batch_size {job.data.batch_size} does not split over "
                f"{size} x {job.optim.grad_accum_steps} accumulation step(s); left out"
            )
            continue
        for strategy in strategies:
            for tp in tp_sizes:
                if plannable(job, strategy, size, tp):
                    layouts.append(planner.layout(strategy, size, tp))
    unplaced = [
        name
        for name in strategies
        if not any(layout.strategy == name for layout in layouts)
        and any(strategy_class(name).runs_on(size) for size in world_sizes)
    ]
    for name in unplaced:
        notes.append(
            f"{name}: no layout at world sizes {', '.join(map(str, world_sizes))} with its "
            "settings (hsdp: give -o strategy.name=hsdp -o strategy.shard_size=N, the workers "
            "of one node, that splits a world size into 2 or more replicas)"
        )
    notes += whole_build_notes(layouts, planner.whole_build_reason)
    return Plan(job, layouts, gpu_memory, planner.param_count, notes, planner.trainable_count)


def whole_build_notes(layouts: Sequence[Layout], reason: str | None) -> list[str]:
    """What the sharded layouts that build the whole model on every rank first say, one line
    for all of them: the strategies, the whole model's size and ``reason`` (why)."""
    whole = [layout for layout in layouts if layout.whole_build]
    if not whole:
        return []
    names = ", ".join(dict.fromkeys(layout.name for layout in whole))
    size = format_bytes(whole[0].whole_build)
    return [f"{names}: every rank builds the whole model ({size}) before sharding ({reason})"]


def plannable(job: Job, strategy: str, world_size: int, tp_size: int | None = None) -> bool:
    """Whether ``strategy`` (with the settings ``layout_job`` gives it) trains on
    ``world_size`` ranks: ``single`` on one, ``hsdp`` where its shard group splits them, a
    tensor-parallel size on a strategy that has it and where it splits them (never with
    LoRA, which trains under data parallelism only)."""
    cls = strategy_class(strategy, "--strategies")
    if tp_size is not None and tp_size > 1 and not takes_tensor_parallel(strategy):
        return False
    if tp_size is not None and tp_size > 1 and job.model.lora is not None:
        return False  # LoRA trains under data parallelism only (convoy.models.lora)
    cfg = layout_job(job, strategy, world_size, tp_size).strategy
    if world_size % tp_size_of(cfg):
        return False
    return cls.runs_on(world_size) and cls.shard_ranks(cfg, world_size) is not None


def _shards(strategy: str) -> bool:
    return strategy_class(strategy, "--strategies").sharding.parameters


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    """torch's fake-mode and tracker warnings are noise in a plan's output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield

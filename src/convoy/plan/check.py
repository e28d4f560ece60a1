"""Check ``convoy plan`` against measurement: run the real training step and track memory.

``tracked_peak(job, strategy_name, world_size)`` runs two optimizer steps of ``job`` with
the training loop's own step (``convoy.engine.step.train_step``: forward and the task's
loss per micro-batch with ``no_sync`` on all but the last, backward, clipping if configured,
the optimizer step, ``zero_grad``, the LR schedule), with the model wrapped by Convoy's own
strategy and the optimizer from Convoy's own builder, under the memory tracker the strategy
names (``Strategy.memory_tracking``, from ``torch.distributed._tools``), over a ``fake``
process group of ``world_size`` ranks where the strategy needs one: rank 0's view of any
world size, on one CPU.

- ``single``: ``MemTracker`` under ``FakeTensorMode`` (no memory, any model size);
- ``fsdp2``: ``FSDPMemTracker`` under ``FakeTensorMode``;
- ``ddp``: ``MemTracker`` on real tensors (DDP's reducer reads parameter data, which fake
  tensors do not have). The fake group's all-reduce gives DDP no result, so a comm hook
  returns the bucket as it is: the same memory as an in-place all-reduce. A DDP rank's
  memory depends on the world size only through its micro-batch.
- ``fsdp`` (FSDP1): not tracked (``Strategy.untracked_reason``: ``MemTracker`` hooks every
  parameter a module uses, and FSDP1's ``use_orig_params`` parameters are views into a flat
  parameter during forward, which autograd refuses hooks on). The model state (sharded
  parameters, gradients, optimizer state) is still measured from the wrapped model, one
  step on real tensors.

A first, untracked step creates the optimizer state and fills DTensor's sharding caches (a
tracker would count those once as optimizer memory); then two tracked steps, with module
statistics reset after the first (as torchtitan's estimator does); the peak covers both. The result is rank 0's bytes per tracker
category at the peak, plus ``"Total"``.

The set-up before them (the plan's ``set-up`` moment, ``convoy.plan.setup``) is tracked apart,
by a ``MemTracker`` over the model's build and the strategy's ``wrap``: on fake tensors, a
model without ``init_module`` is made whole (``to_fake``) and then wrapped; a meta-built one
is wrapped on meta and filled by ``FakeWeights`` (the strategy's own materialization, then
each module's full values in turn, as ``convoy.models.init`` makes them); on real tensors,
the engine's own build (``convoy.models.registry.build_skeleton``) and fill.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from convoy.batches import tensors_in
from convoy.config import Job
from convoy.engine.amp import Precision
from convoy.engine.schedule import build_optimizer, build_scheduler, no_decay_names, peak_lr
from convoy.engine.step import StepHooks, StepParts, train_step
from convoy.errors import ConfigError, one_of
from convoy.models import registry
from convoy.plan.fake_fill import FakeWeights
from convoy.plan.format import format_table
from convoy.plan.job import compute_dtype, layout_job, micro_batch
from convoy.plan.model import (
    ModelSource,
    build_skeleton,
    fake_batch,
    fake_process_group,
    load_source,
    to_fake,
    whole_build_reason,
)
from convoy.plan.parse import format_bytes
from convoy.plan.planner import (
    CATEGORIES,
    SETUP,
    Layout,
    Planner,
    plannable,
)
from convoy.strategies import Strategy, build_strategy, strategy_class, strategy_classes
from convoy.strategies.base import InitialWeights
from convoy.strategies.blocks import prepare_blocks
from convoy.tasks import build_task

REAL_TENSOR_LIMIT = 2 * 2**30
"""DDP and FSDP1 run on real tensors: refuse models whose state would pass this many bytes."""

TRACKER_TO_PLAN = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Buffer": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Other": "activations",
    "Temp": "temp",
    "Unsharded Param": "comm",
    "Unsharded Grad": "comm",
    "All Gather": "comm",
    "Reduce Scatter": "comm",
}
"""Tracker categories as the plan's rows. MemTracker counts DDP's gradient buckets as
Activation (they are allocated during forward); the plan shows them under comm."""


class UntrackableError(Exception):
    """A layout the trackers cannot follow; the message says why."""


@dataclass
class Tracked:
    """What one tracked run measured on rank 0."""

    strategy: str
    world_size: int
    peak: dict[str, int] = field(default_factory=dict)
    """Bytes per tracker category at the peak, plus ``"Total"`` (empty if not tracked)."""
    model_state: dict[str, int] = field(default_factory=dict)
    """``params``, ``grads`` and ``optimizer`` bytes held by this rank's tensors."""
    setup: int = 0
    """Bytes at the set-up's peak (the model built and wrapped; 0 if not tracked)."""
    note: str = ""


def tracked_peak(job: Job, strategy_name: str, world_size: int) -> dict[str, int]:
    """Rank 0's peak memory over two training steps of ``job`` run with ``strategy_name``
    on ``world_size`` ranks, per tracker category (``Parameter``, ``Gradient``,
    ``Optstate``, ``Activation``, ``Temp``, ... for ``single`` / ``ddp``; ``Sharded Param``,
    ``Unsharded Param``, ``All Gather``, ``Reduce Scatter``, ``OptState``, ... for
    ``fsdp2``) plus ``"Total"``, in bytes.

    Runs in the calling process on CPU, without workers or Ray; needs no process group and
    leaves none behind (it refuses to run if one is already initialized). A strategy no
    tracker can follow (``fsdp``, FSDP1) raises ``ConfigError``, as does an unknown one.
    """
    cls = strategy_class(strategy_name, "strategy_name")
    if cls.memory_tracking is None:
        tracked = [name for name, c in strategy_classes().items() if c.memory_tracking]
        raise ConfigError(
            "strategy_name",
            strategy_name,
            f"peak memory is tracked for {one_of(tracked)}; {cls.untracked_reason}",
        )
    result = track(job, strategy_name, world_size)
    return result.peak


def track(
    job: Job,
    strategy_name: str,
    world_size: int,
    source: ModelSource | None = None,
    tp_size: int | None = None,
) -> Tracked:
    """Run two steps under the trackers (see the module docstring) and measure."""
    source = source or load_source(job)
    run = layout_job(job, strategy_name, world_size, tp_size)
    cls = strategy_class(strategy_name, "strategy_name")
    with fake_process_group(world_size, needed=cls.requires_process_group):
        if cls.memory_tracking is None:
            state = _untracked_model_state(run, source)
            note = f"peak not tracked: {cls.untracked_reason}"
            return Tracked(strategy_name, world_size, model_state=state, note=note)
        return _tracked_run(run, source)


def _tracked_run(job: Job, source: ModelSource) -> Tracked:
    name, size = job.strategy.name, job.scaling.max_workers
    tracking = strategy_class(name).memory_tracking
    assert tracking is not None, "track() measures only the model state of the others"
    mode: Any = FakeTensorMode() if tracking.fake_tensors else _RealMode()
    batches = _batches(job, source, mode)
    setup = _memory_tracker()
    model, weights = _built(job, source, mode, setup)
    no_decay = no_decay_names(model)  # from the unwrapped model, as the loop takes them
    # FakeWeights track their own fill, inside the fake mode (a tracker outside it misses
    # what the mode makes).
    around = contextlib.nullcontext() if isinstance(weights, FakeWeights) else setup
    with around:
        strategy, model = _wrapped(job, model, weights)
    with mode:
        parts = _step_parts(job, strategy, model, no_decay)
        tracker = _tracker(tracking.tracker, parts, batches)
        state: dict[str, int] = {}
        # An untracked first step: it creates the optimizer state and fills DTensor's
        # sharding caches, which a tracker would otherwise count once as optimizer memory.
        _run_step(job, parts, batches, _Measure(state))
        with tracker:
            for _ in range(2):
                _run_step(job, parts, batches, _Measure(state, tracker.reset_mod_stats))
        peak = _flatten(tracker.get_tracker_snapshot("peak"))
        _measure_model_state(parts, state)
    setup_peak = _flatten(setup.get_tracker_snapshot("peak"), skip_meta=True)["Total"]
    return Tracked(name, size, peak=peak, model_state=state, setup=setup_peak)


def _built(
    job: Job, source: ModelSource, mode: Any, setup: Any
) -> tuple[nn.Module, InitialWeights | None]:
    """The model before its strategy wraps it, and what fills it once wrapped (None: it is
    real already). On fake tensors (``mode``): a meta skeleton filled by ``FakeWeights``,
    or, for a model the engine builds whole, made whole at once; on real tensors, the
    engine's own build. A whole model is counted by ``setup`` as it stands: a tracker around
    the build would also count what a build on meta allocates for an instant (each
    parameter before it moves to meta), whose frees it does not see."""
    if isinstance(mode, FakeTensorMode):
        # Built outside the fake mode: a factory that cannot run on meta is built for real.
        model = build_skeleton(job, source)
        if source.on_meta and whole_build_reason(model) is None:
            return model, FakeWeights(mode, setup)
        with mode:
            model, weights = to_fake(model, torch.device("cpu")), None
    else:
        model, weights = _real_model(job, source)
    if weights is None:
        setup.track_external(model)
    return model, weights


def _batches(job: Job, source: ModelSource, mode: Any) -> list[tuple[Any, Any]]:
    """One global batch's micro-batches on rank 0, as tensors of ``mode``."""
    rows = micro_batch(job, job.scaling.max_workers)
    return [fake_batch(source.sample, rows, mode) for _ in range(job.optim.grad_accum_steps)]


def _wrapped(
    job: Job, model: nn.Module, weights: InitialWeights | None = None
) -> tuple[Strategy, nn.Module]:
    """The job's strategy and ``model`` wrapped by it (and filled by ``weights``, where it
    was built on meta), outside any fake mode: fully_shard builds its device mesh from the
    process group (fake parameters still dispatch through it); the other strategies only
    move the model, which ``to_fake`` made a no-op."""
    strategy = build_strategy(job.strategy, torch.device("cpu"), compute_dtype(job))
    # Activation checkpointing as the loop applies it (compiling is left out: the trackers
    # follow eager tensors, and a compiled block keeps what its eager one keeps).
    model = strategy.wrap(prepare_blocks(model, job.strategy, compile_mode=False), weights)
    # The fake group's all-reduce gives DDP's buckets no result: without a compression hook
    # of the job's own, one that returns the bucket as it is (an in-place all-reduce's memory).
    own_hook = getattr(job.strategy, "comm_hook", "none") != "none"
    if strategy.comm_buffers == "ddp_buckets" and not own_hook:
        model.register_comm_hook(None, _bucket_as_is)  # type: ignore[operator]
    return strategy, model


def _step_parts(job: Job, strategy: Strategy, model: nn.Module, no_decay: set[str]) -> StepParts:
    """The loop's optimizer (``no_decay``: parameter names without weight decay), LR
    schedule, precision and task around the wrapped model."""
    optimizer = build_optimizer(job.optim, model, no_decay, peak_lr(job.optim, job.data.batch_size))
    return StepParts(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, job.optim, STEPS),
        strategy=strategy,
        precision=Precision(compute_dtype(job), strategy.device, strategy),
        task=build_task(job.task.name, job.task.kwargs),
    )


STEPS = 3
"""Steps a check runs: one untracked, two tracked (the length of its LR schedule)."""


def _tracker(kind: str, parts: StepParts, batches: list[tuple[Any, Any]]) -> Any:
    """The torch memory tracker named ``kind``, following the model, optimizer and inputs."""
    if kind == "FSDPMemTracker":
        # Not optional, but it loads Dynamo (2-3 s): only a check pays it.
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(parts.model, parts.optimizer)
        tracker.track_inputs(tuple(batches))
        return tracker
    inputs = [t for batch in batches for t in tensors_in(batch)]
    memory = _memory_tracker()
    memory.track_external(parts.model, parts.optimizer, *inputs)
    return memory


def _memory_tracker() -> Any:
    """A fresh ``MemTracker`` (it follows every storage made while it is entered), one that
    also follows frozen parameters (``_frozen_aware``)."""
    return _frozen_aware()()


@functools.cache
def _frozen_aware() -> type:
    """``MemTracker`` that leaves frozen parameters (LoRA's base) without gradient hooks:
    torch's hooks every parameter a module uses, and autograd refuses a hook on a tensor
    that needs no gradient. Their bytes are still followed; they never have a gradient."""
    from torch.distributed._tools.mem_tracker import MemTracker  # loads Dynamo: see above

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            if install_grad_hooks:  # a frozen parameter counts as hooked already
                hooked = self._param_to_grad_hook_handles
                for param in module.parameters():
                    if not param.requires_grad and param not in hooked:
                        hooked[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return FrozenAwareMemTracker


class _NoHook:
    """Stands in for the handle of a hook never registered."""

    def remove(self) -> None:
        """Nothing to remove."""


class _Measure(StepHooks):
    """Measures the gradients when they are all in, and calls ``after_micro_step`` after
    each micro-batch (the trackers follow one forward per module per iteration, so their
    module statistics are reset there)."""

    def __init__(
        self, state: dict[str, int], after_micro_step: Callable[[], None] | None = None
    ) -> None:
        self.state = state
        self.after_micro_step = after_micro_step

    def micro_step_done(
        self, outputs: Any, targets: Any, loss_sum: torch.Tensor, count: torch.Tensor
    ) -> None:
        if self.after_micro_step is not None:
            self.after_micro_step()

    def gradients_ready(self, model: nn.Module) -> None:
        self.state["grads"] = _local_bytes(p.grad for p in model.parameters())


def _run_step(job: Job, parts: StepParts, batches: list[tuple[Any, Any]], hooks: StepHooks) -> None:
    """One optimizer step of rank 0 as the loop takes it (``train_step``)."""
    share = job.strategy.data_parallel_rank(0, job.scaling.max_workers)
    train_step(parts, batches, share, job.optim.grad_clip_norm, hooks)


def _measure_model_state(parts: StepParts, state: dict[str, int]) -> None:
    """Parameters and optimizer state this rank holds (the gradients are measured in the
    step, before it drops them)."""
    state["params"] = _local_bytes(parts.model.parameters())
    state["optimizer"] = _local_bytes(
        t for per_param in parts.optimizer.state.values() for t in per_param.values()
    )


class _RealMode(contextlib.nullcontext):  # type: ignore[type-arg,unused-ignore]
    """Stands in for ``FakeTensorMode`` when a run uses real tensors."""

    @staticmethod
    def from_tensor(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


def _real_model(job: Job, source: ModelSource) -> tuple[nn.Module, InitialWeights | None]:
    """The model as the engine builds it (on meta with the weights that fill it, or whole
    and None), for a strategy that runs on real tensors here."""
    model, weights = registry.build_skeleton(
        job.model.name, job.model.kwargs, source.shape, job.run.seed, job.model.lora
    )
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if 4 * size > REAL_TENSOR_LIMIT:  # parameters, gradients, buckets or shards, state
        raise UntrackableError(
            f"{job.strategy.name} runs on real tensors here, and {format_bytes(4 * size)} of "
            f"model state is more than {format_bytes(REAL_TENSOR_LIMIT)}"
        )
    return model, weights


# No annotations on purpose: DDP checks them against its own classes, and this module's
# postponed (string) annotations would fail that check.
def _bucket_as_is(process_group, bucket):  # type: ignore[no-untyped-def,unused-ignore]
    future = torch.futures.Future()  # type: ignore[var-annotated]
    future.set_result(bucket.buffer())
    return future


def _local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: this rank's shard);
    0-d tensors (step counters) are left out, as the plan leaves them out."""
    seen: dict[Any, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.dim() == 0:
            continue
        storage = local.untyped_storage()
        seen[StorageWeakRef(storage)] = storage.nbytes()
    return sum(seen.values())


def _flatten(snapshot: dict[Any, dict[Any, int]], skip_meta: bool = False) -> dict[str, int]:
    """``{device: {category: bytes}}`` -> ``{category: bytes}`` summed over devices (the meta
    device's left out with ``skip_meta``), with the categories' plain names and only the
    non-zero ones."""
    flat: dict[str, int] = {"Total": 0}
    for device, per_device in snapshot.items():
        if skip_meta and getattr(device, "type", None) == "meta":
            continue
        for key, value in per_device.items():
            name = str(getattr(key, "value", key))
            flat[name] = flat.get(name, 0) + value
    return {name: value for name, value in flat.items() if value or name == "Total"}


def _untracked_model_state(job: Job, source: ModelSource) -> dict[str, int]:
    """The per-rank model state after one real step, for a strategy no tracker follows."""
    model, weights = _real_model(job, source)
    no_decay = no_decay_names(model)
    strategy, model = _wrapped(job, model, weights)
    parts = _step_parts(job, strategy, model, no_decay)
    state: dict[str, int] = {}
    _run_step(job, parts, _batches(job, source, _RealMode()), _Measure(state))
    _measure_model_state(parts, state)
    return state


# ---------------------------------------------------------------------------------------------
# Plan against tracked.


@dataclass
class CheckRow:
    """One layout, planned and tracked."""

    layout: Layout
    tracked: Tracked

    @property
    def tracked_total(self) -> int | None:
        """The tracked peak: of the steps, or of the set-up where that is higher."""
        if not self.tracked.peak:
            return None
        return max(self.tracked.peak["Total"], self.tracked.setup)

    @property
    def ratio(self) -> float | None:
        """Planned peak / tracked peak."""
        total = self.tracked_total
        return None if not total else self.layout.peak / total

    def tracked_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for name, value in self.tracked.peak.items():
            if name != "Total":
                out[TRACKER_TO_PLAN.get(name, "activations")] += value
        return out

    def model_state_exact(self) -> bool:
        planned = {
            "params": self.layout.params,
            "grads": self.layout.grads,
            "optimizer": self.layout.optimizer,
        }
        return all(planned[k] == self.tracked.model_state.get(k) for k in planned)


def check_layouts(
    job: Job,
    strategies: list[str],
    world_sizes: list[int],
    planner: Planner | None = None,
    tp_sizes: Sequence[int | None] = (None,),
) -> list[CheckRow]:
    """Plan and track every (strategy, world size, tensor-parallel size) layout."""
    planner = planner or Planner(job)
    rows = []
    layouts = [
        (strategy, size, tp)
        for size in world_sizes
        for strategy in strategies
        for tp in tp_sizes
        if plannable(job, strategy, size, tp)
    ]
    for strategy, size, tp in layouts:
        layout = planner.layout(strategy, size, tp)
        try:
            tracked = track(job, strategy, size, planner.source, tp)
        except UntrackableError as exc:
            tracked = Tracked(strategy, size, note=f"not tracked: {exc}")
        except Exception as exc:  # a tracker or a fake collective this layout trips on
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            tracked = Tracked(strategy, size, note=f"not tracked: {reason}")
        rows.append(CheckRow(layout, tracked))
    return rows


def format_check(rows: list[CheckRow]) -> str:
    """Planned vs tracked, per layout: model state, then the peak per category and the
    ratio planned / tracked, then the set-up's peak."""
    header = ["layout", "what", *CATEGORIES, "total", "plan/tracked"]
    table: list[list[str]] = []
    notes: list[str] = []
    for row in rows:
        name = f"{row.layout.name} x {row.layout.world_size}"
        table += _state_rows(name, row) + _peak_rows(row) + _setup_rows(row)
        if row.tracked.note:
            notes.append(f"{name}: {row.tracked.note}")
    lines = [format_table(header, table)]
    lines += [f"note: {note}" for note in notes]
    if any(strategy_class(row.layout.strategy).comm_buffers == "ddp_buckets" for row in rows):
        lines.append(
            "note: MemTracker counts DDP's gradient buckets as activations; the plan shows them as comm"
        )
    return "\n".join(lines)


def _state_rows(name: str, row: CheckRow) -> list[list[str]]:
    """Model state planned, and measured where it was."""
    planned = [row.layout.params, row.layout.grads, row.layout.optimizer]
    rows = [[name, "state planned", *map(format_bytes, planned), "", "", "", "", ""]]
    state = row.tracked.model_state
    if state:
        exact = "exact" if row.model_state_exact() else "DIFFERS"
        measured = [state.get(k, 0) for k in ("params", "grads", "optimizer")]
        rows.append(["", "state measured", *map(format_bytes, measured), "", "", "", "", exact])
    return rows


def _peak_rows(row: CheckRow) -> list[list[str]]:
    """The peak planned per category, and tracked: the steps' categories, or the set-up's
    total where it is the higher."""
    at_peak = row.layout.at_peak()
    planned = [format_bytes(at_peak[c]) for c in CATEGORIES]
    moment = row.layout.peak_moment
    rows = [["", f"peak planned ({moment})", *planned, format_bytes(row.layout.peak), ""]]
    if row.tracked.peak:
        ratio = f"{row.ratio or 0.0:.3f}"
        total = format_bytes(row.tracked_total or 0)
        if row.tracked.setup > row.tracked.peak["Total"]:
            rows.append(["", f"peak tracked ({SETUP})", *[""] * len(CATEGORIES), total, ratio])
        else:
            tracked = [format_bytes(v) for v in row.tracked_by_category().values()]
            rows.append(["", "peak tracked", *tracked, total, ratio])
    return rows


def _setup_rows(row: CheckRow) -> list[list[str]]:
    """The set-up's peak planned per category, and tracked (its total)."""
    planned = row.layout.moments[SETUP]
    cells = [format_bytes(planned[c]) for c in CATEGORIES]
    rows = [["", f"{SETUP} planned", *cells, format_bytes(row.layout.setup), ""]]
    if row.tracked.setup:
        ratio = f"{row.layout.setup / row.tracked.setup:.3f}"
        total = format_bytes(row.tracked.setup)
        rows.append(["", f"{SETUP} tracked", *[""] * len(CATEGORIES), total, ratio])
    return rows


def check_to_dict(rows: list[CheckRow]) -> list[dict[str, Any]]:
    """Planned vs tracked as JSON-ready data."""
    return [
        {
            "strategy": row.layout.strategy,
            "tp_size": row.layout.tp_size,
            "world_size": row.layout.world_size,
            "planned_peak": row.layout.peak,
            "planned_at_peak": row.layout.at_peak(),
            "tracked_peak": row.tracked.peak,
            "planned_setup": row.layout.setup,
            "tracked_setup": row.tracked.setup or None,
            "planned_model_state": {
                "params": row.layout.params,
                "grads": row.layout.grads,
                "optimizer": row.layout.optimizer,
            },
            "tracked_model_state": row.tracked.model_state,
            "model_state_exact": row.model_state_exact() if row.tracked.model_state else None,
            "ratio": row.ratio,
            "note": row.tracked.note,
        }
        for row in rows
    ]

"""Check ``convoy plan`` against measurement: run the real training step and track memory.

``tracked_peak(job, strategy_name, world_size)`` runs two optimizer steps of ``job`` as the
training loop runs them (forward and the task's loss per micro-batch with ``no_sync`` on all
but the last, backward, clipping if configured, the optimizer step, ``zero_grad``), with the
model wrapped by Convoy's own strategy and the optimizer from Convoy's own builder, under
torch's memory trackers (``torch.distributed._tools``):

- ``single``: ``MemTracker`` under ``FakeTensorMode`` (no memory, any model size);
- ``fsdp2``: ``FSDPMemTracker`` over a ``fake`` process group of ``world_size`` ranks under
  ``FakeTensorMode``: rank 0's view of any world size, on one CPU;
- ``ddp``: ``MemTracker`` on real tensors over a ``fake`` process group (DDP's reducer reads
  parameter data, which fake tensors do not have). The fake group's all-reduce gives DDP no
  result, so a comm hook returns the bucket as it is: the same memory as an in-place
  all-reduce. A DDP rank's memory depends on the world size only through its micro-batch.
- ``fsdp`` (FSDP1): not tracked. ``MemTracker`` hooks every parameter a module uses, and
  FSDP1's ``use_orig_params`` parameters are views into a flat parameter during forward,
  which autograd refuses hooks on. The model state (sharded parameters, gradients, optimizer
  state) is still measured from the wrapped model, on real tensors.

A first, untracked step creates the optimizer state and fills DTensor's sharding caches (a
tracker would count those once as optimizer memory); then two tracked steps, with module
statistics reset after the first (as torchtitan's estimator does); the peak covers both. The result is rank 0's bytes per tracker
category at the peak, plus ``"Total"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from convoy.config import DDPStrategyConfig, Job
from convoy.errors import ConfigError, one_of
from convoy.plan import (
    CATEGORIES,
    Layout,
    ModelSource,
    Planner,
    build_raw,
    build_skeleton,
    compute_dtype,
    fake_batch,
    fake_process_group,
    format_bytes,
    format_table,
    layout_job,
    load_source,
    micro_batch,
    to_fake,
)

TRACKED_STRATEGIES = ("single", "ddp", "fsdp2")
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
    note: str = ""


def tracked_peak(job: Job, strategy_name: str, world_size: int) -> dict[str, int]:
    """Rank 0's peak memory over two training steps of ``job`` run with ``strategy_name``
    on ``world_size`` ranks, per tracker category (``Parameter``, ``Gradient``,
    ``Optstate``, ``Activation``, ``Temp``, ... for ``single`` / ``ddp``; ``Sharded Param``,
    ``Unsharded Param``, ``All Gather``, ``Reduce Scatter``, ``OptState``, ... for
    ``fsdp2``) plus ``"Total"``, in bytes.

    Runs in the calling process on CPU, without workers or Ray; needs no process group and
    leaves none behind (it refuses to run if one is already initialized). ``fsdp`` (FSDP1)
    cannot be tracked and raises ``ConfigError``, as does an unknown strategy.
    """
    if strategy_name not in TRACKED_STRATEGIES:
        raise ConfigError(
            "strategy_name",
            strategy_name,
            f"peak memory is tracked for {one_of(TRACKED_STRATEGIES)}; "
            "FSDP1's flat-parameter views cannot be tracked",
        )
    result = track(job, strategy_name, world_size)
    return result.peak


def track(
    job: Job, strategy_name: str, world_size: int, source: ModelSource | None = None
) -> Tracked:
    """Run two steps under the trackers (see the module docstring) and measure."""
    source = source or load_source(job)
    run = layout_job(job, strategy_name, world_size)
    with _process_group(strategy_name, world_size):
        if strategy_name == "fsdp":
            state = _fsdp1_model_state(run, source)
            return Tracked(
                "fsdp",
                world_size,
                model_state=state,
                note="FSDP1 peak not tracked: MemTracker cannot hook use_orig_params views",
            )
        return _tracked_run(run, source)


@contextlib.contextmanager
def _process_group(strategy: str, world_size: int) -> Iterator[None]:
    """A fake process group for every strategy but ``single``."""
    with fake_process_group(world_size, needed=strategy != "single"):
        yield


def _tracked_run(job: Job, source: ModelSource) -> Tracked:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from convoy.engine.amp import Precision
    from convoy.engine.schedule import build_optimizer, no_decay_names, peak_lr
    from convoy.strategies import build_strategy
    from convoy.tasks import build_task

    name, size = job.strategy.name, job.scaling.max_workers
    fake = name != "ddp"
    mode: Any = FakeTensorMode() if fake else _RealMode()
    device = torch.device("cpu")
    dtype = compute_dtype(job)
    task = build_task(job.task.name, job.task.kwargs)
    strategy = build_strategy(job.strategy, device, dtype)
    rows = micro_batch(job, size)
    batches = [fake_batch(source.sample, rows, mode) for _ in range(job.optim.grad_accum_steps)]
    # Built outside the fake mode: a factory that cannot run on meta is built for real.
    model = build_skeleton(job, source) if fake else _real_model(job, source)
    with mode:
        model = to_fake(model, device) if fake else model
        no_decay = no_decay_names(model)
    # fully_shard builds its device mesh from the process group: outside the fake mode
    # (the fake parameters still dispatch through it).
    with contextlib.nullcontext() if name == "fsdp2" else mode:
        model = strategy.wrap(model)
    if isinstance(job.strategy, DDPStrategyConfig) and job.strategy.comm_hook == "none":
        model.register_comm_hook(None, _bucket_as_is)  # type: ignore[operator]
    with mode:
        optimizer = build_optimizer(
            job.optim, model, no_decay, peak_lr(job.optim, job.data.batch_size)
        )
        precision = Precision(dtype, device, strategy)
        tracker: Any
        if name == "fsdp2":
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(batches)
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, *[t for b in batches for t in _leaves(b)])
        state: dict[str, int] = {}
        # An untracked first step: it creates the optimizer state and fills DTensor's
        # sharding caches, which a tracker would otherwise count once as optimizer memory.
        _step(job, model, optimizer, strategy, precision, task, batches, state)
        with tracker:
            for _ in range(2):
                _step(
                    job,
                    model,
                    optimizer,
                    strategy,
                    precision,
                    task,
                    batches,
                    state,
                    tracker.reset_mod_stats,
                )
        peak = _flatten(tracker.get_tracker_snapshot("peak"))
    return Tracked(name, size, peak=peak, model_state=state)


class _RealMode(contextlib.nullcontext):  # type: ignore[type-arg,unused-ignore]
    """Stands in for ``FakeTensorMode`` when a run uses real tensors."""

    @staticmethod
    def from_tensor(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


def _real_model(job: Job, source: ModelSource) -> nn.Module:
    model = build_raw(job, source.shape)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if 4 * size > REAL_TENSOR_LIMIT:  # parameters, gradients, buckets or shards, state
        raise UntrackableError(
            f"{job.strategy.name} runs on real tensors here, and {format_bytes(4 * size)} of "
            f"model state is more than {format_bytes(REAL_TENSOR_LIMIT)}"
        )
    return model


# No annotations on purpose: DDP checks them against its own classes, and this module's
# postponed (string) annotations would fail that check.
def _bucket_as_is(process_group, bucket):  # type: ignore[no-untyped-def,unused-ignore]
    future = torch.futures.Future()  # type: ignore[var-annotated]
    future.set_result(bucket.buffer())
    return future


def _step(
    job: Job,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: Any,
    precision: Any,
    task: Any,
    batches: list[tuple[Any, Any]],
    state: dict[str, int],
    after_micro_step: Any = None,
) -> None:
    """One optimizer step as ``convoy.engine.loop._optimizer_step`` takes it.
    ``after_micro_step``: called after each micro-batch's backward (the trackers follow
    one forward per module per iteration, so their module statistics are reset there)."""
    scale = 1.0 / (job.data.batch_size * 1.0)
    for i, (inputs, targets) in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else strategy.no_sync(model):
            with precision.autocast():
                outputs = task.forward(model, inputs)
                loss_sum = task.loss_sum(outputs, targets)
            precision.scaler.scale(loss_sum * scale).backward()
        if after_micro_step is not None:
            after_micro_step()
    state["grads"] = _local_bytes(p.grad for p in model.parameters())
    if job.optim.grad_clip_norm is not None:
        precision.scaler.unscale_(optimizer)
        strategy.clip_grad_norm(model, job.optim.grad_clip_norm)
    precision.scaler.step(optimizer)
    precision.scaler.update()
    state["params"] = _local_bytes(model.parameters())
    state["optimizer"] = _local_bytes(
        t for per_param in optimizer.state.values() for t in per_param.values()
    )
    optimizer.zero_grad(set_to_none=True)


def _local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: this rank's shard);
    0-d tensors (step counters) are left out, as the plan leaves them out."""
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

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


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _leaves(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _leaves(item)]
    return []


def _flatten(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """``{device: {category: bytes}}`` -> ``{category: bytes}`` summed over devices, with
    the categories' plain names and only the non-zero ones."""
    flat: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = str(getattr(key, "value", key))
            flat[name] = flat.get(name, 0) + value
    return {name: value for name, value in flat.items() if value or name == "Total"}


def _fsdp1_model_state(job: Job, source: ModelSource) -> dict[str, int]:
    """FSDP1's per-rank model state after one real step (no tracker can follow it)."""
    from convoy.engine.amp import Precision
    from convoy.engine.schedule import build_optimizer, no_decay_names, peak_lr
    from convoy.strategies import build_strategy
    from convoy.tasks import build_task

    device, dtype = torch.device("cpu"), compute_dtype(job)
    model = _real_model(job, source)
    no_decay = no_decay_names(model)
    strategy = build_strategy(job.strategy, device, dtype)
    model = strategy.wrap(model)
    optimizer = build_optimizer(job.optim, model, no_decay, peak_lr(job.optim, job.data.batch_size))
    rows = micro_batch(job, job.scaling.max_workers)
    batches = [
        fake_batch(source.sample, rows, _RealMode()) for _ in range(job.optim.grad_accum_steps)
    ]
    state: dict[str, int] = {}
    precision = Precision(dtype, device, strategy)
    _step(
        job,
        model,
        optimizer,
        strategy,
        precision,
        build_task(job.task.name, job.task.kwargs),
        batches,
        state,
    )
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
        return self.tracked.peak.get("Total") if self.tracked.peak else None

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
    job: Job, strategies: list[str], world_sizes: list[int], planner: Planner | None = None
) -> list[CheckRow]:
    """Plan and track every (strategy, world size) layout."""
    planner = planner or Planner(job)
    rows = []
    for size in world_sizes:
        for strategy in strategies:
            if strategy == "single" and size > 1:
                continue
            layout = planner.layout(strategy, size)
            try:
                tracked = track(job, strategy, size, planner.source)
            except UntrackableError as exc:
                tracked = Tracked(strategy, size, note=f"not tracked: {exc}")
            except Exception as exc:  # a tracker or a fake collective this layout trips on
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                tracked = Tracked(strategy, size, note=f"not tracked: {reason}")
            rows.append(CheckRow(layout, tracked))
    return rows


def format_check(rows: list[CheckRow]) -> str:
    """Planned vs tracked, per layout: model state, then the peak per category and the
    ratio planned / tracked."""
    header = ["layout", "what", *CATEGORIES, "total", "plan/tracked"]
    table: list[list[str]] = []
    notes: list[str] = []
    for row in rows:
        name = f"{row.layout.strategy} x {row.layout.world_size}"
        planned_state = [row.layout.params, row.layout.grads, row.layout.optimizer]
        state = row.tracked.model_state
        exact = "exact" if row.model_state_exact() else "DIFFERS"
        table.append([name, "state planned", *map(format_bytes, planned_state), "", "", "", "", ""])
        if state:
            measured = [state.get(k, 0) for k in ("params", "grads", "optimizer")]
            table.append(
                ["", "state measured", *map(format_bytes, measured), "", "", "", "", exact]
            )
        at_peak = row.layout.at_peak()
        table.append(
            [
                "",
                f"peak planned ({row.layout.peak_moment})",
                *(format_bytes(at_peak[c]) for c in CATEGORIES),
                format_bytes(row.layout.peak),
                "",
            ]
        )
        if row.tracked.peak:
            tracked = row.tracked_by_category()
            ratio = row.ratio or 0.0
            table.append(
                [
                    "",
                    "peak tracked",
                    *(format_bytes(tracked[c]) for c in CATEGORIES),
                    format_bytes(row.tracked_total or 0),
                    f"{ratio:.3f}",
                ]
            )
        if row.tracked.note:
            notes.append(f"{name}: {row.tracked.note}")
    lines = [format_table(header, table)]
    lines += [f"note: {note}" for note in notes]
    if any(row.layout.strategy == "ddp" for row in rows):
        lines.append(
            "note: MemTracker counts DDP's gradient buckets as activations; the plan shows them as comm"
        )
    return "\n".join(lines)


def check_to_dict(rows: list[CheckRow]) -> list[dict[str, Any]]:
    """Planned vs tracked as JSON-ready data."""
    return [
        {
            "strategy": row.layout.strategy,
            "world_size": row.layout.world_size,
            "planned_peak": row.layout.peak,
            "planned_at_peak": row.layout.at_peak(),
            "tracked_peak": row.tracked.peak,
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

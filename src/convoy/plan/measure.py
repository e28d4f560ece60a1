"""Measurements on fake tensors: one micro-batch's activations and backward transient
(``measure_activations``), and one optimizer step's state and transient
(``measure_optimizer``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from convoy.batches import tensors_in
from convoy.config import Job
from convoy.engine.schedule import make_optimizer
from convoy.plan.job import compute_dtype
from convoy.plan.model import ModelSource, build_skeleton, fake_batch, fake_process_group, to_fake
from convoy.strategies.blocks import checkpointed_blocks, prepare_blocks
from convoy.tasks import build_task


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
    recompute: int = 0
    """With checkpointed blocks: the backward transient at the moment that holds the most
    together with the parameters' gradients produced by then (a block recomputed late in
    backward, with most gradients in); may be negative (saved activations freed)."""
    recompute_grads: float = 0.0
    """The fraction of the parameters' gradients produced by that moment."""
    loss_in_model: bool = False
    """The model computes its loss in its forward (``Task.model_computes_loss``): the step
    holds no outputs, and the loss's own backward runs inside the model (under FSDP, with
    the root unsharded)."""


class _LiveBytes(TorchDispatchMode):
    """Follows the storages ops allocate (each counted once, until it is freed) and the
    most bytes live at once. ``forget`` stops counting a storage (a parameter's gradient)."""

    def __init__(self, skip: set[Any]) -> None:
        super().__init__()
        self.skip = skip
        self.live = 0
        self.peak = 0
        self.grads = 0
        """Bytes of the parameters' gradients ``forget`` has taken out so far."""
        self.peak_with_grads = 0
        self.grads_at_peak = 0
        self._sizes: dict[Any, int] = {}
        self._refs: dict[Any, weakref.ref[Any]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            key = StorageWeakRef(storage)
            if key in self.skip or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self._refs[key] = weakref.ref(storage, functools.partial(self._freed, key))
            self.live += self._sizes[key]
        self.peak = max(self.peak, self.live)
        if self.live + self.grads > self.peak_with_grads:
            self.peak_with_grads, self.grads_at_peak = self.live + self.grads, self.grads
        return out

    def _freed(self, key: Any, _ref: Any = None) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def forget(self, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            key = StorageWeakRef(tensor.untyped_storage())
            self.grads += self._sizes.get(key, 0)
            self._freed(key)


def measure_activations(
    job: Job, source: ModelSource, rows: int, cast_params: torch.dtype | None
) -> Activations:
    """Run the model and the task's loss on a fake micro-batch of ``rows`` samples and sum
    the storages autograd saves; then run backward and measure its transient (see
    ``Activations.backward``). ``cast_params``: the dtype FSDP computes in (its parameters
    are cast), or ``None`` for autocast (single/ddp) in the job's precision."""
    task = build_task(job.task.name, job.task.kwargs)
    mode = FakeTensorMode()
    inputs, targets, batch = _fake_micro_batch(source, rows, mode, cast_params)
    # Outside the fake mode: a real build may need values. Under tensor parallelism, one
    # rank's share: its heads and hidden units only.
    skeleton = build_skeleton(job, source, tp_share=True)
    if cast_params is not None:  # FSDP's MixedPrecision: parameters cast, no autocast
        skeleton = skeleton.to(cast_params)
    with mode:
        model = to_fake(skeleton, torch.device("cpu"))
        params = [p for p in model.parameters() if p.requires_grad]
        owned = {
            StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]
        }
        saved, pack = _saved_storages(model, job, owned)
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
            # The train step holds the outputs through backward, unless the model computes
            # its loss itself (``gpt``): then only what autograd saved stays.
            loss_in_model = task.model_computes_loss(model)
            held = () if loss_in_model else tensors_in(outputs)
            for out in held:
                saved[StorageWeakRef(out.untyped_storage())] = out.untyped_storage().nbytes()
            backward = _Backward()
            if loss.requires_grad:
                backward = _measure_backward(tracker, loss, outputs, params)
    return Activations(
        sum(saved.values()),
        max(saved.values(), default=0),
        backward.peak,
        backward.in_model,
        forward,
        backward.recompute if checkpointed_blocks(model) else 0,
        backward.recompute_grads if checkpointed_blocks(model) else 0.0,
        loss_in_model,
    )


def _saved_storages(
    model: nn.Module, job: Job, owned: set[Any]
) -> tuple[dict[Any, int], Callable[[torch.Tensor], torch.Tensor]]:
    """Where the storages autograd saves are summed (the parameters' and buffers', ``owned``,
    left out), and the pack hook that records them. Prepares the model's blocks as training
    does."""
    saved: dict[Any, int] = {}
    # A checkpointed block keeps only its input (its activations are recomputed in
    # backward, where the tracker sees them come and go).
    prepare_blocks(model, job.strategy, compile_mode=False)
    for block in checkpointed_blocks(model):
        block.register_forward_pre_hook(lambda _, args: _keep_inputs(args, saved, owned))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in owned:
            saved[ref] = tensor.untyped_storage().nbytes()
        return tensor

    return saved, pack


def _fake_micro_batch(
    source: ModelSource, rows: int, mode: FakeTensorMode, cast_params: torch.dtype | None
) -> tuple[Any, Any, int]:
    """Fake inputs and targets of ``rows`` samples, and the bytes the batch takes (with the
    floating-point inputs FSDP casts to ``cast_params``)."""
    inputs, targets = fake_batch(source.sample, rows, mode)
    batch = _storage_bytes([*tensors_in(inputs), *tensors_in(targets)])
    if cast_params is not None:  # FSDP casts floating-point inputs to its param dtype
        cast = _cast_floats(inputs, cast_params)
        batch += _storage_bytes([t for t in tensors_in(cast) if t.is_floating_point()])
        inputs = cast
    return inputs, targets, batch


@dataclass(frozen=True)
class _Backward:
    """What one backward adds, as ``Activations`` reports it (zero without a backward)."""

    peak: int = 0
    in_model: int = 0
    recompute: int = 0
    recompute_grads: float = 0.0


def _measure_backward(
    tracker: _LiveBytes, loss: torch.Tensor, outputs: Any, params: list[nn.Parameter]
) -> _Backward:
    """Run ``loss.backward()`` under ``tracker`` and read its transient: the whole of it, the
    part from the model's outputs on, and the moment with the most gradients in."""
    # Parameters' gradients are the plan's `grads`: each is counted as it is
    # produced (it is live then, with the activations), then left out.
    hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.forget(p.grad)) for p in params]
    start = tracker.peak = tracker.peak_with_grads = tracker.live
    tracker.grads = tracker.grads_at_peak = 0
    marks: list[int] = []

    def reached_model(grad: torch.Tensor) -> None:
        if not marks:  # the loss's backward is done: its peak, then the model's
            marks.append(tracker.peak)
            tracker.peak = tracker.live

    hooks += [out.register_hook(reached_model) for out in tensors_in(outputs) if out.requires_grad]
    loss.backward()
    backward = max(tracker.peak, *marks) - start
    in_model = tracker.peak - start if marks else backward
    for hook in hooks:
        hook.remove()
    return _Backward(
        peak=backward,
        in_model=in_model,
        recompute=tracker.peak_with_grads - tracker.grads_at_peak - start,
        recompute_grads=tracker.grads_at_peak / max(tracker.grads, 1),
    )


def _keep_inputs(args: Any, saved: dict[Any, int], owned: set[Any]) -> None:
    for tensor in tensors_in(args):
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in owned:
            saved[ref] = tensor.untyped_storage().nbytes()


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
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
    # Not optional, but it loads Dynamo (2-3 s): only a plan that measures pays it.
    from torch.distributed._tools.mem_tracker import MemTracker

    mode = FakeTensorMode()
    with fake_process_group(fsdp2_world_size or 1, needed=fsdp2_world_size is not None):
        with mode:
            holder = nn.ParameterList(nn.Parameter(torch.empty(shape)) for shape in shapes)
        if fsdp2_world_size is not None:
            # Outside the fake mode: it builds its device mesh. A CPU mesh: the parameters
            # are CPU ones, and the default mesh is the machine's accelerator where it has one.
            mesh = init_device_mesh("cpu", (fsdp2_world_size,))
            fully_shard(holder, mesh=mesh)
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
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _optimizer(job: Job, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    for group in groups:
        group["weight_decay"] = job.optim.weight_decay
    return make_optimizer(job.optim, groups, job.optim.lr)


def _category(snapshot: dict[Any, dict[Any, int]], name: str) -> int:
    """One category's bytes from a tracker snapshot, summed over devices."""
    return sum(
        value
        for per_device in snapshot.values()
        for key, value in per_device.items()
        if str(getattr(key, "value", key)) == name
    )

"""The one training step: what the loop runs each step, and what ``convoy plan --check`` runs
under torch's memory trackers (``convoy bench compare`` runs both).

``train_step`` takes this rank's micro-batches of one global batch (already on the device).
Each one runs forward and the task's loss *sum* (``no_sync`` on all but the last, so the
gradients are synchronized once), scaled by world size / the global batch's count, then
backward: after the strategy averages over the data-parallel ranks, the gradient is the mean
over every sample or token of the global batch, however it is split over ranks, micro-steps
and padding. Ranks of one tensor-parallel group read the same share; the first of them
counts it. Then
the gradients are unscaled and clipped if configured, the optimizer steps through the grad
scaler, the gradients are dropped and the LR schedule steps.

Callers watch the moments in between through ``StepHooks`` (the loop times forward and
updates its metrics; the memory check resets its trackers and measures the gradients)
instead of keeping a copy of the step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from convoy.config import DataParallelRank
from convoy.distributed import all_reduce_sum
from convoy.engine.amp import Precision
from convoy.strategies import Strategy
from convoy.tasks import Task


@dataclass
class StepParts:
    """What a step runs on: the wrapped model and everything built around it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    strategy: Strategy
    precision: Precision
    task: Task


class StepHooks:
    """The moments of a step a caller may watch; each does nothing unless overridden."""

    def forward(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """A context around micro-batch ``index``'s forward and loss (inside autocast)."""
        return contextlib.nullcontext()

    def micro_step_done(
        self, outputs: Any, targets: Any, loss_sum: torch.Tensor, count: torch.Tensor
    ) -> None:
        """After a micro-batch's backward, with its outputs and its detached loss sum."""

    def gradients_ready(self, model: nn.Module) -> None:
        """After the last backward, before clipping: the global batch's gradients are in."""


@dataclass(frozen=True)
class StepResult:
    loss_sum: torch.Tensor
    """This rank's loss sum over its micro-batches (detached); zero on a rank whose share
    another rank counts (``DataParallelRank.counts``), so a sum over ranks is exact."""
    global_count: torch.Tensor
    """What the loss is summed over in the whole global batch (every rank's samples or
    tokens)."""


def train_step(
    parts: StepParts,
    micro_batches: list[tuple[Any, Any]],
    share: DataParallelRank,
    grad_clip_norm: float | None,
    hooks: StepHooks | None = None,
) -> StepResult:
    """One optimizer step over ``micro_batches``, this rank's part of the share ``share`` of
    the global batch (see the module docstring)."""
    hooks = hooks or StepHooks()
    model, precision, task = parts.model, parts.precision, parts.task
    counts = [task.count(targets) for _, targets in micro_batches]
    count = global_count(task, counts, share)
    # The strategy averages gradients over the data-parallel ranks (the shares).
    scale = share.size / count
    total = torch.zeros((), device=parts.strategy.device)
    for i, (inputs, targets) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else parts.strategy.no_sync(model):
            with precision.autocast(), hooks.forward(i):
                outputs, loss_sum = task.forward_loss(model, inputs, targets)
            precision.scaler.scale(loss_sum * scale).backward()
        hooks.micro_step_done(outputs, targets, loss_sum.detach(), counts[i])
        total += loss_sum.detach()
    hooks.gradients_ready(model)
    _update_parameters(parts, grad_clip_norm)
    return StepResult(total if share.counts else torch.zeros_like(total), count)


def _update_parameters(parts: StepParts, grad_clip_norm: float | None) -> None:
    """Clip (on unscaled gradients), step, drop the gradients, step the LR schedule."""
    scaler = parts.precision.scaler
    if grad_clip_norm is not None:
        scaler.unscale_(parts.optimizer)
        parts.strategy.clip_grad_norm(parts.model, grad_clip_norm)
    scaler.step(parts.optimizer)
    scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()


def global_count(task: Task, counts: list[torch.Tensor], share: DataParallelRank) -> torch.Tensor:
    """The count of the whole global batch: every share's micro-batches, summed (each share
    once, however many ranks read it)."""
    local = torch.stack(counts).sum().double()
    if task.fixed_count:  # every share has the same batch shape: no communication needed
        return local * share.size
    counted = local if share.counts else torch.zeros_like(local)
    # At least 1: a global batch of padding only gives zero loss and zero gradients, not NaN.
    return all_reduce_sum(counted).clamp_min(1)

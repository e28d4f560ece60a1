"""The one train step (``convoy.engine.step``): the gradient it takes is the mean over the
global batch however it is split into micro-batches, it clips, steps the optimizer and the
LR schedule, and ``plan --check`` measures this step rather than a copy of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from convoy.config import DataParallelRank, load_job
from convoy.engine.amp import Precision
from convoy.engine.step import StepHooks, StepParts, train_step
from convoy.strategies import build_strategy
from convoy.tasks import build_task

ONE_RANK = DataParallelRank(0, 1, counts=True)


def _parts(lr: float = 0.1) -> StepParts:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    job = load_job(None, ["strategy.name=single", "scaling.num_workers=1"])
    strategy = build_strategy(job.strategy, torch.device("cpu"), torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return StepParts(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step),
        strategy=strategy,
        precision=Precision(torch.float32, torch.device("cpu"), strategy),
        task=build_task("classification", {}),
    )


class _Recorder(StepHooks):
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.grads: list[torch.Tensor] = []

    @contextlib.contextmanager
    def forward(self, index: int) -> Iterator[None]:
        self.events.append(("forward", index))
        yield

    def micro_step_done(
        self, outputs: Any, targets: Any, loss_sum: torch.Tensor, count: torch.Tensor
    ) -> None:
        self.events.append(("done", int(count)))

    def gradients_ready(self, model: nn.Module) -> None:
        self.events.append("gradients")
        self.grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_micro_batches_give_the_global_mean_gradient() -> None:
    inputs, targets = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    reference = _parts()
    nn.functional.cross_entropy(reference.model(inputs), targets).backward()
    expected = [p.grad.clone() for p in reference.model.parameters() if p.grad is not None]

    parts, hooks = _parts(), _Recorder()
    halves = [(inputs[:3], targets[:3]), (inputs[3:], targets[3:])]
    result = train_step(parts, halves, ONE_RANK, grad_clip_norm=None, hooks=hooks)

    assert hooks.events == [("forward", 0), ("done", 3), ("forward", 1), ("done", 3), "gradients"]
    for got, want in zip(hooks.grads, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert int(result.global_count) == 6
    torch.testing.assert_close(
        result.loss_sum,
        nn.functional.cross_entropy(reference.model(inputs), targets, reduction="sum"),
    )
    assert all(p.grad is None for p in parts.model.parameters())  # dropped after the step
    assert parts.scheduler.get_last_lr() == [pytest.approx(0.05)]  # the schedule stepped


def test_clipping_bounds_the_update() -> None:
    parts = _parts(lr=1.0)
    before = [p.detach().clone() for p in parts.model.parameters()]
    batch = (torch.randn(8, 4) * 100, torch.zeros(8, dtype=torch.long))
    train_step(parts, [batch], ONE_RANK, grad_clip_norm=1e-3)
    moved = torch.cat(
        [(p.detach() - b).flatten() for p, b in zip(parts.model.parameters(), before, strict=True)]
    )
    assert float(moved.norm()) == pytest.approx(1e-3, rel=1e-4)  # SGD: lr x the clipped norm


def test_plan_check_runs_the_shared_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import convoy.plan.check as check

    calls: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[1]))
        return train_step(*args, **kwargs)

    monkeypatch.setattr(check, "train_step", spy)
    job = load_job(
        "recipes/digits_mlp.yaml",
        ["model.name=mlp", "model.kwargs={hidden: 16, depth: 1}", "data.batch_size=8"],
    )
    peak = check.tracked_peak(job, "single", 1)
    assert calls == [1, 1, 1]  # one untracked step, then two tracked
    assert peak["Total"] > 0

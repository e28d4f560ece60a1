"""A task's metric names are known without building its torchmetrics, so the driver's checks
(``convoy train`` before any worker, ``convoy config show``, ``convoy plan``) never import
torchmetrics, which costs seconds of CPU a process (scipy, matplotlib, transformers where
installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from convoy.tasks import build_task
from convoy.tasks.base import Task

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

CASES = [
    ("classification", {"num_classes": 10}, {}),
    ("classification", {"num_classes": 3}, {}),
    ("regression", {"num_outputs": 1}, {}),
    ("language_modeling", {"vocab_size": 256}, {}),
    ("language_modeling", {"vocab_size": 256}, {"token_bytes": [1] * 256}),
]


@pytest.mark.parametrize(("name", "shape", "meta"), CASES)
def test_built_in_metric_names_are_the_keys_of_the_built_metrics(
    name: str, shape: dict[str, int], meta: dict[str, Any]
) -> None:
    task = build_task(name, {})
    assert task.metric_names(shape, meta) == set(task.metrics(shape, meta))


class Counting(Task):
    """A user's task that builds a metric and does not name it apart."""

    def loss_sum(self, outputs: Any, targets: Any) -> torch.Tensor:
        return outputs.sum()

    def count(self, targets: Any) -> torch.Tensor:
        return torch.tensor(len(targets))

    def metrics(self, shape: dict[str, int], meta: dict[str, Any]) -> dict[str, Any]:
        from torchmetrics import SumMetric

        return {"total": SumMetric()}


def test_a_task_that_names_no_metrics_is_asked_its_built_ones() -> None:
    assert Counting().metric_names({}, {}) == {"total"}
    assert "total" in Counting().reported({}, {})


def test_the_driver_s_checks_import_neither_torchmetrics_nor_dynamo(tmp_path: Path) -> None:
    """The driver checks a small model on real tensors: on the meta device PyTorch's Python
    decompositions import torch._dynamo (2.5 s of CPU before any worker starts)."""
    code = (
        "import sys\n"
        "from convoy.config import load_job\n"
        "from convoy.launchers import get_launcher\n"
        f"job = load_job({str(RECIPES / 'digits_mlp.yaml')!r}, "
        f"['scaling.launcher=torchrun', 'run.storage_dir={tmp_path}', "
        "'checkpoint.best_metric=val/acc'])\n"
        "checked, _ = get_launcher('torchrun').check(job)\n"
        # Ranking by a task metric: its name was asked of the task, its mode filled in.
        "assert checked.checkpoint.best_mode == 'max', checked.checkpoint\n"
        "print('torchmetrics' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    checked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == "False False"

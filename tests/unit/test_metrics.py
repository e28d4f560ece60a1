"""MetricsManager on one process: values match a hand computation, and compute() resets."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from convoy.metrics import MetricsManager

TARGET = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])
PRED = torch.tensor([0, 1, 2, 3, 4, 0, 1, 1])  # samples 5 and 6 wrong


def fixed_logits() -> torch.Tensor:
    """Six classes: argmax is PRED; the true class of sample 5 is ranked last, of sample 6 second."""
    logits = torch.zeros(8, 6)
    logits[torch.arange(8), PRED] = 3.0
    logits[5, 5] = -1.0  # outside the top 5
    logits[6, 0] = 2.0  # inside the top 5
    return logits


@pytest.mark.parametrize(
    "cuts",
    [
        (8,),
        (7, 8),  # the first batch has a top-5-only hit (sample 6)
        # No top-5-only hit in the first batch: top5's state then equals f1's, and torchmetrics'
        # compute groups (disabled in convoy/metrics.py) would merge them into top-1 accuracy.
        (5, 8),
    ],
)
def test_metrics_match_a_hand_computation(cuts: tuple[int, ...]) -> None:
    manager = MetricsManager(num_classes=6, device=torch.device("cpu"))
    logits = fixed_logits()
    for start, stop in itertools.pairwise((0, *cuts)):  # batches accumulate
        manager.update("val", logits[start:stop], TARGET[start:stop])
    values = manager.compute("val")
    # per-class F1 = 2tp / (2tp + fp + fn): class 0: 2/4, class 1: 4/5, 2-4: 1, class 5: 0
    f1 = (0.5 + 0.8 + 1 + 1 + 1 + 0) / 6
    assert values["val/acc"] == pytest.approx(6 / 8)
    assert values["val/top5"] == pytest.approx(7 / 8)
    assert values["val/f1"] == pytest.approx(f1)
    assert values["val/samples"] == 8
    assert isinstance(values["val/samples"], int)
    expected_loss = F.cross_entropy(logits.double(), TARGET).item()
    assert values["val/loss"] == pytest.approx(expected_loss, rel=1e-12)
    assert set(values) == {f"val/{k}" for k in ("loss", "samples", "acc", "f1", "top5")}


def test_loss_is_accumulated_in_float64() -> None:
    manager = MetricsManager(num_classes=10, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 10, generator=generator) * 5
    target = torch.randint(0, 10, (4000,), generator=generator)
    for chunk in range(0, 4000, 100):
        manager.update("train", logits[chunk : chunk + 100], target[chunk : chunk + 100])
    expected = F.cross_entropy(logits.double(), target).item()
    assert manager.compute("train")["train/loss"] == pytest.approx(expected, rel=1e-12)


def test_compute_resets_the_split_and_splits_are_independent() -> None:
    manager = MetricsManager(num_classes=6, device=torch.device("cpu"))
    logits = fixed_logits()
    manager.update("train", logits, TARGET)
    manager.update("test", logits[:2], TARGET[:2])
    assert manager.compute("train")["train/samples"] == 8
    manager.update("train", logits[5:7], TARGET[5:7])  # both wrong
    after = manager.compute("train")
    assert after["train/samples"] == 2
    assert after["train/acc"] == 0.0
    assert after["train/loss"] == pytest.approx(F.cross_entropy(logits[5:7], TARGET[5:7]).item())
    test = manager.compute("test")
    assert (test["test/samples"], test["test/acc"]) == (2, 1.0)


def test_top5_only_with_more_than_five_classes() -> None:
    manager = MetricsManager(num_classes=3, device=torch.device("cpu"))
    manager.update("val", torch.eye(3), torch.arange(3))
    values = manager.compute("val")
    assert "val/top5" not in values
    assert (values["val/acc"], values["val/f1"], values["val/samples"]) == (1.0, 1.0, 3)

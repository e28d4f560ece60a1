"""MetricsManager on one process: values match a hand computation, and compute() resets."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from convoy.metrics import MetricsManager
from convoy.tasks import Classification, LanguageModeling, Regression

CPU = torch.device("cpu")


def classification_metrics(num_classes: int) -> MetricsManager:
    return MetricsManager(Classification(), {"num_classes": num_classes}, CPU)


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
    manager = classification_metrics(6)
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
    assert values["val/loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert set(values) == {f"val/{k}" for k in ("loss", "samples", "acc", "f1", "top5")}


def test_loss_is_accumulated_in_float64() -> None:
    manager = classification_metrics(10)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 10, generator=generator) * 5
    target = torch.randint(0, 10, (4000,), generator=generator)
    for chunk in range(0, 4000, 100):
        manager.update("train", logits[chunk : chunk + 100], target[chunk : chunk + 100])
    expected = F.cross_entropy(logits.double(), target).item()
    # Each batch's sum is float32 (as in training); the running sum over batches is float64.
    assert manager.compute("train")["train/loss"] == pytest.approx(expected, rel=1e-6)


def test_compute_resets_the_split_and_splits_are_independent() -> None:
    manager = classification_metrics(6)
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
    manager = classification_metrics(3)
    manager.update("val", torch.eye(3), torch.arange(3))
    values = manager.compute("val")
    assert "val/top5" not in values
    assert (values["val/acc"], values["val/f1"], values["val/samples"]) == (1.0, 1.0, 3)


def test_language_modeling_weights_by_real_tokens_and_reports_bits_per_byte() -> None:
    """Two sequences, one half padding: the mean is over the 6 real tokens, not 8 positions."""
    token_bytes = [1, 2, 3, 4]
    manager = MetricsManager(
        LanguageModeling(), {"vocab_size": 4}, CPU, {"token_bytes": token_bytes}
    )
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 4, generator=generator)
    targets = torch.tensor([[1, 2, 3, 0], [3, 1, -100, -100]])
    manager.update("val", logits[:1], targets[:1])
    manager.update("val", logits[1:], targets[1:])
    values = manager.compute("val")
    real = targets != -100
    nats = F.cross_entropy(logits[real].double(), targets[real], reduction="sum").item()
    assert values["val/tokens"] == 6
    assert values["val/samples"] == 2
    assert values["val/loss"] == pytest.approx(nats / 6, rel=1e-6)
    assert values["val/ppl"] == pytest.approx(math.exp(nats / 6), rel=1e-6)
    covered = sum(token_bytes[t] for t in targets[real].tolist())  # 2+3+4+1 + 4+2 = 16
    assert values["val/bpb"] == pytest.approx(nats / math.log(2) / covered, rel=1e-6)


def test_regression_reports_mse_mae_rmse_and_r2() -> None:
    manager = MetricsManager(Regression(), {"num_features": 3, "num_outputs": 1}, CPU)
    predictions = torch.tensor([[1.0], [2.0], [2.5], [5.0]])  # (N, 1) against (N,) targets
    targets = torch.tensor([1.5, 2.0, 3.5, 4.0])
    manager.update("test", predictions[:3], targets[:3])
    manager.update("test", predictions[3:], targets[3:])
    values = manager.compute("test")
    errors = predictions.squeeze(1) - targets
    mse = errors.pow(2).mean().item()
    r2 = 1 - errors.pow(2).sum() / (targets - targets.mean()).pow(2).sum()
    assert values["test/loss"] == pytest.approx(mse)
    assert values["test/rmse"] == pytest.approx(math.sqrt(mse))
    assert values["test/mae"] == pytest.approx(errors.abs().mean().item())
    assert values["test/r2"] == pytest.approx(r2.item(), rel=1e-6)
    assert values["test/samples"] == 4


def test_built_in_metrics_equal_scikit_learn_s() -> None:
    """Convoy's sum-state metrics against scikit-learn on random data, batched."""
    from sklearn.metrics import accuracy_score, f1_score, mean_absolute_error, r2_score

    from convoy.tasks.metrics import MacroF1, MeanAbsoluteError, R2Score, TopKAccuracy

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 9, generator=generator)
    labels = torch.randint(0, 8, (300,), generator=generator)  # class 8 never a label
    accuracy, f1, top3 = TopKAccuracy(), MacroF1(9), TopKAccuracy(k=3)
    for chunk in range(0, 300, 70):
        for metric in (accuracy, f1, top3):
            metric.update(logits[chunk : chunk + 70], labels[chunk : chunk + 70])
    predicted = logits.argmax(1)
    seen = sorted(set(labels.tolist()) | set(predicted.tolist()))
    assert float(accuracy.compute()) == pytest.approx(accuracy_score(labels, predicted))
    assert float(f1.compute()) == pytest.approx(
        f1_score(labels, predicted, average="macro", labels=seen)
    )
    in_top3 = (logits.topk(3, dim=1).indices == labels[:, None]).any(1).double().mean()
    assert float(top3.compute()) == pytest.approx(float(in_top3))

    targets = torch.randn(200, 3, generator=generator) * 10 + 100  # a large mean: TSS's digits
    predictions = targets + torch.randn(200, 3, generator=generator)
    mae, r2 = MeanAbsoluteError(), R2Score(num_outputs=3)
    for chunk in range(0, 200, 64):
        mae.update(predictions[chunk : chunk + 64], targets[chunk : chunk + 64])
        r2.update(predictions[chunk : chunk + 64], targets[chunk : chunk + 64])
    assert float(mae.compute()) == pytest.approx(mean_absolute_error(targets, predictions))
    expected = r2_score(targets.double(), predictions.double())  # float64, as ours
    assert float(r2.compute()) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="shape\\['num_outputs'\\]"):
        R2Score(num_outputs=2).update(predictions, targets)

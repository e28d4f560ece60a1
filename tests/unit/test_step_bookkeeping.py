"""A step's bookkeeping costs microseconds and changes nothing: metric inputs updated in
batches give the metrics of one update a step; whole batches fetched at once are the batches
collated a sample at a time; heartbeats reach the board from a thread; the step clock reads
each step once."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from convoy.data.base import Collated, TensorImageDataset, collate
from convoy.data.text import PackedSequences
from convoy.engine.heartbeat import Heartbeat, HeartbeatBoard
from convoy.engine.monitor import ForwardTimer, StepClock
from convoy.metrics import PENDING_BYTES, PENDING_STEPS, MetricsManager, PendingInputs
from convoy.tasks import Classification, LanguageModeling, Regression

CPU = torch.device("cpu")


def _steps(
    seed: int, count: int, rows: int = 16, classes: int = 7
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(rows, classes, generator=generator),
            torch.randint(0, classes, (rows,), generator=generator),
        )
        for _ in range(count)
    ]


def _one_update_a_step(task, shape, steps) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The reference: every metric updated once per step, as torchmetrics is used by hand."""
    manager = MetricsManager(task, shape, CPU)
    split = manager.splits["train"]
    for outputs, targets in steps:
        loss = task.loss_sum(outputs, targets)
        split.loss.update(loss, task.count(targets))
        split.rows.update(len(targets))
        split.collection.update(*task.metric_inputs(outputs, targets))
    values = {"loss": float(split.loss.compute()["loss"]), "samples": int(split.rows.compute())}
    values |= {k: float(v) for k, v in split.collection.compute().items()}
    return values


def _regression_steps(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 1, generator=generator), torch.randn(8, 1, generator=generator))
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("task", "shape", "steps", "rel"),
    [
        # Classification's states are counts: exactly equal, whatever the batching.
        *[
            (Classification(), {"num_classes": 7}, _steps(0, n), 0.0)
            for n in (1, 5, PENDING_STEPS + 3)
        ],
        # Regression's are float32 sums: equal to their rounding.
        (Regression(), {"num_outputs": 1}, _regression_steps(9), 1e-6),
    ],
)
def test_batched_metric_updates_equal_one_update_a_step(task, shape, steps, rel) -> None:  # type: ignore[no-untyped-def]
    manager = MetricsManager(task, shape, CPU)
    for outputs, targets in steps:
        manager.update("train", outputs, targets)
    got = manager.compute("train")
    want = _one_update_a_step(task, shape, steps)
    for key, value in want.items():
        assert got[f"train/{key}"] == pytest.approx(value, rel=rel, abs=0), key


class _Recorder:
    """A stand-in collection that records what each update received."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def update(self, *inputs: object) -> None:
        self.calls.append(inputs)


def test_pending_inputs_hold_a_bounded_amount_and_keep_order() -> None:
    recorder = _Recorder()
    pending = PendingInputs(recorder)  # type: ignore[arg-type]
    small = (torch.zeros(4, 3), torch.arange(4))
    for _ in range(PENDING_STEPS - 1):
        pending.add(small)
    assert recorder.calls == []  # held back
    pending.add(small)
    assert len(recorder.calls) == 1 and recorder.calls[0][0].shape == (4 * PENDING_STEPS, 3)
    # A step larger than the bound goes at once, after what was held (order kept).
    pending.add((torch.ones(2, 3), torch.arange(2)))
    big = torch.zeros(PENDING_BYTES // 4 + 1)
    pending.add((big, big))
    assert [call[0].shape[0] for call in recorder.calls[1:]] == [2, len(big)]
    # Steps that cannot be concatenated (other trailing shapes) are updated one by one.
    pending.add((torch.zeros(2, 3), torch.arange(2)))
    pending.add((torch.zeros(2, 5), torch.arange(2)))
    pending.flush()
    assert [tuple(call[0].shape) for call in recorder.calls[3:]] == [(2, 3), (2, 5)]


def test_language_modeling_metrics_hold_no_logits() -> None:
    task = LanguageModeling()
    manager = MetricsManager(task, {"vocab_size": 5}, CPU, meta={"token_bytes": [1, 2, 3, 1, 1]})
    targets = torch.tensor([[0, 1, -100], [2, 3, 4]])
    manager.update("train", torch.randn(2, 3, 5), targets)
    assert manager.splits["train"].pending.items[0][0] is None
    values = manager.compute("train")
    assert values["train/bytes"] == 1 + 2 + 3 + 1 + 1  # padding (-100) covers no bytes


def test_a_whole_batch_equals_samples_collated_one_by_one() -> None:
    images = torch.randint(0, 17, (40, 1, 8, 8)).float()
    labels = torch.randint(0, 10, (40,))
    for crop, flip in ((0, False), (2, True)):
        dataset = TensorImageDataset(images, labels, (0.3,), (0.2,), 1 / 16, crop, flip)
        indices = list(range(0, 40, 3))
        torch.manual_seed(5)
        one_by_one = default_collate([dataset[i] for i in indices])
        torch.manual_seed(5)  # the augmentation draws in the same order
        whole = collate(dataset.__getitems__(indices))
        assert all(
            torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(one_by_one, whole, strict=True)
        )


@pytest.mark.parametrize("tokens", [2, 50, 129, 257])
def test_packed_sequences_as_a_whole_batch(tokens: int) -> None:
    dataset = PackedSequences(torch.randint(0, 300, (tokens,), dtype=torch.int32), 128)
    indices = [*range(len(dataset)), -1]
    one_by_one = default_collate([dataset[i] for i in indices])
    whole = collate(dataset.__getitems__(indices))
    assert all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(one_by_one, whole, strict=True)
    )
    with pytest.raises(IndexError):
        dataset.__getitems__([len(dataset)])


def test_the_data_loader_takes_whole_batches() -> None:
    dataset = TensorImageDataset(torch.zeros(10, 1, 2, 2), torch.arange(10))
    batches = list(DataLoader(dataset, batch_size=4, collate_fn=collate))  # type: ignore[arg-type]
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert not isinstance(batches[0], Collated) and torch.equal(batches[0][1], torch.arange(4))


def test_a_beat_reaches_the_board_from_the_publishing_thread() -> None:
    board = HeartbeatBoard()
    heartbeat = Heartbeat(board, rank=0, publish_every_s=0.01)
    heartbeat.beat(3, 2)
    heartbeat.start()
    try:
        assert board.read(1)[0]["started"] == 3  # published at start
        heartbeat.beat(4, 4)
        assert board.read(1)[0]["started"] == 3  # a beat itself writes nothing
        deadline = time.monotonic() + 10
        while board.read(1)[0]["started"] != 4:
            assert time.monotonic() < deadline, "the thread never published the new beat"
            time.sleep(0.01)
        assert board.read(1)[0]["finished"] == 4
    finally:
        heartbeat.stop()


def test_the_step_clock_reads_each_step_once_less_its_discount() -> None:
    clock = StepClock(CPU)
    clock.start()
    clock.end(0.5)
    clock.start()
    clock.end(2.0, discount=1.5)  # 1.5 s of it compiling
    assert clock.resolve() == [0.5, 0.5]
    assert clock.resolve() == []
    timer = ForwardTimer(CPU)
    with timer:
        pass
    timer.discount = 10.0
    assert timer.seconds() == 0.0

"""The event stream's control logic: dispatch, failing sinks, borrowed sinks, straggler
detection, the progress log's straggler lines, and the Ray report sink's ordering."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest

from convoy.config import MonitorConfig
from convoy.engine.events import (
    EndEvent,
    EpochEvent,
    EventBus,
    MessageEvent,
    RankStats,
    Sink,
    StepEvent,
    StragglerEvent,
)
from convoy.engine.monitor import find_stragglers
from convoy.engine.progress import Progress
from convoy.engine.sinks import ProgressSink


class Recorder(Sink):
    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.closed = False

    def on_epoch(self, event: EpochEvent) -> None:
        self.seen.append(f"epoch {event.epoch}")

    def on_message(self, event: MessageEvent) -> None:
        self.seen.append(event.text)

    def close(self) -> None:
        self.closed = True


class Broken(Sink):
    name = "broken"

    def on_epoch(self, event: EpochEvent) -> None:
        raise ConnectionError("server went away")


def epoch(n: int) -> EpochEvent:
    return EpochEvent(epoch=n, epochs=3, step=10 * n, metrics={"train/loss": 1.0 / n}, seconds=1.0)


def stats(local: list[float]) -> RankStats:
    n = len(local)
    return RankStats([0.1] * n, [0.001] * n, local, [1] * n)


def step(n: int, local: list[float]) -> StepEvent:
    return StepEvent(
        step=n, epoch=1, loss=1.0, lr=0.1, ranks=stats(local), samples_per_second=100.0
    )


def test_a_failing_sink_is_switched_off_once_and_the_others_keep_everything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    kept = Recorder()
    bus = EventBus([Broken(), kept])
    for n in (1, 2, 3):
        bus.emit(epoch(n))
    assert kept.seen == ["epoch 1", "epoch 2", "epoch 3"]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1
    assert "broken sink is off" in said[0] and "ConnectionError: server went away" in said[0]


def test_a_required_sink_failure_stops_the_run() -> None:
    class RequiredBroken(Broken):
        required = True

    with pytest.raises(ConnectionError):
        EventBus([RequiredBroken()]).emit(epoch(1))


def test_borrowed_sinks_get_events_but_are_closed_by_their_owner() -> None:
    own, borrowed = Recorder(), Recorder()
    bus = EventBus([own], borrowed=(borrowed,))
    bus.emit(epoch(1))
    bus.message("hello")
    bus.close()
    assert own.seen == borrowed.seen == ["epoch 1", "hello"]
    assert own.closed and not borrowed.closed


def test_stragglers_are_ranks_slower_than_the_others_median_by_the_margin() -> None:
    cfg = MonitorConfig(straggler_margin=0.25, straggler_min_seconds=0.002)
    found = find_stragglers(7, stats([0.010, 0.011, 0.030, 0.010]), cfg)
    assert [(s.rank, s.step) for s in found] == [(2, 7)]
    assert found[0].median_seconds == pytest.approx(0.010)
    assert found[0].slower_by == pytest.approx(2.0)
    # Two ranks: the reference is the other rank, so a 2x slower rank is named.
    assert [s.rank for s in find_stragglers(1, stats([0.010, 0.020]), cfg)] == [1]
    # Within the margin, or within the absolute floor: nobody.
    assert find_stragglers(1, stats([0.010, 0.012]), cfg) == []
    assert find_stragglers(1, stats([0.0010, 0.0025]), cfg) == []
    assert find_stragglers(1, stats([0.010]), cfg) == []


def test_the_log_names_a_straggler_when_it_appears_and_when_it_recovers() -> None:
    out = io.StringIO()
    sink = ProgressSink(Progress(100, "plain", True, stream=out))
    bus = EventBus([sink])
    slow = StragglerEvent(step=0, rank=1, seconds=0.03, median_seconds=0.01, data_wait_seconds=0)
    for n, straggling in ((10, True), (20, True), (30, False), (40, False)):
        bus.emit(step(n, [0.01, 0.03 if straggling else 0.01]))
        if straggling:
            bus.emit(StragglerEvent(n, 1, slow.seconds, slow.median_seconds, 0.0))
    lines = [line for line in out.getvalue().splitlines() if "straggler" in line]
    assert len(lines) == 2, out.getvalue()
    assert "straggler at step 10: rank 1" in lines[0] and "200% slower" in lines[0]
    assert "rank 1 is no longer a straggler at step 30" in lines[1]


class HeldReports:
    """``ray.train.report`` as Ray behaves: each call held until its controller polls."""

    def __init__(self) -> None:
        self.polls = threading.Semaphore(0)
        self.reported: list[dict[str, Any]] = []

    def report(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        self.polls.acquire()
        self.reported.append({**metrics, "checkpoint": kwargs.get("checkpoint")})


def in_thread(call: Any) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> tuple[HeldReports, Any]:
    """A report sink over a ``ray.train.report`` that holds each call until released."""
    ray_train = pytest.importorskip("ray.train")
    from convoy.integrations.ray_train import RayTrainReportSink

    ray = HeldReports()
    monkeypatch.setattr(ray_train, "report", ray.report)
    return ray, RayTrainReportSink()


def test_ray_reports_leave_the_loop_at_once_and_reach_ray_in_order(
    held: tuple[HeldReports, Any],
) -> None:
    ray, sink = held
    sink.on_epoch(epoch(1))  # returned although Ray holds the report
    assert ray.reported == []
    ray.polls.release()
    checkpoint = in_thread(lambda: sink.report_checkpoint({"val/loss": 0.5}, "ckpt-1"))
    checkpoint.join(timeout=0.2)
    assert checkpoint.is_alive()  # a commit goes on only once Ray holds its report
    ray.polls.release()
    checkpoint.join()
    assert [r["checkpoint"] for r in ray.reported] == [None, "ckpt-1"]
    for _ in range(2):
        ray.polls.release()
    sink.on_epoch(epoch(2))
    sink.finish({"test/acc": 0.9})
    assert [(r["epoch"], r["checkpoint"]) for r in ray.reported] == [
        (1, None),
        (1, "ckpt-1"),
        (2, None),
        (2, None),
    ]
    assert ray.reported[-1]["done"] is True and ray.reported[-1]["test/acc"] == 0.9


def test_the_loop_runs_at_most_one_epoch_report_ahead_of_ray(
    held: tuple[HeldReports, Any],
) -> None:
    ray, sink = held
    sink.on_epoch(epoch(1))
    second = in_thread(lambda: sink.on_epoch(epoch(2)))
    second.join(timeout=0.2)
    assert second.is_alive()  # epoch 1's report is still held: epoch 2 waits for it
    for _ in range(3):
        ray.polls.release()
    second.join()
    sink.finish({})
    assert [r["epoch"] for r in ray.reported] == [1, 2, 2]


def test_a_failed_ray_report_is_raised_on_the_training_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray_train = pytest.importorskip("ray.train")
    from convoy.integrations.ray_train import RayTrainReportSink

    def failing(metrics: dict[str, Any], **kwargs: Any) -> None:
        raise RuntimeError("controller gone")

    monkeypatch.setattr(ray_train, "report", failing)
    sink = RayTrainReportSink()
    sink.on_epoch(epoch(1))
    with pytest.raises(RuntimeError, match="controller gone"):
        sink.close()


def test_end_event_reaches_sinks_with_the_summary() -> None:
    class Ends(Sink):
        summary: dict[str, Any] = {}

        def on_end(self, event: EndEvent) -> None:
            Ends.summary = event.summary

    EventBus([Ends()]).emit(EndEvent({"steps": 3}))
    assert Ends.summary == {"steps": 3}


def test_a_straggler_is_named_after_warm_up_once_it_persists() -> None:
    from convoy.engine.monitor import StragglerWatch

    watch = StragglerWatch(MonitorConfig(straggler_patience=2))
    slow, even = stats([0.010, 0.040]), stats([0.010, 0.010])
    assert watch.check(10, slow) == []  # first batches, thread pools: warm-up
    assert watch.check(20, slow) == []  # once over the margin: a busy core, maybe
    assert [s.rank for s in watch.check(30, slow)] == [1]  # twice in a row: named
    assert [s.rank for s in watch.check(40, slow)] == [1]
    assert watch.check(50, even) == []
    assert watch.check(60, slow) == []  # the streak starts again

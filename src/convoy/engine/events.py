"""The loop's event stream: typed events out, sinks subscribed.

The training loop (and the Lightning entry) emit one event per logged step, finished epoch,
evaluation, committed checkpoint, named straggler and the end of the run. Every rank emits the
same events in the same order (a Ray Train report is a barrier, so its sink must see them on
every rank); the sinks that write files are built on rank 0 only.

A sink implements the ``on_<kind>`` methods it cares about. Adding a sink never touches the
loop: ``convoy.engine.sinks.build_sinks`` assembles them from the job, and a launcher adds its
own through ``WorkerContext.sinks``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class StartEvent:
    """The run is built and about to train; ``header`` is the one-line description."""

    kind: ClassVar[str] = "start"
    job: dict[str, Any]
    """The resolved recipe (``Job.model_dump(mode="json")``)."""
    run_uri: str
    world_size: int
    total_steps: int
    header: str


@dataclass(frozen=True)
class StepEvent:
    """A logged step (every ``run.log_every_steps``): the exact mean loss over all ranks, and
    every rank's figures since the previous logged step."""

    kind: ClassVar[str] = "step"
    step: int
    epoch: int
    """1-based: the epoch this step belongs to."""
    loss: float
    lr: float
    ranks: RankStats
    samples_per_second: float
    """Global, over the interval since the previous logged step (the slowest rank's pace)."""
    tflops: float | None = None
    mfu: float | None = None
    rate: tuple[float, str] = (0.0, "samples")
    """Run-average throughput in the task's unit: (per second, unit name)."""
    throughput_text: str = ""
    """Achieved FLOP/s and MFU as the progress line shows them."""

    def record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` record of this step."""
        return {
            "kind": "step",
            "step": self.step,
            "epoch": self.epoch,
            "train/loss": self.loss,
            "lr": self.lr,
            **self.ranks.record(),
            "samples_per_second": self.samples_per_second,
            "tflops": self.tflops,
            "mfu": self.mfu,
        }


@dataclass(frozen=True)
class RankStats:
    """Per-rank means since the previous logged step, one entry per rank (index = rank)."""

    step_seconds: list[float]
    data_wait_seconds: list[float]
    local_seconds: list[float]
    """Work that waits on no other rank: data wait + forward (single, ddp)."""
    memory_bytes: list[int]
    """Peak allocated device memory (CPU: the process's peak RSS)."""

    def record(self) -> dict[str, Any]:
        return {
            "rank_step_seconds": self.step_seconds,
            "rank_data_wait_seconds": self.data_wait_seconds,
            "rank_local_seconds": self.local_seconds,
            "rank_memory_bytes": self.memory_bytes,
        }


@dataclass(frozen=True)
class EpochEvent:
    """A finished epoch: its train metrics and, when evaluated, the val metrics."""

    kind: ClassVar[str] = "epoch"
    epoch: int
    """1-based."""
    epochs: int
    step: int
    metrics: dict[str, float]
    seconds: float

    def record(self) -> dict[str, Any]:
        return {"kind": "epoch", "epoch": self.epoch, "step": self.step, **self.metrics}


@dataclass(frozen=True)
class EvalEvent:
    """An evaluation of one split (``val`` after epochs, ``test`` at the end)."""

    kind: ClassVar[str] = "eval"
    split: str
    step: int
    epoch: int
    metrics: dict[str, float]

    def record(self) -> dict[str, Any]:
        return {"kind": self.split, "step": self.step, **self.metrics}


@dataclass(frozen=True)
class CheckpointEvent:
    """A committed checkpoint (path relative to the run directory)."""

    kind: ClassVar[str] = "checkpoint"
    step: int
    epoch: int
    path: str
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StragglerEvent:
    """A rank whose local work per step exceeds the other ranks' median by the margin."""

    kind: ClassVar[str] = "straggler"
    step: int
    rank: int
    seconds: float
    """The rank's local work per step (data wait + forward)."""
    median_seconds: float
    data_wait_seconds: float

    @property
    def slower_by(self) -> float:
        """How much slower than the median, as a fraction (0.5 = 50% slower)."""
        return self.seconds / max(self.median_seconds, 1e-12) - 1

    def message(self) -> str:
        return (
            f"convoy: straggler at step {self.step}: rank {self.rank} takes "
            f"{1e3 * self.seconds:.1f} ms of local work per step (data wait "
            f"{1e3 * self.data_wait_seconds:.1f} ms + forward) against the other ranks' "
            f"median {1e3 * self.median_seconds:.1f} ms: {100 * self.slower_by:.0f}% slower"
        )

    def record(self) -> dict[str, Any]:
        return {
            "kind": "straggler",
            "step": self.step,
            "rank": self.rank,
            "local_seconds": self.seconds,
            "median_local_seconds": self.median_seconds,
            "data_wait_seconds": self.data_wait_seconds,
            "slower_by": self.slower_by,
        }


@dataclass(frozen=True)
class MessageEvent:
    """A line for the run log (resumed from..., skipped records, FLOPs not counted)."""

    kind: ClassVar[str] = "message"
    text: str


@dataclass(frozen=True)
class EndEvent:
    """The run finished; ``summary`` is what ``summary.json`` holds."""

    kind: ClassVar[str] = "end"
    summary: dict[str, Any]


Event = (
    StartEvent
    | StepEvent
    | EpochEvent
    | EvalEvent
    | CheckpointEvent
    | StragglerEvent
    | MessageEvent
    | EndEvent
)


class Sink:
    """Receives events; override the ``on_<kind>`` methods wanted and ``close``.

    ``required`` sinks (``metrics.jsonl``) stop the run when they fail; any other sink that
    raises is switched off with one line saying why, and the run goes on.
    """

    name: ClassVar[str] = "sink"
    required: ClassVar[bool] = False

    def on_start(self, event: StartEvent) -> None: ...
    def on_step(self, event: StepEvent) -> None: ...
    def on_epoch(self, event: EpochEvent) -> None: ...
    def on_eval(self, event: EvalEvent) -> None: ...
    def on_checkpoint(self, event: CheckpointEvent) -> None: ...
    def on_straggler(self, event: StragglerEvent) -> None: ...
    def on_message(self, event: MessageEvent) -> None: ...
    def on_end(self, event: EndEvent) -> None: ...

    def close(self) -> None:
        """Flush and release; called once after ``end`` (or when the run fails)."""


class EventBus:
    """Hands every event to every sink, in the order the sinks were given.

    ``borrowed`` sinks (a launcher's) get every event but are closed by their owner.
    """

    def __init__(
        self, sinks: list[Sink] | tuple[Sink, ...] = (), borrowed: tuple[Sink, ...] = ()
    ) -> None:
        self.sinks: list[Sink] = [*sinks, *borrowed]
        self.borrowed = borrowed

    def emit(self, event: Event) -> None:
        for sink in list(self.sinks):
            handler = getattr(sink, f"on_{event.kind}")
            self._guarded(sink, handler, event)

    def message(self, text: str) -> None:
        self.emit(MessageEvent(text))

    def close(self) -> None:
        for sink in list(self.sinks):
            if not any(sink is other for other in self.borrowed):
                self._guarded(sink, sink.close)
        self.sinks = []

    def _guarded(self, sink: Sink, call: Any, *args: Any) -> None:
        if sink.required:
            call(*args)
            return
        try:
            call(*args)
        except Exception as exc:  # a tracking sink must never stop training
            self.sinks.remove(sink)
            print(
                f"convoy: the {sink.name} sink is off for the rest of the run "
                f"({type(exc).__name__}: {_first_line(exc)}); metrics.jsonl keeps every record",
                file=sys.stderr,
                flush=True,
            )


def _first_line(error: BaseException, limit: int = 200) -> str:
    """An error's first line, cut to ``limit`` characters (HTTP errors carry whole pages)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."

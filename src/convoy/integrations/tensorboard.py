"""The TensorBoard sink: event files under ``<run>/tensorboard/`` (rank 0).

Scalars per logged step (train loss, lr, throughput, per-rank step time, data wait and
memory), per epoch (every train and val metric) and at the end (test metrics), all against
the optimizer step; the resolved recipe as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from convoy.config import Job
from convoy.distributed import WorkerContext
from convoy.engine.events import (
    EpochEvent,
    EvalEvent,
    Sink,
    StartEvent,
    StepEvent,
    StragglerEvent,
)
from convoy.engine.sinks import SinkUnavailable
from convoy.storage import RunStorage

TENSORBOARD_DIR = "tensorboard"


def build(job: Job, ctx: WorkerContext) -> Sink:
    """A TensorBoard sink writing into the run directory (local runs; S3 runs stage locally)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise SinkUnavailable(
            f"TensorBoard is not installed ({exc}); pip install 'convoy[tracking]' or set "
            "tracking.tensorboard: false"
        ) from None
    local = RunStorage.at(job.run_uri).local_path(TENSORBOARD_DIR)
    if local is None:
        raise SinkUnavailable(
            f"run.storage_dir {job.run.storage_dir!r} is not a local directory; TensorBoard "
            "event files are written locally only"
        )
    return TensorBoardSink(SummaryWriter(log_dir=str(local)))


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def on_start(self, event: StartEvent) -> None:
        import yaml

        text = yaml.safe_dump(event.job, sort_keys=False)
        self.writer.add_text("recipe", f"```yaml\n{text}\n```", 0)

    def on_step(self, event: StepEvent) -> None:
        scalars = {
            "train/loss": event.loss,
            "lr": event.lr,
            "throughput/samples_per_second": event.samples_per_second,
            "throughput/tflops": event.tflops,
            "throughput/mfu": event.mfu,
        }
        for rank, seconds in enumerate(event.ranks.step_seconds):
            scalars[f"ranks/step_seconds/rank{rank}"] = seconds
            scalars[f"ranks/data_wait_seconds/rank{rank}"] = event.ranks.data_wait_seconds[rank]
            scalars[f"ranks/local_seconds/rank{rank}"] = event.ranks.local_seconds[rank]
            scalars[f"ranks/memory_bytes/rank{rank}"] = event.ranks.memory_bytes[rank]
        self._scalars(scalars, event.step)

    def on_epoch(self, event: EpochEvent) -> None:
        self._scalars({**event.metrics, "epoch": event.epoch}, event.step)

    def on_eval(self, event: EvalEvent) -> None:
        if event.split == "test":
            self._scalars(event.metrics, event.step)

    def on_straggler(self, event: StragglerEvent) -> None:
        self._scalars({f"stragglers/rank{event.rank}/slower_by": event.slower_by}, event.step)

    def _scalars(self, values: Mapping[str, float | None], step: int) -> None:
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

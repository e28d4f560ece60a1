"""The TensorBoard sink: event files under ``<run>/tensorboard/`` (rank 0).

Scalars per logged step (loss, lr, throughput, every rank's step time, data wait, local work
and memory), per epoch (every train and val metric), the test metrics at the end and named
stragglers, all against the optimizer step (names: ``convoy.integrations.scalars``); the
resolved recipe and the summary as text. No hparams: ``SummaryWriter.add_hparams`` writes a
run of its own per call, and the recipe is in the text tab (and in MLflow's params).

Every attempt of a run writes a new event file next to the earlier ones (the writer names
files by time, host and process), so a resumed run appends and TensorBoard shows one curve.
An ``s3://`` run writes into a local staging folder and uploads its event file to
``<run>/tensorboard/`` after every epoch and at the end.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from convoy.config import Job
from convoy.distributed import WorkerContext
from convoy.engine.events import (
    EndEvent,
    EpochEvent,
    EvalEvent,
    Sink,
    StartEvent,
    StepEvent,
    StragglerEvent,
)
from convoy.engine.sinks import SinkUnavailable
from convoy.imports import missing_extra
from convoy.integrations.scalars import (
    epoch_scalars,
    eval_scalars,
    step_scalars,
    straggler_scalars,
)
from convoy.storage import RunStorage

TENSORBOARD_DIR = "tensorboard"
PACKAGE = "tensorboard"
MISSING = (
    f"{missing_extra('the TensorBoard sink', PACKAGE, 'tracking')}, "
    "or set tracking.tensorboard: false"
)
"""Why the sink is off where TensorBoard is not installed (``convoy.preflight`` says it)."""


def build(job: Job, ctx: WorkerContext) -> Sink:
    """A TensorBoard sink writing into the run directory (``s3://`` runs stage locally)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # the tracking extra (tensorboard)
    except ImportError:
        raise SinkUnavailable(MISSING) from None
    storage = RunStorage.at(job.run_uri)
    local = storage.local_path(TENSORBOARD_DIR)
    if local is not None:
        return TensorBoardSink(SummaryWriter(log_dir=str(local)))
    staging = Path(tempfile.mkdtemp(prefix="convoy-tensorboard-"))
    return TensorBoardSink(SummaryWriter(log_dir=str(staging)), Upload(storage, staging))


class Upload:
    """Copies a local staging folder's event files to ``<run>/tensorboard/`` (remote runs)."""

    def __init__(self, storage: RunStorage, staging: Path) -> None:
        self.storage = storage
        self.staging = staging

    def __call__(self) -> None:
        self.storage.upload(self.staging, TENSORBOARD_DIR)

    def remove_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, writer: Any, upload: Upload | None = None) -> None:
        self.writer = writer
        self.upload = upload

    def on_start(self, event: StartEvent) -> None:
        text = yaml.safe_dump(event.job, sort_keys=False)
        self.writer.add_text("recipe", _code_block(text, "yaml"), 0)

    def on_step(self, event: StepEvent) -> None:
        self._scalars(step_scalars(event), event.step)

    def on_epoch(self, event: EpochEvent) -> None:
        self._scalars(epoch_scalars(event), event.step)
        if self.upload is not None:  # a remote run keeps up to the last epoch if killed
            self.upload()

    def on_eval(self, event: EvalEvent) -> None:
        self._scalars(eval_scalars(event), event.step)

    def on_straggler(self, event: StragglerEvent) -> None:
        self._scalars(straggler_scalars(event), event.step)

    def on_end(self, event: EndEvent) -> None:
        text = json.dumps(event.summary, indent=2, default=str)
        self.writer.add_text("summary", _code_block(text, "json"), event.summary.get("steps", 0))
        self.writer.flush()

    def _scalars(self, values: Mapping[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self.upload is not None:
            try:
                self.upload()
            finally:
                self.upload.remove_staging()


def _code_block(text: str, language: str) -> str:
    # TensorBoard renders text summaries as markdown; a fenced block keeps the indentation.
    return f"```{language}\n{text}\n```"

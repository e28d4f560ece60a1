"""Ray Train reports out of the event stream: every finished epoch, every committed checkpoint
and the end of the run become a ``ray.train.report`` (so Tune and its schedulers see them).

``report()`` is a barrier every rank calls equally often, and Ray takes at most one pending
report per worker per health-check interval (2 s by default): called in the loop it would
stall training. So each rank hands its reports to one background thread that reports them in
order; every rank sees the same events, so every rank reports the same sequence.

How far the loop may run ahead of Ray is bounded, for two reasons:

- An epoch report waits only for the previous report to be handed to Ray. An epoch longer
  than Ray's cadence never waits; shorter ones are held to it. Unbounded, the run would
  finish long before Tune saw its first epochs: ASHA's stop would come too late to save
  anything, and ``close`` would then wait out the backlog, 2 s per report.
- A committed checkpoint's report is handed to Ray before training goes on. A failure right
  after a commit must not lose Ray's record of it, which ``get_checkpoint()`` restarts from.

``close`` waits for the queue to drain; the last report is the run's final metrics.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from convoy.engine.events import EpochEvent, Sink

_DONE = object()


class RayTrainReportSink(Sink):
    """Ray Train reports from a background thread, on every rank."""

    name = "ray-train-report"
    required = True  # a lost report would leave the other ranks waiting at the barrier

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed = False
        """Sticky: once a report failed, nothing waits on the thread again."""
        self._handed_over = threading.Condition()
        self._pending = 0
        """Reports submitted whose ``ray.train.report`` has not returned yet."""
        self._epoch = 0
        """The last finished epoch: every report carries it (Tune's time axis for ASHA)."""
        self._step = 0

    def on_epoch(self, event: EpochEvent) -> None:
        self._wait_until_pending(0)
        self._epoch, self._step = event.epoch, event.step
        self._submit({**event.metrics, "epoch": event.epoch, "step": event.step}, None)

    def report_checkpoint(self, metrics: dict[str, Any], checkpoint: Any) -> None:
        """A committed checkpoint (``ray.train.Checkpoint``, already in place: no upload).

        Returns once Ray holds the report, so a failure after the commit keeps it registered.
        """
        self._submit({"epoch": self._epoch, "step": self._step, **metrics}, checkpoint)
        self._wait_until_pending(0)

    def finish(self, metrics: dict[str, Any]) -> None:
        """Report the run's final metrics, wait until every report is taken, stop the thread."""
        self._submit({"epoch": self._epoch, "step": self._step, **metrics, "done": True}, None)
        self.close()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_DONE)
            self._thread.join()
            self._thread = None
        self._raise_if_failed()

    def _submit(self, metrics: dict[str, Any], checkpoint: Any) -> None:
        self._raise_if_failed()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._report_in_order, name="convoy-ray-report", daemon=True
            )
            self._thread.start()
        with self._handed_over:
            self._pending += 1
        self._queue.put((metrics, checkpoint))

    def _wait_until_pending(self, most: int) -> None:
        """Block until at most ``most`` reports are still on their way to Ray (or one failed)."""
        with self._handed_over:
            self._handed_over.wait_for(lambda: self._failed or self._pending <= most)
        self._raise_if_failed()

    def _report_in_order(self) -> None:
        import ray.train  # the ray extra
        from ray.train import CheckpointUploadMode

        while (item := self._queue.get()) is not _DONE:
            metrics, checkpoint = item
            try:
                if checkpoint is None:
                    ray.train.report(metrics)
                else:
                    ray.train.report(
                        metrics,
                        checkpoint=checkpoint,
                        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
                    )
            except BaseException as exc:  # re-raised on the training thread
                with self._handed_over:
                    self._error, self._failed = exc, True
                    self._handed_over.notify_all()
                return
            with self._handed_over:
                self._pending -= 1
                self._handed_over.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"ray.train.report failed: {error}") from error

"""A stop signal to a Ray run's driver (Ctrl-C, ``kill -TERM``) turned into the workers' stop
request: the step they finish is saved, and the run ends as ``local``'s does.

Ray Train's workers run the loop off their main thread, where no signal arrives, and in
sessions of their own, where a terminal's Ctrl-C does not reach them; only the driver gets
it. Ray Train's own Ctrl-C handler aborts the run, which loses every step since the last
checkpoint, so the launcher puts ``DriverStop`` in its place: the driver writes the request
under the run's key in the cluster's key-value store, and each worker reads that key at step
boundaries (``DriverStopReader``, at most every ``READ_INTERVAL_S``: a GCS round trip).
The loop's stop agreement does the rest: every rank saves the same step and stops. The
workers then return as from a finished run (so no failure policy restarts them), and the
driver raises ``StopRequested`` with the line rank 0 wrote. A second Ctrl-C interrupts at
once, as under ``local``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from convoy.engine.stop import (
    STOP_SIGNALS,
    StopNotice,
    StopRequested,
    describe,
    grace_period_s,
    handling_stop_signals,
    signal_notice,
)

NAMESPACE = "convoy_stop"
READ_INTERVAL_S = 0.2
"""How often, at most, a worker asks the GCS for its driver's request: a round trip of about
a millisecond, so a digits_mlp step of 3 ms does not pay one each."""

SIGNAL_SOURCES = frozenset(sig.name for sig in STOP_SIGNALS)


def from_driver(notice: StopNotice | None) -> bool:
    """Whether a Ray worker's agreed stop came from its driver: no other signal reaches a
    loop that runs off the main thread, so a notice named after a signal is the driver's."""
    return notice is not None and notice.source in SIGNAL_SOURCES


class DriverStop:
    """The driver's side: the first stop signal recorded (``notice``) and, once the workers
    run (``publish_to``), written for them under ``key``; a second SIGINT interrupts."""

    def __init__(self) -> None:
        self.key = uuid.uuid4().hex
        self.notice: StopNotice | None = None
        self._published = False
        self._connected = False
        self._listening = False

    @contextlib.contextmanager
    def listening(self, enabled: bool = True) -> Iterator[DriverStop]:
        """Record stop signals while inside (main thread only), then restore the handlers that
        were there and remove the key. ``enabled`` False (``run.stop_on_signal: false``):
        nothing is listened for, and Ray Train's own handler applies."""
        if not enabled:
            yield self
            return
        try:
            with handling_stop_signals(self._record):
                self._listening = True
                yield self
        finally:
            self._listening = False
            self._forget()

    @property
    def workers_key(self) -> str | None:
        """What the workers read (None while nothing is listened for)."""
        return self.key if self._listening else None

    def publish_from_now(self) -> None:
        """The workers are about to start: a request that comes from now on is written for
        them. One that came before (while Ray started or the job was checked) ends the run
        here, before any worker starts. Also takes SIGTERM back from ``ray.init``, which
        sets its own (``sys.exit``) as it connects."""
        if self.notice is not None:
            raise StopRequested(
                f"stopped on {describe(self.notice)} before training started", saved=False
            )
        if self._listening and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._record)
        self._connected = True

    def _record(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.notice is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        if self.notice is not None:
            return
        self.notice = signal_notice(signum, grace_period_s())
        if self._connected:
            self._publish(self.notice)

    def _publish(self, notice: StopNotice) -> None:
        from ray.experimental import internal_kv

        value = json.dumps(dataclasses.asdict(notice))
        internal_kv._internal_kv_put(self.key, value, namespace=NAMESPACE)
        self._published = True

    def _forget(self) -> None:
        """Remove the key: on a shared cluster it would outlive the run."""
        if not self._published:
            return
        from ray.experimental import internal_kv

        with contextlib.suppress(Exception):  # Ray already stopped: nothing is left to remove
            if internal_kv._internal_kv_initialized():
                internal_kv._internal_kv_del(self.key, namespace=NAMESPACE)


class DriverStopReader:
    """A worker's side: the driver's request under ``key``, read at most every
    ``READ_INTERVAL_S`` (never when ``key`` is None: a Tune trial, whose driver is Tune's)."""

    def __init__(self, key: str | None, interval_s: float = READ_INTERVAL_S) -> None:
        self.key = key
        self.interval_s = interval_s
        self._read_at = -float("inf")

    def poll(self) -> StopNotice | None:
        if self.key is None:
            return None
        now = time.monotonic()
        if now - self._read_at < self.interval_s:
            return None
        self._read_at = now
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(self.key, namespace=NAMESPACE)
        if not value:
            return None
        fields = json.loads(value)
        fields["preempted_ranks"] = tuple(fields["preempted_ranks"])
        return StopNotice(**fields)

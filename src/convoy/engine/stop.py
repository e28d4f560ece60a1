"""Stop requests: a signal (a spot or scheduler notice, ``kill -TERM``, Ctrl-C) turned into a
checkpoint of the step just finished and a clean, resumable exit.

A signal only sets a flag (``StopWatch``). At each step boundary every rank asks whether
any rank was asked to stop (``StopWatch.agreed``: one small all-reduce, overlapped with the
next step), so all of them stop after the same step; the loop then saves that step's checkpoint (committed atomically, as
every checkpoint is) and raises ``StopRequested``. ``convoy train`` prints how to resume and
exits with ``STOPPED_EXIT_CODE``; a torchrun worker exits with it too, so ``--max-restarts``
restarts from the checkpoint. Running the same command again resumes with no step lost and
none repeated.

Handlers are installed only in a process's main thread (where Python delivers signals): the
local launcher's process and torchrun's workers. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from convoy.distributed import is_distributed
from convoy.errors import ConvoyError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""What a stop request arrives as: SIGTERM (Kubernetes, torchrun's agent, spot notices
turned into it), SIGUSR1 (SLURM's warning before the wall time), SIGINT (Ctrl-C)."""

STOPPED_FILE = "stopped.txt"
"""Rank 0 writes why and where the run stopped here, for a launcher that sees only an exit
code (torchrun's agent exits 1 whatever its workers' codes were)."""

STOPPED_EXIT_CODE = 75
"""``EX_TEMPFAIL``: stopped on request with a checkpoint, to be resumed (not a failure)."""


class StopRequested(ConvoyError):
    """Training stopped on a request, after saving the step it had finished (``saved``:
    False where checkpointing is off)."""

    def __init__(self, message: str, saved: bool = True) -> None:
        super().__init__(message)
        self.saved = saved


@contextlib.contextmanager
def forwarded_to(process: subprocess.Popen[Any]) -> Iterator[None]:
    """While inside, a stop signal to this process (``convoy train`` driving torchrun) is
    passed on to ``process`` as SIGTERM: torchrun's agent sends its workers SIGTERM and
    waits for them, and they save and stop as above (it would die of a SIGUSR1)."""

    def forward(signum: int, frame: Any) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    with _handling(forward):
        yield


@contextlib.contextmanager
def _handling(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for every stop signal while inside, then the handlers that were there. In
    the main thread only: Python delivers signals to no other."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


class StopWatch:
    """Records the first stop signal this process gets; ``agreed`` shares it with the others."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        """False (``run.stop_on_signal: false``): no handlers, and nothing to agree on."""
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._pending: tuple[torch.Tensor, Any] | None = None
        """The flags summed in the background since the last call, and their work handle."""

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopWatch]:
        """Record ``STOP_SIGNALS`` while inside, then restore the handlers that were there.
        Off the main thread (Ray Train's workers run the loop in a thread of their own) no
        signal can arrive: nothing to agree on either, on every rank alike."""
        if threading.current_thread() is not threading.main_thread():
            self.enabled = False
        if not self.enabled:
            yield self
            return
        try:
            with _handling(self._record):
                yield self
        finally:
            self.settle()

    def _record(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal_name is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank had been asked to stop by the previous call: the same answer on
        every rank (a collective: every rank calls it at the same step boundaries).

        The ranks' flags are summed in the background (an asynchronous one-element
        all-reduce whose latency hides behind the next step) and read at the next call, so a
        request is acted on one step boundary later: still after a finished step, and a step
        of a few milliseconds does not wait for a collective's round trip."""
        if not self.enabled:
            return False
        asked = torch.tensor(float(self.signal_name is not None), device=device)
        if not is_distributed():
            return bool(asked.item() > 0)
        previous, self._pending = self._pending, (asked, dist.all_reduce(asked, async_op=True))
        if previous is None:
            return False
        flags, work = previous
        work.wait()
        return bool(flags.item() > 0)

    def settle(self) -> None:
        """Wait for the last sum in flight (before the process group goes)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None

    def describe(self) -> str:
        """What the request was and how long ago it came, for the log."""
        if self.signal_name is None or self.received_at is None:
            return "a stop requested on another rank"
        return f"{self.signal_name} {time.monotonic() - self.received_at:.1f} s ago"

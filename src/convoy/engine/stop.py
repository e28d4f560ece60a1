"""Stop requests: a signal (a spot or scheduler notice, ``kill -TERM``, Ctrl-C) turned into a
checkpoint of the step just finished and a clean, resumable exit.

A signal, a launcher's notice (Ray's node preemption) or an injected fault only records a
``StopNotice`` (``StopWatch``). At step boundaries, at most about every
``POLL_INTERVAL_S``, every rank asks whether any rank was asked to stop
(``StopWatch.agreed``: one small asynchronous all-reduce, overlapped with the next steps),
so all of them stop after the same step; the loop then saves that step's checkpoint
(committed atomically, as every checkpoint is, unless the notice's deadline leaves less
time than the last save took) and raises ``StopRequested``. ``convoy train`` prints how to resume and
exits with ``STOPPED_EXIT_CODE``; a torchrun worker exits with it too, so ``--max-restarts``
restarts from the checkpoint. Running the same command again resumes with no step lost and
none repeated.

Handlers are installed only in a process's main thread (where Python delivers signals): the
local launcher's process and torchrun's workers. A second Ctrl-C interrupts at once.

What the loop does with an agreed notice is decided here too (``stop_after_step``): save the
step or not (a deadline too close for a save falls back to the last checkpoint; rank 0 judges
for all), or, under relaxed collectives, let rank 0 save alone; then say so and raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from convoy.engine.events import EventBus
from convoy.errors import ConvoyError

if TYPE_CHECKING:
    # Annotations only. The CLI, k8s (the preStop hook's `convoy k8s drain-node`) and the
    # launchers' drivers import this module for its names; torch is imported where the ranks
    # agree (the workers have it already), and convoy.checkpoint brings torch's distributed
    # checkpointing (seconds to import).
    import torch

    from convoy.checkpoint import CheckpointManager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""What a stop request arrives as: SIGTERM (Kubernetes, torchrun's agent, spot notices
turned into it), SIGUSR1 (SLURM's warning before the wall time), SIGINT (Ctrl-C)."""

STOPPED_FILE = "stopped.txt"
"""Rank 0 writes why and where the run stopped here, for a launcher that sees only an exit
code (torchrun's agent exits 1 whatever its workers' codes were)."""

STOPPED_EXIT_CODE = 75
"""``EX_TEMPFAIL``: stopped on request with a checkpoint, to be resumed (not a failure)."""

GRACE_ENV = "CONVOY_STOP_GRACE_S"

POLL_INTERVAL_S = 0.1
"""How often, at most, the ranks agree on stop requests. One collective per step cost about
0.5 ms on this 2-core machine (1.24x a 2.2 ms digits_mlp step); one per ~0.1 s stays under
1% at any step time, and a notice is still acted on well within a second."""
MAX_POLL_GAP = 1000


class StopRequested(ConvoyError):
    """Training stopped on a request, after saving the step it had finished (``saved``:
    False where checkpointing is off)."""

    def __init__(
        self,
        message: str,
        saved: bool = True,
        shown: bool = False,
        notice: StopNotice | None = None,
    ) -> None:
        super().__init__(message)
        self.saved = saved
        self.shown = shown
        """The message is on the console already (the loop ran in this process)."""
        self.notice = notice
        """The request the run stopped on, as the launcher confirmed it."""


@contextlib.contextmanager
def handling_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
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


@dataclass(frozen=True)
class StopNotice:
    """A request to stop: what sent it, when it came and when the process is expected to go
    (wall-clock seconds, ``time.time()``, so ranks on different nodes compare them)."""

    source: str
    """``SIGTERM``, ``preemption of node 5f0c...`` or ``fault injection``."""
    received_at: float
    deadline: float | None = None
    """When the process will be killed; None when the sender did not say."""
    preempted_ranks: tuple[int, ...] = ()
    """A node preemption's ranks: those that go with the node."""
    relaxed: bool = False
    """The other ranks save without waiting for ``preempted_ranks`` (Ray's relaxed
    collectives, where every rank holds the whole model: rank 0 saves alone)."""

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


class NoticeSource(Protocol):
    """A launcher's own source of notices (Ray Train's preemption watcher's mark)."""

    def poll(self) -> StopNotice | None:
        """This worker's notice, if any: read at every step boundary, without a collective."""

    def confirm(self, notice: StopNotice) -> StopNotice:
        """The agreed ``notice`` as the launcher sees it (which node, which ranks, its
        deadline), asked once on every rank after the agreement (it may be a collective)."""


def signal_notice(signum: int, grace_s: float | None) -> StopNotice:
    """The notice a stop signal gives: named after it, with a deadline ``grace_s`` after it
    came (None: unknown)."""
    now = time.time()
    return StopNotice(
        signal.Signals(signum).name, now, now + grace_s if grace_s is not None else None
    )


def grace_period_s() -> float | None:
    """``CONVOY_STOP_GRACE_S``: seconds between a stop signal and the kill that follows it.
    Rendered Kubernetes pods set it to their ``terminationGracePeriodSeconds``, so a SIGTERM
    there carries a deadline."""
    value = os.environ.get(GRACE_ENV)
    try:
        return float(value) if value else None
    except ValueError:
        return None


class StopWatch:
    """Records the first stop request this process gets; ``agreed`` shares it with the others.

    Requests come from signals (``installed``, main thread only), from a launcher's
    ``notices`` (Ray's preemption notices, read at each boundary) and from ``request``
    (fault injection)."""

    def __init__(
        self,
        enabled: bool = True,
        notices: NoticeSource | None = None,
        grace_s: float | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.enabled = enabled
        """False (``run.stop_on_signal: false``): no handlers, and nothing to agree on."""
        self.notices = notices
        self.grace_s = grace_s
        """A signal's deadline: this long after it came (None: unknown)."""
        self.notice: StopNotice | None = None
        self.poll_interval_s = poll_interval_s
        self._pending: tuple[torch.Tensor, Any] | None = None
        """The flags reduced in the background since the last poll, and their work handle."""
        self._until_poll = 1
        """Boundaries until the next poll (the schedule every rank read from rank 0)."""
        self._polled_at: float | None = None
        self._applied_gap = 1
        """Boundaries between the last two polls (what rank 0's timing is divided by)."""

    @property
    def signal_name(self) -> str | None:
        return self.notice.source if self.notice is not None else None

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopWatch]:
        """Record ``STOP_SIGNALS`` while inside, then restore the handlers that were there.
        Off the main thread (Ray Train's workers run the loop in a thread of their own) no
        signal can arrive; there only the launcher's notices count, and without them there is
        nothing to agree on, on every rank alike."""
        if threading.current_thread() is not threading.main_thread() and self.notices is None:
            self.enabled = False
        if not self.enabled:
            yield self
            return
        try:
            with handling_stop_signals(self._record):
                yield self
        finally:
            self.settle()

    def _record(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.notice is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without a checkpoint
        self.request(signal_notice(signum, self.grace_s))

    def request(self, notice: StopNotice) -> None:
        """Record ``notice`` unless one came first (the first request is the one acted on)."""
        if self.notice is None:
            self.notice = notice

    def agreed(self, device: torch.device) -> StopNotice | None:
        """The stop request any rank had by the previous poll, with the earliest deadline any
        rank knows: the same answer on every rank (a collective: every rank calls it at the
        same step boundaries). None when there is none.

        The ranks poll at some boundaries only, at most about every ``poll_interval_s``, so
        steps of a few milliseconds do not each pay a collective. At a poll, the ranks' flags
        and deadlines are reduced in the background (an asynchronous all-reduce whose latency
        hides behind the next steps) and read at the next poll; the reduction also carries
        rank 0's count of boundaries until that next poll, from its step time, so every rank
        follows the same schedule. A request is acted on within about two intervals, always
        after a finished step."""
        if not self.enabled:
            return None
        if self.notice is None and self.notices is not None:
            self.notice = self.notices.poll()
        notice = self.notice
        from convoy.distributed import is_distributed  # torch: see the imports above

        if not is_distributed():
            return notice
        self._until_poll -= 1
        if self._until_poll > 0:
            return None
        import torch  # at a poll only, not at every boundary
        import torch.distributed as dist

        # MAX of (asked, -deadline, boundaries to the next poll): whether any rank was asked,
        # the earliest deadline, and rank 0's schedule (the others send 1).
        local = torch.tensor(
            [
                float(notice is not None),
                -notice.deadline if notice and notice.deadline is not None else -math.inf,
                float(self._next_gap() if dist.get_rank() == 0 else 1),
            ],
            dtype=torch.float64,
            device=device,
        )
        work = dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._pending = self._pending, (local, work)
        if previous is None:
            self._until_poll = self._applied_gap = 1
            return None
        reduced, previous_work = previous
        previous_work.wait()
        asked, negative_deadline, gap = reduced.tolist()
        self._until_poll = self._applied_gap = int(gap)
        if asked <= 0:
            return None
        deadline = -negative_deadline if math.isfinite(negative_deadline) else None
        if notice is None:
            return StopNotice("a stop requested on another rank", time.time(), deadline)
        return dataclasses.replace(notice, deadline=deadline)

    def _next_gap(self) -> int:
        """Rank 0: boundaries until the next poll, so that polls come about every
        ``poll_interval_s`` at the time per boundary seen since the last one."""
        now = time.perf_counter()
        since, self._polled_at = self._polled_at, now
        if since is None or self.poll_interval_s <= 0:
            return 1
        per_boundary = max((now - since) / self._applied_gap, 1e-9)
        return max(1, min(MAX_POLL_GAP, math.ceil(self.poll_interval_s / per_boundary)))

    def confirm(self, notice: StopNotice) -> StopNotice:
        """The agreed ``notice``, confirmed by the launcher's source (every rank, once)."""
        return self.notices.confirm(notice) if self.notices is not None else notice

    def settle(self) -> None:
        """Wait for the last reduction in flight (before the process group goes)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None


def describe(notice: StopNotice) -> str:
    """What the request was and how long ago it came, for the log."""
    if notice.source.startswith("a stop requested"):
        return notice.source
    return f"{notice.source} {time.time() - notice.received_at:.1f} s ago"


class StoppingRun(Protocol):
    """What stopping after a step reads of the loop's state (``TrainState``), and how it saves
    the step just finished."""

    rank: int
    step: int
    last_saved_step: int
    checkpoints: CheckpointManager | None
    stop: StopWatch
    events: EventBus

    def save_checkpoint(
        self,
        epoch: int,
        steps_per_epoch: int,
        metrics: dict[str, float] | None = None,
        asynchronous: bool = False,
        alone: bool = False,
    ) -> None: ...


def stop_after_step(
    run: StoppingRun,
    epoch: int,
    steps_per_epoch: int,
    notice: StopNotice,
    checkpoint_name: Callable[[int], str],
) -> NoReturn:
    """Save the step just finished (unless it is saved, or the notice leaves too little time
    to save it whole) and stop with ``StopRequested``. ``checkpoint_name``: what a step's
    checkpoint is called (``convoy.checkpoint.checkpoint_name``, passed in so that this module
    stays light to import)."""
    latest = run.last_saved_step if run.last_saved_step >= 0 else None
    notice = run.stop.confirm(notice)
    if notice.relaxed:
        _save_without_the_preempted(run, epoch, steps_per_epoch, notice, latest, checkpoint_name)
    notice, too_late = _judge_notice(run, notice)
    started = time.perf_counter()
    if run.checkpoints is None:
        saved = (
            "checkpointing is off (neither checkpoint.every_steps nor every_epochs is set), "
            "so nothing was saved"
        )
    elif too_late:
        since = (
            f"the same command resumes from {checkpoint_name(latest)}, the last checkpoint"
            if latest is not None
            else "no checkpoint was saved before it, so the same command starts again"
        )
        saved = f"not saved: {too_late}; {since} (a partial save is never loaded)"
    else:
        run.save_checkpoint(epoch, steps_per_epoch)
        run.checkpoints.wait()
        left = notice.seconds_left()
        margin = f", {_seconds(left)} before the deadline" if left is not None else ""
        saved = (
            f"checkpoint {checkpoint_name(run.step)} committed in "
            f"{_seconds(time.perf_counter() - started)}{margin}; the same command resumes from it"
        )
    message = f"stopped on {describe(notice)} after step {run.step}: {saved}"
    run.events.message(f"convoy: {message}")
    resumable = run.checkpoints is not None and (not too_late or latest is not None)
    raise StopRequested(message, saved=resumable, shown=True, notice=notice)


def _save_without_the_preempted(
    run: StoppingRun,
    epoch: int,
    steps_per_epoch: int,
    notice: StopNotice,
    latest: int | None,
    checkpoint_name: Callable[[int], str],
) -> NoReturn:
    """Relaxed collectives (ddp under Ray): rank 0 saves the whole state alone, without a
    collective; the other ranks that stay report the checkpoint once it is committed (Ray's
    report barrier then waits for them only); the preempted ranks do nothing. None of it
    waits for a rank that may already be gone."""
    checkpoints = run.checkpoints
    name = checkpoint_name(run.step)
    already = run.last_saved_step == run.step  # saved (and reported) by its own cadence
    if run.rank == 0:
        saved = "checkpointing is off, so nothing was saved"
        if checkpoints is not None:
            started = time.perf_counter()
            run.events.message(
                f"convoy: {notice.source} (ranks {list(notice.preempted_ranks)}): rank 0 saves "
                f"step {run.step} without waiting for them (relaxed collectives)"
            )
            too_late = _too_late(run, notice)
            if too_late:
                since = checkpoint_name(latest) if latest is not None else "the start"
                saved = f"not saved: {too_late}; the restart resumes from {since}"
            else:
                run.save_checkpoint(epoch, steps_per_epoch, alone=True)
                saved = (
                    f"checkpoint {name} committed by rank 0 alone in "
                    f"{_seconds(time.perf_counter() - started)} (relaxed collectives)"
                )
        run.events.message(f"convoy: stopped on {describe(notice)} after step {run.step}: {saved}")
    elif checkpoints is not None and not already and run.rank not in notice.preempted_ranks:
        checkpoints.report_once_committed(name, notice.deadline)
    raise StopRequested(f"stopped on {describe(notice)}", shown=True, notice=notice)


def _too_late(run: StoppingRun, notice: StopNotice) -> str | None:
    """Why this rank's save would not finish before the deadline, or None."""
    left = notice.seconds_left()
    needed = run.checkpoints.save_seconds if run.checkpoints is not None else None
    if run.last_saved_step == run.step or left is None or needed is None or left >= needed:
        return None
    return f"{_seconds(max(left, 0.0))} were left and the last save took {_seconds(needed)}"


def _judge_notice(run: StoppingRun, notice: StopNotice) -> tuple[StopNotice, str | None]:
    """The notice as the rank that got it sent it (the others know only its deadline), and
    why a save would not finish before that deadline, or None when it would or nobody knows.
    Rank 0 judges for all (every rank saves or none does); one gather, once per run."""
    verdict = _too_late(run, notice)
    own = None if notice.source.startswith("a stop requested") else notice
    from convoy.distributed import all_gather_objects  # torch: see the imports above

    gathered = all_gather_objects((own, verdict))
    sent = next((n for n, _ in gathered if n is not None), notice)
    return dataclasses.replace(sent, deadline=notice.deadline), gathered[0][1]


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 1 else f"{value:.1f} s"

"""Live monitoring of the workers: local-work timing and straggler detection.

In synchronous training every rank waits for the slowest in the gradient all-reduce, so each
rank's step time is the same and cannot show which rank holds the others up. What differs is
the work a rank does before it waits on anyone: its data wait and its forward pass (under
``single`` and ``ddp``; under ``fsdp``/``fsdp2`` the forward also gathers parameters, so
there a slow rank's delay spreads to all and only a data-wait straggler stands out).
Every logged step gathers those figures from each rank (the median step's, so one hiccup
does not count); a rank slower than the median of the other ranks by more than
``monitor.straggler_margin`` (and ``monitor.straggler_min_seconds``) at
``monitor.straggler_patience`` logged steps in a row is named.
"""

from __future__ import annotations

import statistics
import time
from types import TracebackType

import torch

from convoy.config import MonitorConfig
from convoy.distributed import all_gather_floats, peak_memory_bytes
from convoy.engine.events import RankStats, StragglerEvent


class ForwardTimer:
    """Adds up the seconds spent inside ``with timer:`` blocks (device time on CUDA, whose
    kernels run asynchronously; read with ``seconds()`` once, after the blocks: on CUDA it
    waits for them, so the loop reads it at a logged step, never in the step itself).
    ``discount`` seconds (compilation inside a block) are left out."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.total = 0.0
        self.discount = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start = 0.0

    def __enter__(self) -> ForwardTimer:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, torch.cuda.Event(enable_timing=True)))
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.cuda:
            self._events[-1][1].record()
        else:
            self.total += time.perf_counter() - self._start

    def seconds(self) -> float:
        if self.cuda:
            for start, end in self._events:
                end.synchronize()
                self.total += start.elapsed_time(end) / 1e3
            self._events = []
        return max(0.0, self.total - self.discount)


class StepClock:
    """Each step's duration, without waiting for the device inside a step.

    On CPU a step's duration is its wall time. On CUDA the host runs ahead of the kernels it
    queues, so its wall time says little; an event is recorded where the step starts and
    where it ends, and their distance on the device's timeline is the step's duration (the
    device's idle time inside the step included: waiting for the host, for data). ``resolve``
    reads the steps finished so far, waiting for the last one's end event: the loop calls it
    at logged steps, which wait for the device anyway. Time between steps (evaluation,
    checkpoints) is in no step.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: torch.cuda.Event | None = None
        self._pending: list[
            tuple[float, float, torch.cuda.Event | None, torch.cuda.Event | None]
        ] = []

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self, wall_seconds: float, discount: float = 0.0) -> None:
        """The step that ``start`` began ended; ``discount`` seconds of it (compilation)
        are not the step's."""
        end = None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._pending.append((wall_seconds, discount, self._start, end))

    def resolve(self) -> list[float]:
        """The durations of the steps ended since the last call, in order."""
        pending, self._pending = self._pending, []
        if pending and pending[-1][3] is not None:
            pending[-1][3].synchronize()
        durations = []
        for wall, discount, start, end in pending:
            seconds = wall if start is None or end is None else start.elapsed_time(end) / 1e3
            durations.append(max(0.0, seconds - discount))
        return durations


def gather_rank_stats(
    step_seconds: float,
    data_wait_seconds: float,
    local_seconds: float,
    device: torch.device,
    *extra: float,
) -> tuple[RankStats, list[list[float]]]:
    """Every rank's figures (and peak memory) in one small all-gather; returns them as
    ``RankStats`` and, per rank, the ``extra`` values in the order given."""
    memory = float(peak_memory_bytes(device))
    gathered = all_gather_floats(
        [step_seconds, data_wait_seconds, local_seconds, memory, *extra], device
    )
    stats = RankStats(
        step_seconds=[rank[0] for rank in gathered],
        data_wait_seconds=[rank[1] for rank in gathered],
        local_seconds=[rank[2] for rank in gathered],
        memory_bytes=[int(rank[3]) for rank in gathered],
    )
    return stats, [list(rank[4:]) for rank in gathered]


def find_stragglers(step: int, ranks: RankStats, cfg: MonitorConfig) -> list[StragglerEvent]:
    """The ranks whose local work per step exceeds the median of the other ranks' by the
    margin. (Leaving the rank out of its own reference matters for small worlds: with two
    ranks, the median of all would be the mean, and would halve a straggler's lead.)"""
    local = ranks.local_seconds
    found = []
    for rank, seconds in enumerate(local):
        others = local[:rank] + local[rank + 1 :]
        if not others:
            continue
        median = statistics.median(others)
        slower = seconds - median
        if slower > cfg.straggler_min_seconds and slower > cfg.straggler_margin * median:
            found.append(StragglerEvent(step, rank, seconds, median, ranks.data_wait_seconds[rank]))
    return found


class StragglerWatch:
    """Names the ranks that ``find_stragglers`` finds at ``monitor.straggler_patience`` logged
    steps in a row. The first logged step of a run (or of a restarted attempt) is skipped: its
    interval holds the warm-up (first batches, thread pools, the allocator), and a rank slow
    to start is not a straggler."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.intervals = 0
        self.streak: dict[int, int] = {}
        """Logged steps in a row at which each rank was over the margin."""

    def check(self, step: int, ranks: RankStats) -> list[StragglerEvent]:
        self.intervals += 1
        if self.intervals == 1:
            return []
        found = find_stragglers(step, ranks, self.cfg)
        self.streak = {s.rank: self.streak.get(s.rank, 0) + 1 for s in found}
        return [s for s in found if self.streak[s.rank] >= self.cfg.straggler_patience]

"""Ranks agree on a stop request at the same step boundary, with the earliest deadline any
of them knows, though only one rank got it (a signal to one process, a notice to one node)."""

from __future__ import annotations

import time

import pytest
import torch

from convoy.distributed import WorkerContext, join_process_group
from convoy.engine.stop import StopNotice, StopWatch
from convoy.testing import run_on_gloo

pytestmark = pytest.mark.distributed
DEADLINE = 4_000_000_000.5  # a wall-clock time, the same in every process


def boundaries(ctx: WorkerContext) -> list[tuple[str, float | None] | None]:
    """Five step boundaries; rank 1 is asked to stop just before the third."""
    join_process_group(ctx, timeout_s=60)
    watch = StopWatch(poll_interval_s=0)  # a poll at every boundary
    seen: list[tuple[str, float | None] | None] = []
    for boundary in range(5):
        if boundary == 2 and ctx.rank == 1:
            watch.request(StopNotice("SIGTERM", time.time(), DEADLINE))
        notice = watch.agreed(torch.device("cpu"))
        seen.append(None if notice is None else (notice.source, notice.deadline))
    watch.settle()
    return seen


def paced(ctx: WorkerContext) -> list[int]:
    """Boundaries 1 ms apart, polls every ~20 ms: where each rank sees the notice that rank 1
    got at boundary 30, and how many boundaries polled."""
    join_process_group(ctx, timeout_s=60)
    watch = StopWatch(poll_interval_s=0.02)
    polls, stopped_at = 0, -1
    for boundary in range(200):
        time.sleep(0.001)
        if boundary == 30 and ctx.rank == 1:
            watch.request(StopNotice("SIGTERM", time.time(), DEADLINE))
        before = watch._until_poll
        notice = watch.agreed(torch.device("cpu"))
        polls += before <= 1
        if notice is not None:
            stopped_at = boundary
            break
    watch.settle()
    return [stopped_at, polls]


def test_ranks_poll_on_one_schedule_set_by_rank_0s_step_time() -> None:
    (stop0, polls0), (stop1, polls1) = run_on_gloo(paced, 2)
    assert stop0 == stop1 > 30  # the same boundary on both ranks, after the notice
    assert polls0 == polls1 < stop0 // 3  # far fewer collectives than boundaries
    assert stop0 < 30 + 100  # within a few ~20-boundary intervals


def test_every_rank_stops_at_the_same_boundary_with_the_senders_deadline() -> None:
    rank0, rank1 = run_on_gloo(boundaries, 2)
    # Asked before boundary 2, shared by its reduction, read at boundary 3 on both ranks.
    assert rank0[:3] == rank1[:3] == [None, None, None]
    assert rank1[3] == ("SIGTERM", DEADLINE)
    assert rank0[3] == ("a stop requested on another rank", DEADLINE)
